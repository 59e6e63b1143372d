"""`draftsmith validate` (draftsmith/checks.py) finds what a run would fail on, before it runs:
missing or unreadable data, aux layer ids the target or an engine cannot take, drafting settings
against train.ttt_steps and the engine, busy ports, an unset API key; `--deep` loads the
target's config and tokenizer and renders the first records."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from draftsmith.checks import check_config
from draftsmith.cli import app
from draftsmith.config import load_config
from tests.ports import free_port

runner = CliRunner()


def text(result) -> str:
    return " ".join(result.output.split())


def write_config(tmp_path: Path, target_dir: Path, **sections) -> Path:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [
            {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
            + "\n" for i in range(30)))
    raw = {"run_root": str(tmp_path / "runs"), "target": {"model": str(target_dir)},
           "data": {"sources": [{"name": "d", "path": "data.jsonl"}]},
           "merge": {"draft_vocab_size": 64}}
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def findings(path: Path, deep: bool = False) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for f in check_config(load_config(path), deep=deep):
        out.setdefault(f.check, []).append((f.level, f.message))
    return out


def levels(found: dict, check: str) -> set[str]:
    return {level for level, _ in found.get(check, [])}


def test_a_sound_config_is_valid(random_target_dir, tmp_path):
    result = runner.invoke(app, ["validate", str(write_config(tmp_path, random_target_dir))])
    assert result.exit_code == 0, result.output
    out = text(result)
    assert "the first 20 records parse (kept 20)" in out and "8 layers" in out
    assert "aux layers: [1, 3, 4] (outputs; default) within 0..7" in out
    assert "ERROR" not in out and "valid" in out


def test_a_missing_data_file_fails_validate_naming_the_key(random_target_dir, tmp_path):
    config = write_config(tmp_path, random_target_dir,
                          data={"sources": [{"name": "gone", "path": "gone.jsonl"}]})
    result = runner.invoke(app, ["validate", str(config)])
    assert result.exit_code == 1
    out = text(result)
    assert f"data.sources[gone].path={tmp_path / 'gone.jsonl'}: file not found" in out
    assert "1 problem(s) a run would fail on" in out


@pytest.mark.parametrize(("first_line", "why"), [
    ('{"id": "x", "messages": [', "not valid JSON"),
    ('{"instruction": "i", "output": "o"}', "unknown record shape"),
])
def test_first_records_that_do_not_parse_fail_validate(random_target_dir, tmp_path, first_line,
                                                       why):
    (tmp_path / "data.jsonl").write_text(first_line + "\n")
    found = findings(write_config(tmp_path, random_target_dir))
    ((level, message),) = found["data d"]
    assert level == "error" and why in message and "data.jsonl:1" in message


def test_only_the_first_records_are_read(random_target_dir, tmp_path):
    """A big file costs validate its first records, not a read of the whole file."""
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]})
             for i in range(100)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n{torn by a crash\n")
    found = findings(write_config(tmp_path, random_target_dir))
    assert levels(found, "data d") == {"ok"}


def test_aux_layer_ids_beyond_the_target_fail_validate(random_target_dir, tmp_path):
    found = findings(write_config(tmp_path, random_target_dir,
                                  extract={"aux_layer_ids": [1, 4, 8]}))
    ((level, message),) = found["aux layers"]
    assert level == "error"
    assert "extract.aux_layer_ids=[1, 4, 8]: ids [8] are outside 0..7" in message
    assert str(random_target_dir / "config.json") in message


def test_empty_aux_layer_ids_are_refused_at_config_time(random_target_dir, tmp_path):
    result = runner.invoke(app, ["validate", str(write_config(tmp_path, random_target_dir)),
                                 "--set", "extract.aux_layer_ids=[]"])
    assert result.exit_code == 2
    assert "extract.aux_layer_ids=[]: the drafter needs at least one aux layer" in text(result)


def test_aux_ids_the_engine_cannot_express_fail_before_training(random_target_dir, tmp_path):
    """DeepSeek-family targets on SGLang cannot read the output of layer 0: export would
    refuse it only after extraction and training."""
    found = findings(write_config(tmp_path, random_target_dir, target={"family": "deepseek"},
                                  extract={"aux_layer_ids": [0, 3, 5]}))
    ((level, message),) = found["aux layers"]
    assert level == "error" and "export would refuse them after training" in message


def test_a_sglang_capture_needs_room_above_the_last_aux_layer(random_target_dir, tmp_path):
    found = findings(write_config(tmp_path, random_target_dir,
                                  extract={"backend": "sglang", "aux_layer_ids": [1, 3, 7],
                                           "sglang": {"port": free_port()}}))
    assert levels(found, "aux layers") == {"error"}
    assert "the largest id is 6" in found["aux layers"][0][1]


def test_a_draft_vocab_larger_than_the_target_vocab_fails_validate(random_target_dir, tmp_path):
    found = findings(write_config(tmp_path, random_target_dir,
                                  merge={"draft_vocab_size": 4096}))
    ((level, message),) = found["draft vocab"]
    assert level == "error" and "exceeds the target's vocab (512)" in message


def test_drafting_beyond_the_trained_steps_warns_and_a_layout_sglang_cannot_load_fails(
        random_target_dir, tmp_path):
    found = findings(write_config(tmp_path, random_target_dir, train={"ttt_steps": 2},
                                  deploy={"num_steps": 3, "eagle_topk": 1,
                                          "num_draft_tokens": 4}))
    assert levels(found, "drafting") == {"warning"}
    assert any("deploy.num_steps=3 exceeds train.ttt_steps=2" in m for _, m in found["drafting"])

    found = findings(write_config(tmp_path, random_target_dir,
                                  deploy={"engine": "sglang", "port": free_port()},
                                  export={"format": "speculators"}))
    assert ("error", "deploy.engine=sglang with export.format=speculators: SGLang loads the "
                     "SGLang layout only; set export.format=sglang") in found["drafting"]



def test_training_across_hosts_needs_distributed_mode_and_enough_hosts(random_target_dir,
                                                                       tmp_path):
    nodes = {"nnodes": 2, "rdzv_endpoint": "gpu-a:29400"}
    found = findings(write_config(tmp_path, random_target_dir, train=nodes))
    ((level, message),) = found["hosts"]
    assert level == "warning" and "runs in distributed mode only" in message
    one_host = {"mode": "distributed", "gpu_hosts": ["gpu-a"]}
    found = findings(write_config(tmp_path, random_target_dir, train=nodes,
                                  orchestration=one_host))
    assert found["hosts"] == [("error", "train.nnodes=2 but orchestration.gpu_hosts names 1 GPU "
                                        "host block(s) (gpu-a): name one per host, or lower "
                                        "train.nnodes")]
    two_hosts = {"mode": "distributed", "gpu_hosts": ["gpu-a", "gpu-b"]}
    found = findings(write_config(tmp_path, random_target_dir, train=nodes,
                                  orchestration=two_hosts))
    assert levels(found, "hosts") == {"ok"}


def test_a_port_in_use_fails_validate(random_target_dir, tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        found = findings(write_config(tmp_path, random_target_dir,
                                      deploy={"engine": "sglang", "port": port}))
    ((level, message),) = found["port"]
    assert level == "error"
    assert f"deploy.port: 127.0.0.1:{port} is in use by another process" in message
    found = findings(write_config(tmp_path, random_target_dir,
                                  deploy={"engine": "sglang", "port": port}))
    assert found["port"] == [("ok", f"deploy.port={port} on 127.0.0.1 is free")]


def test_an_unset_api_key_variable_fails_validate(random_target_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_VALIDATE_KEY", raising=False)
    config = write_config(tmp_path, random_target_dir, generate={
        "backend": "openai", "endpoint": {"base_url": "http://127.0.0.1:1/v1", "model": "m",
                                          "api_key_env": "DRAFTSMITH_VALIDATE_KEY"}})
    assert levels(findings(config), "endpoint") == {"error"}
    monkeypatch.setenv("DRAFTSMITH_VALIDATE_KEY", "set")
    assert levels(findings(config), "endpoint") == {"ok"}


def test_the_examples(tmp_path):
    """The demo validates here; the Kimi example names what this machine lacks."""
    from tests.conftest import REPO

    result = runner.invoke(app, ["validate", str(REPO / "examples" / "tiny.yaml")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["validate", str(REPO / "examples" / "kimi-k2.5-8gpu.yaml")])
    assert result.exit_code == 1
    out = text(result)
    assert "/mnt/shared/datasets/sharegpt.jsonl: file not found" in out
    assert "target.model='/models/moonshotai/Kimi-K2.5': no config.json there" in out


# --- --deep ------------------------------------------------------------------------------------


def test_deep_loads_the_tokenizer_and_renders_the_first_records(random_target_dir, tmp_path):
    result = runner.invoke(app, ["validate", "--deep",
                                 str(write_config(tmp_path, random_target_dir))])
    assert result.exit_code == 0, result.output
    out = text(result)
    assert "config and tokenizer load; the template ends a turn with '<|im_end|>'" in out
    assert "the chat template renders the first 20 records" in out


def test_deep_finds_a_tokenizer_that_does_not_load(random_target_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(random_target_dir, target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink(missing_ok=True)
    config = write_config(tmp_path, target)
    assert "target files" not in findings(config)  # the cheap checks do not load it
    ((level, message),) = findings(config, deep=True)["target files"]
    assert level == "error" and "the tokenizer cannot be loaded" in message
    assert str(target) in message


def test_deep_finds_a_template_that_cannot_render_a_record(random_target_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(random_target_dir, target)
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    template = tokenizer_config.get("chat_template") or (
        target / "chat_template.jinja").read_text()
    refusing = ("{%- for m in messages %}{%- if 'q7' in m['content'] %}"
                "{{ raise_exception('no q7 here') }}{%- endif %}{%- endfor %}" + template)
    if "chat_template" in tokenizer_config:
        tokenizer_config["chat_template"] = refusing
        (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    else:
        (target / "chat_template.jinja").write_text(refusing)
    found = findings(write_config(tmp_path, target), deep=True)
    ((level, message),) = found["template d"]
    assert level == "error" and "d/r7" in message and "no q7 here" in message
