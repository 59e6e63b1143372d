"""draftsmith.artifacts: content-addressed stage directories, manifests written last."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from draftsmith import artifacts
from draftsmith.artifacts import (
    MANIFEST,
    Descriptor,
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    external_descriptor,
    finish_stage,
    load_descriptor,
    plan_stage,
    read_descriptor,
    stage_output,
)
from draftsmith.config import MergeConfig


def data_input(fingerprint: str) -> Descriptor:
    return external_descriptor("data", f"/data/{fingerprint}.jsonl", fingerprint)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- keys ------------------------------------------------------------------------------------


def test_plan_stage_key_is_stable(tmp_path):
    inputs = [data_input("aaaa"), data_input("bbbb")]
    first = plan_stage(tmp_path, "merge", MergeConfig(), inputs)
    again = plan_stage(tmp_path, "merge", MergeConfig(), [data_input("aaaa"), data_input("bbbb")])
    assert first.key == again.key
    assert first.dir == tmp_path / "merge" / first.key
    # Input order does not matter; a dict config with the same content gives the same key.
    assert plan_stage(tmp_path, "merge", MergeConfig(), inputs[::-1]).key == first.key
    as_dict = MergeConfig().model_dump(mode="json")
    assert plan_stage(tmp_path, "merge", as_dict, inputs).key == first.key
    # The run root is where it goes, not what it is.
    assert plan_stage(tmp_path / "other", "merge", MergeConfig(), inputs).key == first.key


def test_plan_stage_key_changes_with_config_inputs_and_stage(tmp_path):
    inputs = [data_input("aaaa")]
    base = plan_stage(tmp_path, "merge", MergeConfig(), inputs).key
    keys = {
        "config": plan_stage(tmp_path, "merge", MergeConfig(seed=1), inputs).key,
        "input fingerprint": plan_stage(tmp_path, "merge", MergeConfig(), [data_input("aaab")]).key,
        "extra input": plan_stage(tmp_path, "merge", MergeConfig(),
                                  inputs + [data_input("cccc")]).key,
        "no inputs": plan_stage(tmp_path, "merge", MergeConfig(), []).key,
        "stage": plan_stage(tmp_path, "extract", MergeConfig(), inputs).key,
    }
    for what, key in keys.items():
        assert key != base, f"changing the {what} must change the key"
    assert len(set(keys.values())) == len(keys)


def test_plan_stage_key_changes_with_format_version(tmp_path, monkeypatch):
    before = plan_stage(tmp_path, "merge", {"a": 1}, []).key
    monkeypatch.setattr(artifacts, "FORMAT_VERSION", artifacts.FORMAT_VERSION + 1)
    assert plan_stage(tmp_path, "merge", {"a": 1}, []).key != before


# --- writing a stage -------------------------------------------------------------------------


def write_stage(plan, files: dict[str, bytes], **kwargs) -> Descriptor:
    with stage_output(plan) as out:
        assert out == plan.dir
        for name, data in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
    return finish_stage(plan, **kwargs)


def test_stage_output_and_finish_stage_write_a_manifest(tmp_path):
    plan = plan_stage(tmp_path, "merge", {"x": 1}, [])
    assert not plan.is_complete()
    descriptor = write_stage(plan, {"a.jsonl": b"one\n", "shards/b.bin": b"\x00\x01"},
                             counts={"records": 2}, figures={"coverage": 0.5},
                             extra={"note": "hello"})
    assert plan.is_complete()
    assert isinstance(descriptor, Descriptor)
    assert (descriptor.stage, descriptor.key, descriptor.dir) == ("merge", plan.key, plan.dir)
    assert descriptor.counts == {"records": 2}
    assert descriptor.figures == {"coverage": 0.5}

    manifest = json.loads((plan.dir / MANIFEST).read_text())
    assert manifest["files"] == {
        "a.jsonl": sha256(plan.dir / "a.jsonl"),
        "shards/b.bin": sha256(plan.dir / "shards" / "b.bin"),
    }
    assert manifest["note"] == "hello"
    assert read_descriptor(plan) == descriptor
    assert load_descriptor(plan) == descriptor
    # Nothing but the stage's files and the manifest is left behind.
    assert sorted(p.name for p in plan.dir.iterdir()) == ["a.jsonl", MANIFEST, "shards"]


def test_fingerprint_follows_content(tmp_path):
    same_a = write_stage(plan_stage(tmp_path, "merge", {"run": 1}, []), {"a": b"1"})
    same_b = write_stage(plan_stage(tmp_path, "merge", {"run": 2}, []), {"a": b"1"})
    other = write_stage(plan_stage(tmp_path, "merge", {"run": 3}, []), {"a": b"2"})
    renamed = write_stage(plan_stage(tmp_path, "merge", {"run": 4}, []), {"b": b"1"})
    assert same_a.fingerprint == same_b.fingerprint
    assert len({same_a.fingerprint, other.fingerprint, renamed.fingerprint}) == 3


def test_manifest_is_written_last(tmp_path, monkeypatch):
    """A crash while checksumming (before the manifest) leaves an incomplete directory."""
    plan = plan_stage(tmp_path, "extract", {}, [])
    calls = []

    def failing_sha(path, *args, **kwargs):
        calls.append(Path(path).name)
        if len(calls) == 2:
            raise OSError("disk gone")
        return "0" * 64

    with stage_output(plan) as out:
        for name in ("a", "b", "c"):
            (out / name).write_text(name)
    monkeypatch.setattr(artifacts, "sha256_file", failing_sha)
    with pytest.raises(OSError, match="disk gone"):
        finish_stage(plan)
    assert calls == ["a", "b"]
    assert not (plan.dir / MANIFEST).exists()
    assert not plan.is_complete()


def test_hidden_temp_files_are_not_in_the_manifest(tmp_path):
    plan = plan_stage(tmp_path, "train", {}, [])
    with stage_output(plan) as out:
        (out / "model.safetensors").write_bytes(b"w")
        (out / ".model.safetensors.tmp").write_bytes(b"partial")
    finish_stage(plan)
    assert list(json.loads((plan.dir / MANIFEST).read_text())["files"]) == ["model.safetensors"]


def test_directory_without_manifest_is_incomplete_and_cleared(tmp_path):
    plan = plan_stage(tmp_path, "extract", {}, [])
    plan.dir.mkdir(parents=True)
    (plan.dir / "shard-0.safetensors").write_bytes(b"half a shard")
    (plan.dir / "sub").mkdir()
    (plan.dir / "sub" / "left.txt").write_text("x")
    assert not plan.is_complete()
    with pytest.raises(FileNotFoundError):
        load_descriptor(plan)
    with stage_output(plan) as out:
        assert list(out.iterdir()) == []
        (out / "fresh").write_text("new")
    descriptor = finish_stage(plan)
    assert json.loads((plan.dir / MANIFEST).read_text())["files"] == {
        "fresh": sha256(plan.dir / "fresh")}
    assert load_descriptor(plan) == descriptor


def test_stage_output_refuses_to_overwrite_a_complete_dir(tmp_path):
    plan = plan_stage(tmp_path, "merge", {}, [])
    write_stage(plan, {"keep": b"precious"})
    with pytest.raises(RuntimeError, match="already complete"), stage_output(plan):
        pytest.fail("must not be entered")
    assert (plan.dir / "keep").read_bytes() == b"precious"
    assert plan.is_complete()


def test_load_descriptor_on_incomplete_plan_names_stage_and_fix(tmp_path):
    plan = plan_stage(tmp_path, "fix_keys", {}, [])
    with pytest.raises(FileNotFoundError) as err:
        load_descriptor(plan)
    message = str(err.value)
    assert "'fix_keys'" in message
    assert str(plan.dir) in message
    assert "--to fix_keys" in message


# --- atomic writes -----------------------------------------------------------------------------


def test_atomic_write_json_leaves_no_temp_files(tmp_path):
    target = tmp_path / "deep" / "out.json"
    atomic_write_json(target, {"b": 1, "a": [1, 2], "p": Path("/x")})
    atomic_write_json(target, {"b": 2})
    assert json.loads(target.read_text()) == {"b": 2}
    assert [p.name for p in target.parent.iterdir()] == ["out.json"]


def test_atomic_write_failure_keeps_old_content_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    atomic_write_bytes(target, b"old")

    def broken_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(artifacts.os, "replace", broken_replace)
    with pytest.raises(OSError, match="rename failed"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_atomic_path_success(tmp_path):
    target = tmp_path / "sub" / "weights.bin"
    with atomic_path(target) as tmp:
        assert tmp != target and tmp.parent == target.parent
        tmp.write_bytes(b"weights")
        assert not target.exists()
    assert target.read_bytes() == b"weights"
    assert [p.name for p in target.parent.iterdir()] == ["weights.bin"]


def test_atomic_path_failure_leaves_no_target(tmp_path):
    target = tmp_path / "weights.bin"
    with pytest.raises(RuntimeError, match="writer crashed"), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer crashed")
    assert list(tmp_path.iterdir()) == []
    # An existing file is kept as it was.
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer crashed")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


def test_checksums_the_stage_already_computed_are_not_read_again(tmp_path):
    plan = plan_stage(tmp_path, "extract", {}, [])
    write_stage(plan, {"a.bin": b"abc", "b.bin": b"def"}, known_checksums={"a.bin": "f" * 64})
    files = json.loads((plan.dir / MANIFEST).read_text())["files"]
    assert files == {"a.bin": "f" * 64, "b.bin": sha256(plan.dir / "b.bin")}
