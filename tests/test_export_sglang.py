"""SGLang export (layer ids per family, config, weight names, validation) and the native
checkpoint round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.data.vocab import build_vocab_map
from draftsmith.export.native import META_FILE, load_native, save_native
from draftsmith.export.native import WEIGHTS_FILE as NATIVE_WEIGHTS
from draftsmith.export.sglang import (
    WEIGHTS_FILE,
    ExportError,
    config_from_sglang,
    export_sglang,
    sglang_layer_ids,
    validate_sglang,
)
from draftsmith.model.eagle3 import Eagle3Config, Eagle3Drafter

AUX_IDS = [1, 3, 4]
DRAFT_VOCAB = 256

SGLANG_KEYS = {
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def make_drafter(target_dir: Path, seed: int = 0) -> tuple[Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(seed)
    tcfg = json.loads((target_dir / "config.json").read_text())
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    drafter = Eagle3Drafter(Eagle3Config.from_target(tcfg, AUX_IDS, DRAFT_VOCAB))
    g = torch.Generator().manual_seed(seed)
    masked = torch.randint(0, V, (3000,), generator=g).tolist() + [V - 1] * 30
    d2t, t2d, _ = build_vocab_map(masked, V, DRAFT_VOCAB)
    embed = torch.randn(V, H, generator=g)
    drafter.load_target_parts(embed, d2t, t2d)
    with torch.no_grad():  # norms away from their all-ones init, so a mix-up would show
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
    return drafter.eval(), embed


@pytest.fixture()
def exported(random_target_dir, tmp_path):
    drafter, embed = make_drafter(random_target_dir)
    out = tmp_path / "sglang"
    config = export_sglang(drafter.state_dict(), drafter.config, "llama", out)
    return drafter, embed, out, config


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


# --------------------------------------------------------------------------- layer ids


def sglang_captured_inputs(written: list[int], family: str, num_layers: int) -> list[int]:
    """Which layers' INPUTS SGLang 0.5.23 captures for eagle_aux_hidden_state_layer_ids
    (REFERENCE.md section 1)."""
    if family == "deepseek":
        return [i + 1 for i in written] if written[0] == 1 else list(written)
    if family == "gpt-oss":
        return list(written) if max(written) == num_layers else [i + 1 for i in written]
    return [i + 1 for i in written]


@pytest.mark.parametrize("family", ["llama", "qwen", "gpt-oss"])
@pytest.mark.parametrize("canonical", [[1, 29, 57], [2, 30, 58], [0, 4, 8]])
def test_layer_ids_written_as_they_are_for_plus_one_families(family, canonical):
    assert sglang_layer_ids(canonical, family) == canonical
    captured = sglang_captured_inputs(sglang_layer_ids(canonical, family), family, 61)
    assert captured == [c + 1 for c in canonical]  # inputs of c+1 = outputs of c


@pytest.mark.parametrize(("canonical", "written"), [
    ([1, 29, 57], [1, 29, 57]),
    ([2, 30, 58], [3, 31, 59]),  # the Kimi seeds: outputs 2, 30, 58 = inputs 3, 31, 59
    ([5, 10, 20], [6, 11, 21]),
])
def test_layer_ids_for_deepseek_family(canonical, written):
    assert sglang_layer_ids(canonical, "deepseek") == written
    captured = sglang_captured_inputs(written, "deepseek", 61)
    assert captured == [c + 1 for c in canonical]


def test_layer_ids_deepseek_output_of_layer_zero_is_refused():
    with pytest.raises(ExportError, match="DeepSeek"):
        sglang_layer_ids([0, 30, 58], "deepseek")


def test_layer_ids_unknown_family_is_refused():
    with pytest.raises(ExportError, match="family"):
        sglang_layer_ids([1, 2, 3], "mamba")


# --------------------------------------------------------------------------- export


def test_export_writes_the_sglang_config(exported, random_target):
    drafter, _, out, returned = exported
    config = json.loads((out / "config.json").read_text())
    assert returned == config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["vocab_size"] == random_target.figures["vocab_size"]
    assert config["hidden_size"] == random_target.figures["hidden_size"]
    assert config["target_hidden_size"] == random_target.figures["hidden_size"]
    assert config["max_position_embeddings"] == random_target.figures["max_position_embeddings"]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": AUX_IDS,
                                      "use_aux_hidden_state": True}
    assert config["torch_dtype"] == "float32"
    # What the embedded engine reads back is the drafter's own config.
    assert config_from_sglang(config) == drafter.config


def test_export_deepseek_family_writes_shifted_ids_and_keeps_canonical(random_target_dir,
                                                                      tmp_path):
    drafter, _ = make_drafter(random_target_dir)
    cfg = drafter.config.model_copy(update={"aux_layer_ids": [2, 3, 4]})
    config = export_sglang(drafter.state_dict(), cfg, "deepseek", tmp_path)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5]
    assert config_from_sglang(config).aux_layer_ids == [2, 3, 4]


def test_export_weights_have_exactly_the_sglang_keys_and_values(exported):
    drafter, _, out, _ = exported
    weights = read_weights(out / WEIGHTS_FILE)
    assert set(weights) == SGLANG_KEYS  # embed_tokens is not shipped
    state = drafter.state_dict()
    for name, tensor in weights.items():
        assert tensor.dtype == state[name].dtype, name
        assert torch.equal(tensor, state[name]), name
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * drafter.config.hidden_size
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool


# --------------------------------------------------------------------------- validate


def rewrite_weights(out: Path, edit) -> None:
    weights = read_weights(out / WEIGHTS_FILE)
    edit(weights)
    save_file(weights, str(out / WEIGHTS_FILE))


def rewrite_config(out: Path, edit) -> None:
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))


def test_validate_accepts_the_export(exported):
    _, _, out, config = exported
    assert validate_sglang(out) == config


def test_validate_missing_key(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(ExportError, match=r"missing keys.*midlayer\.hidden_norm\.weight"):
        validate_sglang(out)


def test_validate_extra_key(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.update(
        {"layers.0.mlp.up_proj.weight": w["midlayer.mlp.up_proj.weight"].clone()}))
    with pytest.raises(ExportError, match=r"unknown keys.*layers\.0\.mlp\.up_proj\.weight"):
        validate_sglang(out)


def test_validate_speculators_names_are_refused(exported):
    """The layers.0.* layout (speculators/vLLM) is both missing and unknown for SGLang."""
    out = exported[2]

    def rename(w):
        for name in [n for n in w if n.startswith("midlayer.")]:
            w["layers.0." + name.removeprefix("midlayer.")] = w.pop(name)

    rewrite_weights(out, rename)
    with pytest.raises(ExportError) as info:
        validate_sglang(out)
    assert "missing keys" in str(info.value) and "unknown keys" in str(info.value)
    assert "midlayer.self_attn.q_proj.weight" in str(info.value)


def test_validate_wrong_shape(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.update({"fc.weight": w["fc.weight"][:, :128].clone()}))
    with pytest.raises(ExportError, match=r"fc\.weight: shape \(64, 128\), expected \(64, 192\)"):
        validate_sglang(out)


def test_validate_wrong_dtype(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.update({"d2t": w["d2t"].to(torch.int32)}))
    with pytest.raises(ExportError, match=r"d2t: dtype torch\.int32"):
        validate_sglang(out)


def test_validate_config_without_draft_vocab_size(exported):
    out = exported[2]
    rewrite_config(out, lambda c: c.pop("draft_vocab_size"))
    with pytest.raises(ExportError, match="draft_vocab_size"):
        validate_sglang(out)


def test_validate_wrong_architecture(exported):
    out = exported[2]
    rewrite_config(out, lambda c: c.update({"architectures": ["LlamaForCausalLMEagle"]}))
    with pytest.raises(ExportError, match="architectures"):
        validate_sglang(out)


def test_validate_d2t_as_target_ids_instead_of_offsets(exported):
    out = exported[2]
    # A common mistake: storing the target ids themselves instead of offsets.
    rewrite_weights(out, lambda w: w.update(
        {"d2t": w["d2t"] + torch.arange(w["d2t"].numel())}))
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        validate_sglang(out)


def test_validate_t2d_marks_an_id_outside_the_draft_vocab(exported):
    out = exported[2]

    def edit(w):
        t2d = w["t2d"].clone()
        t2d[int(torch.nonzero(~t2d)[0])] = True
        w["t2d"] = t2d

    rewrite_weights(out, edit)
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        validate_sglang(out)


def test_validate_missing_files(tmp_path, exported):
    with pytest.raises(ExportError, match="config.json"):
        validate_sglang(tmp_path / "nothing")
    out = exported[2]
    (out / WEIGHTS_FILE).unlink()
    with pytest.raises(ExportError, match=WEIGHTS_FILE):
        validate_sglang(out)


# --------------------------------------------------------------------------- native


def test_native_round_trip_is_bit_identical(random_target_dir, tmp_path):
    drafter, embed = make_drafter(random_target_dir, seed=3)
    provenance = {"epoch": 2, "target_fingerprint": "abc"}
    save_native(drafter, tmp_path, provenance)
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["provenance"] == provenance
    assert "embed_tokens.weight" not in load_file(str(tmp_path / NATIVE_WEIGHTS))

    loaded = load_native(tmp_path, embed)
    assert loaded.config == drafter.config
    original, back = drafter.state_dict(), loaded.state_dict()
    assert set(back) == set(original)
    for name in original:
        assert back[name].dtype == original[name].dtype, name
        assert torch.equal(back[name], original[name]), name
    assert not loaded.training

    T = 9
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, drafter.config.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * drafter.config.target_hidden_size, generator=g)
    pos, docs = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    with torch.no_grad():
        a = drafter.forward_ttt(ids, aux, pos, docs, 3)
        b = loaded.forward_ttt(ids, aux, pos, docs, 3)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_native_load_refuses_other_formats(tmp_path, exported):
    (tmp_path / META_FILE).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a native draftsmith checkpoint"):
        load_native(tmp_path, exported[1])
