"""draftsmith.target: layer ids, families, resolving, head/embedding, fingerprint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftsmith.config import TargetConfig
from draftsmith.export.layer_ids import check_aux_layer_ids, default_aux_layer_ids
from draftsmith.target import (
    family_of,
    load_target_head_and_embedding,
    resolve_target,
    target_fingerprint,
)

# --- aux layer ids (docs/concepts.md, "Aux layer ids") -----------------------------------------


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(61) == [1, 29, 57]  # Kimi-K2.5
    assert default_aux_layer_ids(8) == [1, 3, 4]  # the tiny target
    assert default_aux_layer_ids(32) == [1, 15, 28]  # Llama-3-8B
    for layers in (8, 32, 61):
        assert check_aux_layer_ids(default_aux_layer_ids(layers), layers)


def test_check_aux_layer_ids_accepts_valid():
    assert check_aux_layer_ids([0, 3, 7], 8) == [0, 3, 7]
    assert check_aux_layer_ids([2, 30, 58], 61) == [2, 30, 58]


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, 3, 8], r"ids \[8\] are outside 0\.\.7"),
        ([-1, 3, 4], r"ids \[-1\] are outside 0\.\.7"),
        ([1, 4, 3], "distinct and ascending"),
        ([1, 3, 3], "distinct and ascending"),
    ],
)
def test_check_aux_layer_ids_refuses(ids, match):
    with pytest.raises(ValueError, match=match) as err:
        check_aux_layer_ids(ids, 8)
    assert str(err.value).startswith(f"extract.aux_layer_ids={ids}")


# --- families ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"model_type": "llama"}, "llama"),
        ({"model_type": "mistral"}, "llama"),
        ({}, "llama"),
        ({"model_type": "qwen2"}, "qwen"),
        ({"model_type": "qwen3_moe"}, "qwen"),
        ({"model_type": "deepseek_v3"}, "deepseek"),
        ({"model_type": "kimi_k2"}, "deepseek"),
        ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}, "deepseek"),
        ({"model_type": "some_vl_wrapper", "text_config": {"model_type": "deepseek_v3"}},
         "deepseek"),
        ({"model_type": "some_vl_wrapper", "text_config": {"model_type": "qwen3"}}, "qwen"),
        ({"model_type": "gpt_oss"}, "gpt-oss"),
    ],
)
def test_family_of(config, family):
    assert family_of(config) == family


# --- resolve_target ----------------------------------------------------------------------------


def test_resolve_target_missing_dir_names_the_key(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        resolve_target(TargetConfig(model=str(missing)))
    message = str(err.value)
    assert f"target.model={str(missing)!r}" in message
    assert "builtin:tiny" in message


def test_resolve_target_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="target.model=.*no config.json"):
        resolve_target(TargetConfig(model=str(tmp_path)))


def test_resolve_random_target(random_target, random_target_dir):
    assert random_target.stage == "target"
    assert random_target.path == str(random_target_dir.resolve())
    assert random_target.fingerprint == target_fingerprint(random_target_dir)
    figures = random_target.figures
    assert figures["family"] == "llama"
    assert figures["model_type"] == "llama"
    assert figures["num_layers"] == 8
    assert figures["hidden_size"] == 64
    assert figures["vocab_size"] == 512


def test_resolve_nested_text_config_and_family_override(tmp_path):
    """A multimodal wrapper like Kimi-K2.5: the text model's figures and DeepSeek's rule."""
    text = {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168,
            "vocab_size": 163840, "max_position_embeddings": 262144}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25",
                                                      "text_config": text}))
    descriptor = resolve_target(TargetConfig(model=str(tmp_path)))
    assert descriptor.figures == {"family": "deepseek", "model_type": "kimi_k2", "num_layers": 61,
                                  "hidden_size": 7168, "vocab_size": 163840,
                                  "max_position_embeddings": 262144, "architectures": []}
    forced = resolve_target(TargetConfig(model=str(tmp_path), family="qwen"))
    assert forced.figures["family"] == "qwen"


# --- weights -----------------------------------------------------------------------------------


def test_head_and_embedding_match_the_model(random_target, random_target_model):
    embed, head = load_target_head_and_embedding(random_target)
    model_embed = random_target_model.get_input_embeddings().weight
    model_head = random_target_model.get_output_embeddings().weight
    assert embed.shape == (512, 64) and head.shape == (512, 64)
    assert torch.equal(embed, model_embed.detach())
    assert torch.equal(head, model_head.detach())
    assert not torch.equal(embed, head)  # untied: two different tensors were read


def test_head_and_embedding_from_a_sharded_checkpoint(tmp_path, random_target, random_target_dir):
    """Big targets come in shards with an index; names there may carry a prefix."""
    from safetensors.torch import load_file, save_file

    (weights,) = list(random_target_dir.glob("*.safetensors"))
    tensors = load_file(str(weights))
    embed_name = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    shard_a = {n: t for n, t in tensors.items() if n != "lm_head.weight"}
    shard_b = {"lm_head.weight": tensors["lm_head.weight"]}
    save_file(shard_a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(shard_b, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in shard_a}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = random_target.model_copy(update={"path": str(tmp_path)})
    embed, head = load_target_head_and_embedding(sharded)
    assert torch.equal(embed, tensors[embed_name])
    assert torch.equal(head, tensors["lm_head.weight"])


def test_tied_embeddings_use_the_embedding_as_head(tmp_path, random_target):
    from safetensors.torch import save_file

    embed = torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    tied = random_target.model_copy(update={"path": str(tmp_path)})
    got_embed, got_head = load_target_head_and_embedding(tied)
    assert torch.equal(got_embed, embed) and torch.equal(got_head, embed)


# --- fingerprint -------------------------------------------------------------------------------


def test_target_fingerprint_follows_config_and_weights(tmp_path, random_target_dir):
    copy = tmp_path / "copy"
    shutil.copytree(random_target_dir, copy)
    base = target_fingerprint(copy)
    assert base == target_fingerprint(random_target_dir)  # content, not location

    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (copy / "config.json").write_text(json.dumps(config))
    changed = target_fingerprint(copy)
    assert changed != base

    (copy / "chat_template.jinja").write_text("{{ messages }}")  # tokenizer files count too
    assert target_fingerprint(copy) != changed
    changed = target_fingerprint(copy)

    (weights,) = list(copy.glob("*.safetensors"))
    with open(weights, "ab") as f:
        f.write(b"\0")  # a different weight file size
    assert target_fingerprint(copy) != changed


def test_a_retrained_target_of_the_same_shapes_gets_a_new_fingerprint(tmp_path,
                                                                      random_target_dir):
    """Seen on the H200: retraining the quality benchmark's target (same shapes, same file
    sizes) kept the fingerprint, so the generate stage's key pointed at the old answers."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(random_target_dir, copy)
    before = target_fingerprint(copy)
    (weights,) = list(copy.glob("*.safetensors"))
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1.0  # same shape and dtype: same file size
    size = weights.stat().st_size
    save_file(tensors, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == size
    assert target_fingerprint(copy) != before


def test_a_builtin_target_is_built_once_while_a_second_run_waits_for_it(tmp_path, caplog):
    """Two runs resolving a builtin target on a fresh machine: the second waits on the lock and
    then finds the first one's build, instead of building into the same partial directory."""
    import logging
    import threading
    import time

    from draftsmith.target import build_once

    path = tmp_path / "cache" / "tiny-target-v1"
    builds: list[str] = []
    first_is_building, finish = threading.Event(), threading.Event()

    def build() -> None:
        builds.append(threading.current_thread().name)
        first_is_building.set()
        assert finish.wait(120)
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")

    def resolve() -> None:
        build_once(path, build, "the tiny demo target")

    first = threading.Thread(target=resolve, name="first")
    second = threading.Thread(target=resolve, name="second")
    with caplog.at_level(logging.INFO, logger="draftsmith.target"):
        try:
            first.start()
            assert first_is_building.wait(120)
            second.start()
            deadline = time.monotonic() + 120
            while "waiting for it" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "another process is building the tiny demo target" in caplog.text
            assert second.is_alive()  # held by the lock, not building
        finally:
            finish.set()
            first.join(120)
            second.join(120)
    assert builds == ["first"]
    assert (path / "config.json").is_file()
    build_once(path, build, "the tiny demo target")  # built: no lock, no build
    assert builds == ["first"]
