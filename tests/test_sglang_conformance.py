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

from draftsmith.config import DraftingPoint, load_config
from draftsmith.export.convert import export_drafter
from draftsmith.extract.sglang_backend import EXTERNAL_PACKAGE, build_capture_launch
from draftsmith.extract.sglang_dump import ENV_ARCH, ENV_DIR, ENV_LAYERS
from draftsmith.serve.sglang_launch import SGLangLaunch, build_launch
from tests.conftest import REPO
from tests.sglang_conformance.env import ensure_env, python_env
from tests.test_export import make_drafter

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


# --------------------------------------------------------------------------- the parser

FIELDS = ["model_path", "tp_size", "port", "speculative_algorithm",
          "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
          "speculative_num_draft_tokens", "max_running_requests", "cuda_graph_max_bs_decode",
          "cuda_graph_backend_decode", "cuda_graph_backend_prefill", "disable_radix_cache",
          "chunked_prefill_size", "attn_dp_size", "enable_dp_attention", "context_length",
          "reasoning_parser", "tool_call_parser", "enable_metrics"]


def generation_server_command(example: Path) -> list[str]:
    """The generation server's command the example's comment gives (`# generation server:`)."""
    lines = example.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# generation server:")
    command = []
    for line in lines[start + 1:]:
        if not line.strip().startswith("#   "):
            break
        command += line.strip().removeprefix("#").split()
    return command


@pytest.fixture(scope="module")
def kimi_launches(tmp_path_factory, random_target_dir) -> dict[str, SGLangLaunch]:
    """Every command line draftsmith builds for the Kimi example: the capture server, the
    deployed speculative server, each sweep point's server, the baseline, and the generation
    server its comment gives."""
    config = load_config(KIMI)
    tmp = tmp_path_factory.mktemp("kimi")
    drafter, _ = make_drafter(random_target_dir)
    drafter_dir = tmp / "drafter"
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "deepseek", drafter_dir,
                   context_length=config.target.context_length)
    family, model = config.target.family, config.target.model
    launches = {
        "capture": build_capture_launch(
            config.extract, config.target, model, "KimiK25ForConditionalGeneration",
            config.extract.aux_layer_ids, tmp / "dumps"),
        "speculative": build_launch(config.deploy, config.target, drafter_dir, family, model),
        "baseline": build_launch(config.deploy, config.target, None, family, model),
    }
    for point in config.benchmark.sweep:  # as the benchmark launches each point
        launches[f"sweep {point.label}"] = build_launch(
            config.deploy.model_copy(update=point.model_dump()), config.target, drafter_dir,
            family, model)
    generation = generation_server_command(KIMI)
    launches["generation"] = SGLangLaunch(argv=generation, env={}, host="127.0.0.1",
                                          port=30000, drafter_dir=None)
    return launches


@pytest.fixture(scope="module")
def parsed(sglang_env, kimi_launches) -> dict[str, dict]:
    report = run_probe(sglang_env, "parse", stdin={
        "launches": [{"name": n, "launch": launch.model_dump()}
                     for n, launch in kimi_launches.items()], "fields": FIELDS})
    return {r["name"]: r for r in report["results"]}


def test_sglang_parses_every_kimi_command_line_without_deprecated_flags(parsed, kimi_launches):
    assert set(parsed) == set(kimi_launches)
    for name, result in parsed.items():
        assert "error" not in result, f"{name}: {result['error']}"
        assert result["deprecated"] == [], f"{name} uses deprecated flags: {result['deprecated']}"


def test_sglang_reads_the_speculative_settings_draftsmith_launches(parsed, kimi_launches):
    config = load_config(KIMI)
    spec = parsed["speculative"]["fields"]
    assert spec["speculative_algorithm"] == "EAGLE3"
    assert spec["speculative_draft_model_path"] == kimi_launches["speculative"].drafter_dir
    assert (spec["speculative_num_steps"], spec["speculative_eagle_topk"],
            spec["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert spec["tp_size"] == 8 and spec["context_length"] == 262144
    assert spec["cuda_graph_max_bs_decode"] == 8 and spec["enable_metrics"] is True
    for point in config.benchmark.sweep:
        fields = parsed[f"sweep {point.label}"]["fields"]
        assert DraftingPoint(num_steps=fields["speculative_num_steps"],
                             eagle_topk=fields["speculative_eagle_topk"],
                             num_draft_tokens=fields["speculative_num_draft_tokens"]) == point
    baseline = parsed["baseline"]["fields"]
    assert baseline["speculative_algorithm"] is None
    assert baseline["speculative_draft_model_path"] is None


def test_speculative_and_baseline_servers_get_the_same_max_running_requests(parsed):
    """SGLang caps an EAGLE server at 48 running requests when the flag is unset and leaves a
    plain one uncapped: both must be given the same value."""
    caps = {name: r["fields"]["max_running_requests"] for name, r in parsed.items()
            if name != "generation" and name != "capture"}
    assert set(caps.values()) == {48}, caps


def test_capture_server_flags_as_sglang_reads_them(parsed):
    capture = parsed["capture"]["fields"]
    assert capture["disable_radix_cache"] is True and capture["chunked_prefill_size"] == -1
    assert capture["cuda_graph_backend_decode"] == "disabled"
    assert capture["cuda_graph_backend_prefill"] == "disabled"
    assert capture["attn_dp_size"] == 1 and capture["enable_dp_attention"] is False
    assert capture["speculative_algorithm"] is None


def test_the_generation_server_uses_sglang_reasoning_parser_for_kimi(sglang_env, parsed):
    fields = parsed["generation"]["fields"]
    assert fields["reasoning_parser"] == "kimi_k2" and fields["tool_call_parser"] == "kimi_k2"
    parser = run_probe(sglang_env, "parsers", "kimi_k2")
    assert parser["detector"] == "KimiK2Detector"
    assert (parser["think_start"], parser["think_end"]) == ("<think>", "</think>")
    where, text = sglang_source(sglang_env, "srt/parser/template_detection.py")
    pin(where, function_source(where, text, "_is_kimi_k2"), r"<\|tool_calls_section_begin\|>",
        "SGLang picks kimi_k2 for Kimi's tokenizer (its tool-call section token)")
