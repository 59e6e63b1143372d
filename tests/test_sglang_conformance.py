"""draftsmith against SGLang 0.5.23's own code, on a CPU.

SGLang runs in a subprocess from the test-only environment of tests/sglang_conformance/
(the wheel and the few packages its pure-Python modules import; the main venv's torch 2.13
CPU underneath). What imports there runs for real: the argument parser (ServerArgs,
prepare_server_args) reads every command line draftsmith's launchers build; the model
registry loads draftsmith's capture package through SGLANG_EXTERNAL_MODEL_PACKAGE; the aux-
state packer produces what the DeepSeek family hands the capture. What cannot import on a
CPU (model classes, the resolver pipeline, the server) is pinned by reading its source file
in that wheel: a version bump that changes a fact fails here, naming the file.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.extract.sglang_backend import EXTERNAL_PACKAGE
from draftsmith.extract.sglang_dump import ENV_ARCH, ENV_DIR, ENV_LAYERS
from tests.conftest import REPO
from tests.sglang_conformance.env import ensure_env, python_env

KIMI = REPO / "examples" / "kimi-k2.5-8gpu.yaml"
PROBE_TIMEOUT_S = 600  # a busy 2-core machine; importing SGLang takes ~6 s on an idle one


@pytest.fixture(scope="session")
def sglang_env() -> Path:
    return ensure_env()


def run_probe(env: Path, *args: str, stdin: dict | None = None,
              extra_env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.sglang_conformance.probe", *args], cwd=REPO,
        input=json.dumps(stdin) if stdin is not None else None, capture_output=True,
        text=True, env=python_env(env, extra_env), timeout=PROBE_TIMEOUT_S)
    marker = "\n@@probe@@"
    if result.returncode != 0 or marker not in result.stdout:
        raise AssertionError(f"probe {args} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return json.loads(result.stdout.rsplit(marker, 1)[1])


def sglang_source(env: Path, relative: str) -> tuple[str, str]:
    """(path, text) of one of SGLang's files in the environment."""
    path = env / "sglang" / relative
    assert path.is_file(), f"{path}: gone from this SGLang version; the fact pinned on it moved"
    return str(path), path.read_text()


def function_source(where: str, text: str, qualname: str) -> str:
    """The source of `Class.method` or `function` in a file, or a failure naming the file."""
    tree = ast.parse(text)
    *outer, name = qualname.split(".")
    scope = tree.body
    for part in outer:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        assert cls is not None, f"{where}: no class {part} (pinned: {qualname})"
        scope = cls.body
    node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.ClassDef)) and n.name == name), None)
    assert node is not None, f"{where}: no {qualname}; the fact pinned on it moved"
    return ast.get_source_segment(text, node)


def pin(where: str, code: str, pattern: str, fact: str) -> None:
    assert re.search(pattern, code), f"{where}: {fact} no longer holds (looked for {pattern!r})"


# --------------------------------------------------------------------------- the registry


@pytest.mark.parametrize(("arch", "owner", "packed"), [
    ("LlamaForCausalLM", "LlamaForCausalLM", False),
    ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", True),
])
def test_sglang_registry_serves_the_capture_class_for_the_architecture(
        sglang_env, tmp_path, arch, owner, packed):
    """SGLang's registry with SGLANG_EXTERNAL_MODEL_PACKAGE: draftsmith's class is registered
    under the architecture and still serves it once SGLang's built-ins are loaded; built on TP
    rank 0 it captures the right layers and writes, on rank 1 it does not; one forward (the
    DeepSeek model packing aux states with SGLang's own AuxHiddenStatePacker, Kimi-K2.5
    calling it with input_ids=None) leaves one dump per request with every token's states."""
    report = run_probe(sglang_env, "registry", extra_env={
        "SGLANG_EXTERNAL_MODEL_PACKAGE": EXTERNAL_PACKAGE, ENV_ARCH: arch,
        ENV_LAYERS: "1,3,5", ENV_DIR: str(tmp_path)})
    assert report["module"] == f"{EXTERNAL_PACKAGE}.capture_model", report
    assert report["name"] == arch and report["arch"] == arch
    assert report["bases"][0] == f"sglang.srt.models.draftsmith_standin.{arch}"
    assert report["registered_before_defaults"] and report["serves_after_defaults"]
    assert not report["warnings"], report["warnings"]
    ranks = report["ranks"]
    assert ranks["0"] == {"writer": True, "layers_to_capture": [2, 4, 6], "owner": owner}
    assert ranks["1"]["writer"] is False
    a, b = report["dumps"]["probe-a"], report["dumps"]["probe-b"]
    assert a["input_ids"] == [1, 2, 3, 4, 5] and b["input_ids"] == [6, 7, 8]
    hidden = 16  # the stand-in models' width
    assert a["aux"] == [5, 3 * hidden] and a["final"] == [5, hidden]
    assert b["aux"] == [3, 3 * hidden] and b["final"] == [3, hidden]
    assert a["metadata"]["layers_to_capture"] == "2,4,6"
    assert a["metadata"]["num_layers"] == "8" and a["metadata"]["model"] == owner
