"""Every read of a drafter or store file is guarded: a truncated or garbled safetensors file,
bad JSON in config.json or draftsmith.json, a missing key end in an error that names the file,
says what is wrong and what to do, in `draftsmith import`, `inspect`, `export`, train.init_from
and the hidden-state store reader (never a raw traceback)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.errors import InputError
from draftsmith.export.convert import WEIGHTS_FILE, export_drafter, read_drafter
from draftsmith.export.formats import ExportError
from draftsmith.export.native import META_FILE, load_native, save_native
from draftsmith.export.native import WEIGHTS_FILE as NATIVE_WEIGHTS
from draftsmith.extract.store import INDEX_FILE, ShardReader, StoreError
from tests.test_export import make_drafter
from tests.test_extract import make_samples, write_store


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garble(path: Path) -> None:
    path.write_bytes(b"\x93NUMPY garbage, not a checkpoint" * 8)


def empty(path: Path) -> None:
    path.write_bytes(b"")


def bad_json(path: Path) -> None:
    text = path.read_text()
    path.write_text(text[: len(text) // 2])


def drop_key(key: str, inside: str | None = None) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = json.loads(path.read_text())
        node = data[inside] if inside else data
        del node[key]
        path.write_text(json.dumps(data))
    damage.__name__ = f"drop_{key}"
    return damage


def ids_not_a_list(path: Path) -> None:
    data = json.loads(path.read_text())
    data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = 5
    path.write_text(json.dumps(data))


def size_not_a_number(path: Path) -> None:
    data = json.loads(path.read_text())
    data["hidden_size"] = "sixty-four"
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def drafters(random_target_dir, tmp_path_factory):
    """One healthy drafter in each layout: native, SGLang, speculators."""
    root = tmp_path_factory.mktemp("drafters")
    drafter, _ = make_drafter(random_target_dir)
    save_native(drafter, root / "native", {"test": True})
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", root / "sglang")
    export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama",
                   root / "speculators")
    return root


# (layout, file, damage, what the message says besides the file's name, the fix it gives)
CASES = [
    ("native", NATIVE_WEIGHTS, truncate, "not a readable safetensors file", "rerun the train"),
    ("native", NATIVE_WEIGHTS, garble, "not a readable safetensors file", "rerun the train"),
    ("native", NATIVE_WEIGHTS, empty, "not a readable safetensors file", "import"),
    ("native", META_FILE, bad_json, "not valid JSON", "rerun the train"),
    ("native", META_FILE, drop_key("config"), "no 'config' key", "rerun the train"),
    ("native", META_FILE, drop_key("hidden_size", "config"), "hidden_size", "rerun the train"),
    ("sglang", WEIGHTS_FILE, truncate, "not a readable safetensors file", "re-download"),
    ("sglang", WEIGHTS_FILE, garble, "not a readable safetensors file", "draftsmith export"),
    ("sglang", "config.json", bad_json, "not valid JSON", "re-download"),
    ("sglang", "config.json", drop_key("draft_vocab_size"), "missing config fields",
     "draft_vocab_size"),
    ("sglang", "config.json", ids_not_a_list, "missing or of the wrong type", "re-download"),
    ("sglang", "config.json", size_not_a_number, "values that make no drafter: hidden_size",
     "re-download"),
    ("speculators", WEIGHTS_FILE, truncate, "not a readable safetensors file", "re-download"),
    ("speculators", "config.json", bad_json, "not valid JSON", "re-download"),
    ("speculators", "config.json", drop_key("hidden_size", "transformer_layer_config"),
     "transformer_layer_config.hidden_size", "missing"),
]
IDS = [f"{layout}-{file}-{damage.__name__}" for layout, file, damage, *_ in CASES]


def damaged(drafters: Path, tmp_path: Path, layout: str, file: str,
            damage: Callable[[Path], None]) -> Path:
    directory = tmp_path / layout
    shutil.copytree(drafters / layout, directory)
    damage(directory / file)
    return directory


def assert_names_file_problem_and_fix(message: str, path: Path, what: str, fix: str) -> None:
    assert str(path) in message or str(path.parent) in message, message
    assert what in message, message
    assert fix in message, message
    assert "Traceback" not in message


@pytest.mark.parametrize(("layout", "file", "damage", "what", "fix"), CASES, ids=IDS)
def test_reading_a_damaged_drafter_names_the_file_the_problem_and_the_fix(
        drafters, tmp_path, layout, file, damage, what, fix):
    directory = damaged(drafters, tmp_path, layout, file, damage)
    with pytest.raises(ExportError) as info:
        read_drafter(directory)
    assert isinstance(info.value, InputError)  # fails at once, never retried
    assert_names_file_problem_and_fix(str(info.value), directory / file, what, fix)


@pytest.mark.parametrize(("layout", "file", "damage", "what", "fix"), CASES, ids=IDS)
def test_import_inspect_and_export_report_a_damaged_drafter_without_a_traceback(
        drafters, tmp_path, layout, file, damage, what, fix):
    directory = damaged(drafters, tmp_path, layout, file, damage)
    runner = CliRunner()
    for argv, code in [(["import", str(directory), "--out", str(tmp_path / "imported")], 2),
                       (["inspect", str(directory)], 1),
                       (["export", str(directory), "--to", "sglang", "--out",
                         str(tmp_path / "exported")], 2)]:
        result = runner.invoke(app, argv)
        assert result.exit_code == code, (argv, result.output, result.exception)
        output = " ".join(result.output.split())  # rich wraps long lines
        assert what in output and fix in output, (argv, output)
        assert "Traceback" not in output
    assert not (tmp_path / "imported").exists() and not (tmp_path / "exported").exists()


def test_load_native_names_a_weight_file_that_does_not_fit(drafters, tmp_path,
                                                           random_target_dir):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "native"
    shutil.copytree(drafters / "native", directory)
    state = load_file(str(directory / NATIVE_WEIGHTS))
    del state["fc.weight"]
    save_file(state, str(directory / NATIVE_WEIGHTS))
    _, embed = make_drafter(random_target_dir)
    with pytest.raises(ExportError, match=r"missing \['fc.weight'\].*rerun the train"):
        load_native(directory, embed)


def test_init_from_a_damaged_drafter_names_it(drafters, tmp_path, random_target_dir):
    from draftsmith.config import TrainConfig
    from draftsmith.train.trainer import build_drafter

    directory = damaged(drafters, tmp_path, "sglang", WEIGHTS_FILE, truncate)
    drafter, embed = make_drafter(random_target_dir)
    with pytest.raises(InputError) as info:
        build_drafter(TrainConfig(init_from=str(directory)), drafter.config, embed,
                      embed, drafter.d2t, drafter.t2d)
    assert_names_file_problem_and_fix(str(info.value), directory / WEIGHTS_FILE,
                                      "not a readable safetensors file", "re-download")
    assert f"train.init_from={str(directory)!r}" in str(info.value)


# --- the hidden-state store --------------------------------------------------------------------


def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    write_store(root, {"train": make_samples(6)})
    return root


def first_shard(root: Path) -> Path:
    return root / json.loads((root / INDEX_FILE).read_text())["splits"]["train"][0]["file"]


def test_a_damaged_store_index_names_the_file_and_the_fix(tmp_path):
    root = store(tmp_path)
    bad_json(root / INDEX_FILE)
    with pytest.raises(StoreError, match=rf"{root / INDEX_FILE}: not valid JSON.*delete {root} "
                                         "and run the extract stage again") as info:
        ShardReader(root)
    assert isinstance(info.value, InputError)

    root = store(tmp_path / "b")
    drop_key("hidden_size")(root / INDEX_FILE)
    with pytest.raises(StoreError, match=r"missing keys \['hidden_size'\]"):
        ShardReader(root)

    root = store(tmp_path / "c")
    index = json.loads((root / INDEX_FILE).read_text())
    del index["splits"]["train"][0]["sha256"]
    (root / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(StoreError, match=r"shard 0 of split 'train' lacks \['sha256'\]"):
        ShardReader(root)


@pytest.mark.parametrize("damage", [truncate, garble, empty])
def test_a_damaged_shard_read_without_checksums_names_the_file_and_the_fix(tmp_path, damage):
    """With checksums off (they cost a read of the whole store) and the byte count in the index
    matching, a damaged header is still caught, never a crash inside torch."""
    root = store(tmp_path)
    shard = first_shard(root)
    damage(shard)
    index = json.loads((root / INDEX_FILE).read_text())
    for record in index["splits"]["train"]:
        record["bytes"] = (root / record["file"]).stat().st_size  # the size check passes
    (root / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(StoreError) as info:
        list(ShardReader(root, verify_checksums=False).samples("train"))
    message = str(info.value)
    assert str(shard) in message and f"delete {root} and run the extract stage again" in message
