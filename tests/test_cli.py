"""The `draftsmith` command: help, config checks, export / import / inspect.

(`run` and `demo` drive the Prefect flow: tests/test_pipeline_e2e.py runs `run` for real.)
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from draftsmith.cli import app
from tests.conftest import REPO
from tests.test_export import make_drafter

runner = CliRunner()


def text(result) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("demo", "run", "plan", "validate", "export", "import", "inspect"):
        assert command in result.output


def test_help_names_every_drafter_kind_and_both_engines():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in (r"EAGLE-3(?!\.)", r"EAGLE-3\.1", "DFlash", "SGLang", "vLLM"):
        assert re.search(name, text(result)), f"`draftsmith --help` does not name {name}"


def test_validate_accepts_the_demo_config():
    # The Kimi example names its missing files here (tests/test_checks.py).
    result = runner.invoke(app, ["validate", str(REPO / "examples" / "tiny.yaml")])
    assert result.exit_code == 0, result.output


def test_validate_names_a_bad_key_and_exits_2():
    result = runner.invoke(app, ["validate", str(REPO / "examples/tiny.yaml"),
                                 "--set", "train.epoch=3"])
    assert result.exit_code == 2
    assert "train.epoch" in text(result) and "unknown key" in text(result)


def test_an_error_quoting_a_list_keeps_its_brackets(tmp_path):
    """A config error's example, `benchmark.suite (e.g. [chat, code, math])`, is printed as
    written: rich markup had taken `[chat, code, math]` for a tag and dropped it."""
    result = runner.invoke(app, ["validate", str(REPO / "examples/tiny.yaml"),
                                 "--set", f"deploy.drafter={tmp_path}"])
    assert result.exit_code == 2
    assert "set benchmark.suite (e.g. [chat, code, math])" in text(result)


def test_plan_prints_every_stage_with_its_status_and_runs_nothing(tmp_path, random_target_dir):
    import yaml

    raw = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    for source in raw["data"]["sources"]:
        source["path"] = str(REPO / "examples" / source["path"])
    raw["target"]["model"] = str(random_target_dir)
    raw["run_root"] = str(tmp_path / "runs")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    result = runner.invoke(app, ["plan", str(config), "--set", "deploy.num_steps=4",
                                 "--set", "deploy.num_draft_tokens=5"])
    assert result.exit_code == 0, result.output
    out = text(result)
    for stage in ("generate", "merge", "extract", "train", "export", "deploy", "benchmark"):
        assert stage in out
    assert "no complete output of this stage yet" in out and "after generate" in out
    assert "deploy.num_steps=4 exceeds train.ttt_steps=3" in out
    assert not (tmp_path / "runs").exists()  # planned, not run


def test_run_refuses_an_unknown_stage():
    result = runner.invoke(app, ["run", str(REPO / "examples/tiny.yaml"), "--only", "training"])
    assert result.exit_code == 2 and "unknown stage" in text(result)


def test_compare_refuses_an_unknown_stage_to_stop_at_before_running_anything():
    result = runner.invoke(app, ["compare", str(REPO / "examples/tiny.yaml"), "--variant", "a",
                                 "--to", "training"])
    assert result.exit_code == 2 and "--to training: unknown stage" in text(result)
    assert "train" in text(result)  # the valid names


@pytest.fixture()
def native_drafter(random_target_dir, tmp_path):
    from draftsmith.export.native import save_native

    drafter, _ = make_drafter(random_target_dir)
    drafter_cfg = drafter.config.model_copy(update={"aux_layer_ids": [2, 3, 4]})
    drafter.config = drafter_cfg
    save_native(drafter, tmp_path / "native", {})
    return tmp_path


def test_export_import_inspect_round_trip(native_drafter):
    root = native_drafter
    result = runner.invoke(app, ["export", str(root / "native"), "--to", "sglang",
                                 "--out", str(root / "sglang"), "--family", "deepseek"])
    assert result.exit_code == 0, result.output
    config = json.loads((root / "sglang" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5]

    result = runner.invoke(app, ["import", str(root / "sglang"), "--out", str(root / "back"),
                                 "--family", "deepseek"])
    assert result.exit_code == 0, result.output
    assert "sglang layout" in text(result)

    result = runner.invoke(app, ["inspect", str(root / "sglang"), "--family", "deepseek"])
    assert result.exit_code == 0, result.output
    assert "[2, 3, 4]" in text(result) and "[3, 4, 5]" in text(result)
    assert "valid" in result.output


def test_export_refusal_and_inspect_of_a_broken_drafter_exit_nonzero(native_drafter):
    root = native_drafter
    result = runner.invoke(app, ["export", str(root / "native"), "--to", "onnx",
                                 "--out", str(root / "x")])
    # The refusal names the bad value and the layouts to choose from.
    assert result.exit_code == 2, result.output
    assert "'onnx'" in text(result) and "['sglang', 'speculators']" in text(result)
    (root / "native" / "drafter.safetensors").write_bytes(b"not a safetensors file")
    result = runner.invoke(app, ["inspect", str(root / "native")])
    assert result.exit_code != 0


def test_deploy_dry_run_prints_the_exact_command_and_environment(random_target_dir, tmp_path):
    from draftsmith.export.convert import export_drafter

    drafter, _ = make_drafter(random_target_dir)
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", tmp_path / "d")
    result = runner.invoke(app, [
        "deploy", str(REPO / "examples/kimi-k2.5-8gpu.yaml"), "--drafter", str(tmp_path / "d"),
        "--dry-run", "--set", "target.context_length=1024", "--set",
        "deploy.sglang_command=[python3, -m, sglang.launch_server]"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("NCCL_IB_DISABLE=0 python3 -m sglang.launch_server --model-path")
    for flag in ("--speculative-algorithm EAGLE3", "--speculative-num-steps 3",
                 "--speculative-eagle-topk 1", "--speculative-num-draft-tokens 4",
                 "--tp-size 8", "--cuda-graph-max-bs-decode 8"):
        assert flag in first
    payload = json.loads(result.output[result.output.index("{"):])
    assert payload["env"] == {"NCCL_IB_DISABLE": "0"} and payload["argv"][0] == "python3"


def test_deploy_refuses_a_drafter_shorter_than_the_served_context(random_target_dir,
                                                                  tmp_path):
    from draftsmith.export.convert import export_drafter

    drafter, _ = make_drafter(random_target_dir)
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", tmp_path / "d")
    result = runner.invoke(app, ["deploy", str(REPO / "examples/kimi-k2.5-8gpu.yaml"),
                                 "--drafter", str(tmp_path / "d"), "--dry-run"])
    assert result.exit_code == 2 and "--context-length 262144" in text(result)


def test_prefect_setup_refuses_a_host_named_twice_or_without_a_name():
    for hosts in (["gpu-a", "gpu-a=10.0.0.1"], ["=10.0.0.1"]):
        result = runner.invoke(app, ["prefect", "setup", str(REPO / "examples" / "tiny.yaml"),
                                     *(f"--host={h}" for h in hosts)])
        assert result.exit_code == 2, result.output
        assert "expected NAME or NAME=ADDRESS, each name once" in text(result)
