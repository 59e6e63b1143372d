"""Drafter layouts: layer ids per engine and family, SGLang and speculators export, validation,
detection, import to native, round trips and logit equality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.data.vocab import build_vocab_map
from draftsmith.export.convert import (
    WEIGHTS_FILE,
    describe,
    detect_layout,
    export_drafter,
    import_drafter,
    read_drafter,
)
from draftsmith.export.formats import SGLANG, ExportError
from draftsmith.export.layer_ids import LayerIdError, canonical_layer_ids, engine_layer_ids
from draftsmith.export.native import META_FILE, load_native, save_native
from draftsmith.export.native import WEIGHTS_FILE as NATIVE_WEIGHTS
from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter
from tests.engine_helpers import forward_ttt
from tests.test_eagle3 import ALL_NORMS, SGLANG_KEYS

# EAGLE-3.1 as SGLang 0.5.23 can run it: every norm but norm_before_residual.
SGLANG_NORMS = {**ALL_NORMS, "norm_before_residual": False}

AUX_IDS = [1, 3, 4]
DRAFT_VOCAB = 256



def make_drafter(target_dir: Path, seed: int = 0,
                 **options) -> tuple[Eagle3Drafter, torch.Tensor]:
    """options: EAGLE-3.1's norms (Eagle3Config)."""
    torch.manual_seed(seed)
    tcfg = json.loads((target_dir / "config.json").read_text())
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    drafter = Eagle3Drafter(Eagle3Config.from_target(tcfg, AUX_IDS, DRAFT_VOCAB, **options))
    g = torch.Generator().manual_seed(seed)
    masked = torch.randint(0, V, (3000,), generator=g).tolist() + [V - 1] * 30
    d2t, t2d, _ = build_vocab_map(masked, V, DRAFT_VOCAB)
    embed = torch.randn(V, H, generator=g)
    drafter.load_target_parts(embed, d2t, t2d)
    with torch.no_grad():  # norms away from their all-ones init, so a mix-up would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=g)
    return drafter.eval(), embed


@pytest.fixture()
def exported(random_target_dir, tmp_path):
    drafter, embed = make_drafter(random_target_dir)
    out = tmp_path / "sglang"
    config = export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", out)
    return drafter, embed, out, config


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


# --------------------------------------------------------------------------- layer ids


def sglang_captured_inputs(written: list[int], family: str, num_layers: int) -> list[int]:
    """Which layers' INPUTS SGLang 0.5.23 captures for eagle_aux_hidden_state_layer_ids
    (docs/concepts.md, "Aux layer ids")."""
    if family == "deepseek":
        return [i + 1 for i in written] if written[0] == 1 else list(written)
    if family == "gpt-oss":
        return list(written) if max(written) == num_layers else [i + 1 for i in written]
    return [i + 1 for i in written]


@pytest.mark.parametrize("family", ["llama", "qwen", "gpt-oss"])
@pytest.mark.parametrize("canonical", [[1, 29, 57], [2, 30, 58], [0, 4, 8]])
def test_layer_ids_written_as_they_are_for_plus_one_families(family, canonical):
    assert engine_layer_ids(canonical, family, "sglang") == canonical
    captured = sglang_captured_inputs(engine_layer_ids(canonical, family, "sglang"), family, 61)
    assert captured == [c + 1 for c in canonical]  # inputs of c+1 = outputs of c


@pytest.mark.parametrize(("canonical", "written"), [
    ([1, 29, 57], [1, 29, 57]),
    ([2, 30, 58], [3, 31, 59]),  # the Kimi seeds: outputs 2, 30, 58 = inputs 3, 31, 59
    ([5, 10, 20], [6, 11, 21]),
])
def test_layer_ids_for_deepseek_family(canonical, written):
    assert engine_layer_ids(canonical, "deepseek", "sglang") == written
    captured = sglang_captured_inputs(written, "deepseek", 61)
    assert captured == [c + 1 for c in canonical]


def test_layer_ids_deepseek_output_of_layer_zero_is_refused():
    with pytest.raises(LayerIdError, match="DeepSeek"):
        engine_layer_ids([0, 30, 58], "deepseek", "sglang")


def test_layer_ids_unknown_family_is_refused():
    with pytest.raises(LayerIdError, match="family"):
        engine_layer_ids([1, 2, 3], "mamba", "sglang")


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
    assert SGLANG.parse_config(config, "llama") == drafter.config


def test_export_deepseek_family_writes_shifted_ids_and_keeps_canonical(random_target_dir,
                                                                      tmp_path):
    drafter, _ = make_drafter(random_target_dir)
    cfg = drafter.config.model_copy(update={"aux_layer_ids": [2, 3, 4]})
    config = export_drafter(drafter.state_dict(), cfg, "sglang", "deepseek", tmp_path)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5]
    assert SGLANG.parse_config(config, "deepseek").aux_layer_ids == [2, 3, 4]
    # A foreign checkpoint without draftsmith's note is read with the family's rule.
    config.pop("draftsmith")
    assert SGLANG.parse_config(config, "deepseek").aux_layer_ids == [2, 3, 4]


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
    assert read_drafter(out).raw_config == config


def test_validate_missing_key(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(ExportError, match=r"missing keys.*midlayer\.hidden_norm\.weight"):
        read_drafter(out)


def test_validate_extra_key(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.update(
        {"layers.0.mlp.up_proj.weight": w["midlayer.mlp.up_proj.weight"].clone()}))
    with pytest.raises(ExportError, match=r"unknown keys.*layers\.0\.mlp\.up_proj\.weight"):
        read_drafter(out)


def test_validate_speculators_names_are_refused(exported):
    """The layers.0.* layout (speculators/vLLM) is both missing and unknown for SGLang."""
    out = exported[2]

    def rename(w):
        for name in [n for n in w if n.startswith("midlayer.")]:
            w["layers.0." + name.removeprefix("midlayer.")] = w.pop(name)

    rewrite_weights(out, rename)
    with pytest.raises(ExportError) as info:
        read_drafter(out)
    assert "missing keys" in str(info.value) and "unknown keys" in str(info.value)
    assert "midlayer.self_attn.q_proj.weight" in str(info.value)


def test_validate_wrong_shape(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.update({"fc.weight": w["fc.weight"][:, :128].clone()}))
    with pytest.raises(ExportError, match=r"fc\.weight: shape \(64, 128\), expected \(64, 192\)"):
        read_drafter(out)


def test_validate_wrong_dtype(exported):
    out = exported[2]
    rewrite_weights(out, lambda w: w.update({"d2t": w["d2t"].to(torch.int32)}))
    with pytest.raises(ExportError, match=r"d2t: dtype torch\.int32"):
        read_drafter(out)


def test_validate_config_without_draft_vocab_size(exported):
    out = exported[2]
    rewrite_config(out, lambda c: c.pop("draft_vocab_size"))
    with pytest.raises(ExportError, match="draft_vocab_size"):
        read_drafter(out)


def test_validate_wrong_architecture(exported):
    out = exported[2]
    rewrite_config(out, lambda c: c.update({"architectures": ["LlamaForCausalLMEagle"]}))
    with pytest.raises(ExportError, match="architectures"):
        read_drafter(out)


def test_validate_d2t_as_target_ids_instead_of_offsets(exported):
    out = exported[2]
    # A common mistake: storing the target ids themselves instead of offsets.
    rewrite_weights(out, lambda w: w.update(
        {"d2t": w["d2t"] + torch.arange(w["d2t"].numel())}))
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        read_drafter(out)


def test_validate_t2d_marks_an_id_outside_the_draft_vocab(exported):
    out = exported[2]

    def edit(w):
        t2d = w["t2d"].clone()
        t2d[int(torch.nonzero(~t2d)[0])] = True
        w["t2d"] = t2d

    rewrite_weights(out, edit)
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        read_drafter(out)


def test_validate_missing_files(tmp_path, exported):
    with pytest.raises(ExportError, match="config.json"):
        read_drafter(tmp_path / "nothing")
    out = exported[2]
    (out / WEIGHTS_FILE).unlink()
    with pytest.raises(ExportError, match="weight files"):
        read_drafter(out)


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
        a = forward_ttt(drafter, ids, aux, pos, docs, 3)
        b = forward_ttt(loaded, ids, aux, pos, docs, 3)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_native_load_refuses_other_formats(tmp_path, exported):
    (tmp_path / META_FILE).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a native draftsmith checkpoint"):
        load_native(tmp_path, exported[1])


# --------------------------------------------------------------------------- layer ids, vLLM


@pytest.mark.parametrize("family", ["llama", "qwen", "deepseek", "gpt-oss"])
def test_vllm_reads_ids_as_inputs_for_every_family(family):
    # vLLM captures the input of layer id: the output of c is written as c+1.
    assert engine_layer_ids([2, 30, 58], family, "vllm") == [3, 31, 59]
    assert canonical_layer_ids([3, 31, 59], family, "vllm") == [2, 30, 58]


@pytest.mark.parametrize("family", ["llama", "qwen", "deepseek", "gpt-oss"])
@pytest.mark.parametrize("canonical", [[1, 29, 57], [2, 30, 58], [5, 10, 20]])
def test_sglang_ids_map_back_to_the_canonical_ones(family, canonical):
    written = engine_layer_ids(canonical, family, "sglang")
    assert canonical_layer_ids(written, family, "sglang", num_layers=61) == canonical


def test_sglang_gpt_oss_ids_ending_at_the_last_layer_are_inputs():
    # SGLang uses the ids as inputs when max(ids) == num_layers.
    assert canonical_layer_ids([3, 12, 24], "gpt-oss", "sglang", num_layers=24) == [2, 11, 23]


# --------------------------------------------------------------------------- speculators


@pytest.fixture()
def exported_speculators(random_target_dir, tmp_path):
    drafter, embed = make_drafter(random_target_dir, seed=5)
    out = tmp_path / "speculators"
    config = export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama", out,
                            extras={"speculative_tokens": 5,
                                    "verifier": {"name_or_path": "/models/target",
                                                 "architectures": ["LlamaForCausalLM"]}})
    return drafter, embed, out, config


def test_speculators_export_writes_the_vllm_config(exported_speculators, random_target):
    drafter, _, out, config = exported_speculators
    assert config == json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # vLLM assumes True when it is missing
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["target_hidden_size"] == random_target.figures["hidden_size"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [c + 1 for c in AUX_IDS]
    layer = config["transformer_layer_config"]
    assert layer["vocab_size"] == random_target.figures["vocab_size"]  # the target's vocab
    assert layer["num_hidden_layers"] == 1 and layer["model_type"] == "llama"
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": "/models/target",
                                "architectures": ["LlamaForCausalLM"]}


def test_speculators_weights_use_layers_0_names(exported_speculators):
    drafter, _, out, _ = exported_speculators
    weights = read_weights(out / WEIGHTS_FILE)
    expected = {k.replace("midlayer.", "layers.0.") for k in SGLANG_KEYS}
    assert set(weights) == expected
    state = drafter.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name.replace("layers.0.", "midlayer.")]), name


def test_speculators_with_sglang_names_is_refused(exported_speculators):
    out = exported_speculators[2]

    def rename(w):
        for name in [n for n in w if n.startswith("layers.0.")]:
            w["midlayer." + name.removeprefix("layers.0.")] = w.pop(name)

    rewrite_weights(out, rename)
    with pytest.raises(ExportError, match=r"missing keys.*layers\.0\.") as info:
        read_drafter(out)
    assert "unknown keys" in str(info.value)


def test_speculators_norm_flags_are_read_as_vllm_reads_them(random_target_dir, tmp_path,
                                                             caplog):
    """Written always, all four (a plain drafter's false too); a file without
    norm_before_residual is read as true, as vLLM 0.32's update_eagle3 reads it, with a
    warning; the other three default to false."""
    drafter, _ = make_drafter(random_target_dir, **ALL_NORMS)
    out = tmp_path / "vllm"
    config = export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama", out)
    assert {k: config[k] for k in ALL_NORMS} == ALL_NORMS
    assert read_drafter(out).config == drafter.config
    plain, _ = make_drafter(random_target_dir)
    config = export_drafter(plain.state_dict(), plain.config, "speculators", "llama",
                            tmp_path / "plain")
    assert {k: config[k] for k in ALL_NORMS} == dict.fromkeys(ALL_NORMS, False)
    rewrite_config(tmp_path / "plain", lambda c: [c.pop(k) for k in ALL_NORMS])
    with caplog.at_level("WARNING"):
        read = read_drafter(tmp_path / "plain").config
    assert read.norm_flags == {**dict.fromkeys(ALL_NORMS, False), "norm_before_residual": True}
    assert "no norm_before_residual" in caplog.text


def test_sglang_export_writes_the_norms_sglang_reads_and_refuses_what_it_cannot_run(
        random_target_dir, tmp_path):
    """SGLang 0.5.23 reads norm_before_fc, fc_norm and norm_output; its first layer always
    keeps the residual before hidden_norm, so a norm_before_residual drafter is refused with
    the setting that fixes it, and so is a sliding window (a server flag in SGLang)."""
    drafter, _ = make_drafter(random_target_dir, **SGLANG_NORMS)
    config = export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama",
                            tmp_path / "ok")
    assert {k: config[k] for k in SGLANG_NORMS} == SGLANG_NORMS
    weights = read_weights(tmp_path / "ok" / WEIGHTS_FILE)
    assert {"input_norm.weight", "fc_norm.0.weight", "fc_norm.2.weight"} <= set(weights)
    assert read_drafter(tmp_path / "ok").config == drafter.config
    for update, setting in (({"norm_before_residual": True}, "export.format=speculators"),
                            ({"sliding_window": 2048}, "speculative-draft-window-size")):
        cfg = drafter.config.model_copy(update=update)
        with pytest.raises(ExportError, match=setting):
            export_drafter(drafter.state_dict(), cfg, "sglang", "llama", tmp_path / "no")
        assert not (tmp_path / "no" / WEIGHTS_FILE).exists()


def test_sglang_legacy_aux_norm_names_are_read_as_fc_norm(random_target_dir, tmp_path):
    """SGLang 0.5.23 still loads aux_norm_low/mid/high as fc_norm.0/1/2 (and use_aux_norm as
    fc_norm): such a file reads, with the tensors where SGLang puts them."""
    drafter, _ = make_drafter(random_target_dir, fc_norm=True)
    out = tmp_path / "old"
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", out)
    old_names = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.",
                 "fc_norm.2.": "aux_norm_high."}

    def legacy(w):
        for new, old in old_names.items():
            w[old + "weight"] = w.pop(new + "weight")

    rewrite_weights(out, legacy)
    rewrite_config(out, lambda c: c.update({"use_aux_norm": True}) or c.pop("fc_norm"))
    back = read_drafter(out)
    assert back.config.fc_norm
    for i in range(3):
        assert torch.equal(back.tensors[f"fc_norm.{i}.weight"],
                           drafter.state_dict()[f"fc_norm.{i}.weight"])


def speculators_090_config(drafter: Eagle3Drafter, verifier: str) -> dict:
    """config.json as speculators 0.9.0's trainer writes an EAGLE-3 drafter with its defaults
    (train/config/schema.py: norm_before_residual, norm_before_fc and norm_output true for
    eagle3; draft_arch llama; num_layers 1; every draft layer a 2048-token sliding window,
    train/cli.py create_transformer_layer_config), its config class's field names
    (models/eagle3/config.py) and save_pretrained's architecture name."""
    cfg = drafter.config
    layer = {k: v for k, v in cfg.hf_fields().items() if k != "rope_scaling"}
    layer.update(sliding_window=2048, use_sliding_window=True, layer_types=["sliding_attention"],
                 initializer_range=0.02, transformers_version="5.0.0")
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": True, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [c + 1 for c in cfg.aux_layer_ids],
        "norm_before_fc": True, "fc_norm": False, "norm_output": True,
        "embed_requires_grad": False,
    }


def test_a_speculators_090_checkpoint_with_its_defaults_imports(random_target_dir, tmp_path):
    """EAGLE-3.1 as speculators 0.9.0 trains it by default: its config and tensor names
    (layers.0.*, input_norm, the embedding it saves) import to native with every flag and
    the sliding window, and the imported drafter computes what the checkpoint's weights do."""
    on = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    drafter, embed = make_drafter(random_target_dir, seed=3, **on)
    drafter = Eagle3Drafter(drafter.config.model_copy(update={"sliding_window": 2048}))
    drafter.load_state_dict(make_drafter(random_target_dir, seed=3, **on)[0].state_dict())
    out = tmp_path / "speculators-0.9.0"
    out.mkdir()
    state = {k.replace("midlayer.", "layers.0."): v for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))  # the embedding included, as it saves
    (out / "config.json").write_text(json.dumps(speculators_090_config(drafter, "/m/target")))
    report = import_drafter(out, tmp_path / "native")
    assert report.layout == "speculators"
    cfg = read_drafter(tmp_path / "native").config
    assert cfg.norm_flags == {**on, "fc_norm": False} and cfg.sliding_window == 2048
    assert cfg == drafter.config
    imported = load_native(tmp_path / "native", drafter.embed_tokens.weight)
    T = 9
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size, generator=g)
    pos, docs = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    with torch.no_grad():
        for a, b in zip(forward_ttt(drafter.eval(), ids, aux, pos, docs, 3),
                        forward_ttt(imported, ids, aux, pos, docs, 3), strict=True):
            assert torch.equal(a, b)
    # Exported again for vLLM, the window goes where vLLM reads it.
    config = export_drafter(read_drafter(tmp_path / "native").tensors, cfg, "speculators",
                            "llama", tmp_path / "again")
    layer = config["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 2048


def test_speculators_drafters_draftsmith_cannot_run_are_refused(exported_speculators):
    out = exported_speculators[2]
    rewrite_config(out, lambda c: c["transformer_layer_config"].update(model_type="qwen3"))
    with pytest.raises(ExportError, match="Llama-shaped"):
        read_drafter(out)
    rewrite_config(out, lambda c: c["transformer_layer_config"].update(
        model_type="llama", num_hidden_layers=2))
    with pytest.raises(ExportError, match="one decoder layer"):
        read_drafter(out)


def test_a_drafter_saved_by_speculators_own_trainer_is_read(exported_speculators, tmp_path):
    """speculators 0.9.0's Eagle3DraftModel.save_pretrained writes its class name as the
    architecture (seen on its trainer's output); the layout and tensors are the same."""
    drafter, _, out, _ = exported_speculators
    rewrite_config(out, lambda c: c.update({"architectures": ["Eagle3DraftModel"]}))
    report = import_drafter(out, tmp_path / "native")
    assert report.layout == "speculators"
    back = read_drafter(tmp_path / "native")
    shared = [n for n in drafter.state_dict() if n in back.tensors]
    assert len(shared) >= 10
    for name in shared:
        assert torch.equal(back.tensors[name], drafter.state_dict()[name]), name
    rewrite_config(out, lambda c: c.update({"architectures": ["SomethingElse"]}))
    with pytest.raises(ExportError):
        read_drafter(out)


def test_speculators_missing_config_fields_are_named(exported_speculators):
    out = exported_speculators[2]
    rewrite_config(out, lambda c: c.pop("speculators_config"))
    with pytest.raises(ExportError, match=r"speculators_config\.algorithm"):
        read_drafter(out)


# --------------------------------------------------------------------------- detect, import


def test_detect_layout_of_every_format(exported, exported_speculators, random_target_dir,
                                       tmp_path):
    assert detect_layout(exported[2]) == "sglang"
    assert detect_layout(exported_speculators[2]) == "speculators"
    drafter, embed = make_drafter(random_target_dir)
    save_native(drafter, tmp_path / "native", {})
    assert detect_layout(tmp_path / "native") == "native"
    # SpecForge saves the SGLang layout plus the embedding.
    specforge = tmp_path / "specforge"
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", specforge)
    rewrite_weights(specforge, lambda w: w.update({"embed_tokens.weight": embed}))
    assert detect_layout(specforge) == "specforge"
    assert "embed_tokens.weight" in read_drafter(specforge).tensors
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ExportError, match="LlamaForCausalLM"):
        detect_layout(tmp_path / "other")


@pytest.mark.parametrize(("layout", "norms"), [
    ("sglang", {}), ("speculators", {}), ("sglang", SGLANG_NORMS), ("speculators", ALL_NORMS)],
    ids=["sglang", "speculators", "sglang-eagle3.1", "speculators-eagle3.1"])
def test_round_trip_native_to_layout_to_native_is_bit_identical(layout, norms,
                                                                 random_target_dir, tmp_path):
    drafter, embed = make_drafter(random_target_dir, seed=7, **norms)
    save_native(drafter, tmp_path / "native", {"epoch": 1})
    start = read_drafter(tmp_path / "native")
    export_drafter(start.tensors, start.config, layout, "deepseek", tmp_path / layout)
    report = import_drafter(tmp_path / layout, tmp_path / "back", family="deepseek")
    assert report.layout == layout and report.config == drafter.config
    back = read_drafter(tmp_path / "back")
    assert back.config == start.config
    assert set(back.tensors) == set(start.tensors)
    for name, tensor in start.tensors.items():
        assert back.tensors[name].dtype == tensor.dtype, name
        assert torch.equal(back.tensors[name], tensor), name
    provenance = json.loads((tmp_path / "back" / META_FILE).read_text())["provenance"]
    assert provenance["source_layout"] == layout


def test_import_of_a_foreign_sglang_drafter_uses_the_family_rule(random_target_dir, tmp_path):
    drafter, _ = make_drafter(random_target_dir)
    cfg = drafter.config.model_copy(update={"aux_layer_ids": [2, 3, 4]})
    export_drafter(drafter.state_dict(), cfg, "sglang", "deepseek", tmp_path / "kimi")
    rewrite_config(tmp_path / "kimi", lambda c: c.pop("draftsmith"))  # as SpecForge writes it
    report = import_drafter(tmp_path / "kimi", tmp_path / "native", family="deepseek")
    assert report.config.aux_layer_ids == [2, 3, 4]  # written [3, 4, 5]: inputs of 3, 4, 5


def test_import_lists_missing_and_unexpected_keys(exported, tmp_path):
    out = exported[2]
    rewrite_weights(out, lambda w: w.update({"extra.bias": torch.zeros(3)})
                    or w.pop("norm.weight"))
    with pytest.raises(ExportError) as info:
        import_drafter(out, tmp_path / "native")
    assert "['norm.weight']" in str(info.value) and "['extra.bias']" in str(info.value)


def test_exported_drafter_loaded_back_gives_the_trained_logits(exported, random_target_dir):
    from draftsmith.model.eagle3.model import Eagle3Drafter

    drafter, embed, out, _ = exported
    checkpoint = read_drafter(out)
    loaded = Eagle3Drafter(checkpoint.config)
    loaded.load_state_dict({**checkpoint.tensors, "embed_tokens.weight": embed})
    T = 11
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, drafter.config.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * drafter.config.target_hidden_size, generator=g)
    pos, docs = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    with torch.no_grad():
        for a, b in zip(forward_ttt(drafter, ids, aux, pos, docs, 3),
                        forward_ttt(loaded.eval(), ids, aux, pos, docs, 3), strict=True):
            assert torch.equal(a, b)


def test_export_raises_max_position_embeddings_to_the_target_context(random_target_dir,
                                                                     tmp_path):
    drafter, _ = make_drafter(random_target_dir)
    config = export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", tmp_path,
                            context_length=262144)
    assert config["max_position_embeddings"] == 262144


def test_describe_reports_layout_vocab_and_ids_per_engine(random_target_dir, tmp_path):
    drafter, _ = make_drafter(random_target_dir)
    cfg = drafter.config.model_copy(update={"aux_layer_ids": [2, 3, 4]})
    export_drafter(drafter.state_dict(), cfg, "sglang", "deepseek", tmp_path / "d")
    info = describe(tmp_path / "d", family="deepseek")
    assert info["valid"] and info["layout"] == "sglang"
    assert info["draft_vocab_size"] == DRAFT_VOCAB
    assert info["canonical_aux_layer_ids"] == [2, 3, 4]
    assert info["sglang_aux_layer_ids"] == [3, 4, 5]
    assert info["speculators_aux_layer_ids"] == [3, 4, 5]
    assert info["shapes"]["fc.weight"] == [64, 192]
    rewrite_weights(tmp_path / "d", lambda w: w.pop("lm_head.weight"))
    broken = describe(tmp_path / "d", family="deepseek")
    assert broken["valid"] is False and "lm_head.weight" in broken["problems"]


def test_export_refuses_ids_sglang_cannot_express(random_target_dir, tmp_path):
    drafter, _ = make_drafter(random_target_dir)
    cfg = drafter.config.model_copy(update={"aux_layer_ids": [0, 3, 4]})
    with pytest.raises(ExportError, match="cannot be expressed"):
        export_drafter(drafter.state_dict(), cfg, "sglang", "deepseek", tmp_path)
    assert not (tmp_path / WEIGHTS_FILE).exists()


def test_eagle_repository_checkpoint_in_pytorch_bin_is_read(exported, tmp_path):
    """The EAGLE repository ships pytorch_model.bin with the SGLang names and config."""
    drafter, _, out, config = exported
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    torch.save(read_weights(out / WEIGHTS_FILE), eagle / "pytorch_model.bin")
    (eagle / "config.json").write_text(json.dumps(config))
    assert detect_layout(eagle) == "sglang"
    assert read_drafter(eagle).config == drafter.config


# --------------------------------------------------------------------------- what engines read


def vllm_fc_input_width(config: dict) -> int:
    """The fc input width vLLM 0.32 gives a speculators drafter (llama_eagle3.py): the
    drafter is built from transformer_layer_config plus the algorithm's updates, which put
    the layer ids at top level; fc = target_hidden_size x (num_aux_hidden_states, else the
    count of eagle_config's ids, else 3). tests/test_sglang_conformance.py pins that reading."""
    built = {**config["transformer_layer_config"],
             "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
             "target_hidden_size": config.get("target_hidden_size")}
    ids = (built.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    count = built.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    return (built["target_hidden_size"] or built["hidden_size"]) * count


def sglang_fc_input_width(config: dict) -> int:
    """SGLang 0.5.23's (llama_eagle3.py): num_aux_hidden_states, else eagle_config's ids."""
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    count = config.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    return config.get("target_hidden_size", config["hidden_size"]) * count


@pytest.mark.parametrize("aux_ids", [[1, 3], [1, 3, 4], [0, 2, 4, 6]])
def test_engines_size_fc_for_the_number_of_aux_layers(random_target_dir, tmp_path, aux_ids):
    """k != 3 aux layers: vLLM sized fc 3*H from a speculators config (the ids sit where it
    does not count them) and the drafter failed to load."""
    tcfg = json.loads((random_target_dir / "config.json").read_text())
    drafter = Eagle3Drafter(Eagle3Config.from_target(tcfg, aux_ids, DRAFT_VOCAB))
    d2t, t2d, _ = build_vocab_map(list(range(DRAFT_VOCAB)), tcfg["vocab_size"], DRAFT_VOCAB)
    drafter.load_target_parts(torch.randn(tcfg["vocab_size"], tcfg["hidden_size"]), d2t, t2d)
    state = drafter.state_dict()
    for layout in ("speculators", "sglang"):
        config = export_drafter(state, drafter.config, layout, "llama", tmp_path / layout)
        fc = read_weights(tmp_path / layout / WEIGHTS_FILE)["fc.weight"]
        width = (vllm_fc_input_width if layout == "speculators" else sglang_fc_input_width)(
            config)
        assert width == fc.shape[1] == len(aux_ids) * tcfg["hidden_size"], layout


def test_a_full_vocab_drafter_has_no_vocab_map_for_vllm(random_target_dir, tmp_path):
    """draft_vocab_size == vocab_size: vLLM creates no draft_id_to_target_id, so a d2t tensor
    fails to load; the speculators export leaves d2t/t2d out and reads back as the identity.
    SGLang maps d2t to hot_token_id either way (the identity), so its layout keeps them."""
    tcfg = json.loads((random_target_dir / "config.json").read_text())
    V = tcfg["vocab_size"]
    drafter = Eagle3Drafter(Eagle3Config.from_target(tcfg, AUX_IDS, V))
    drafter.load_target_parts(torch.randn(V, tcfg["hidden_size"]),
                              torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    state = drafter.state_dict()
    export_drafter(state, drafter.config, "speculators", "llama", tmp_path / "vllm")
    names = set(read_weights(tmp_path / "vllm" / WEIGHTS_FILE))
    assert not names & {"d2t", "t2d"} and "layers.0.self_attn.q_proj.weight" in names
    back = read_drafter(tmp_path / "vllm")
    assert torch.equal(back.tensors["d2t"], torch.zeros(V, dtype=torch.int64))
    assert bool(back.tensors["t2d"].all())
    import_drafter(tmp_path / "vllm", tmp_path / "native")  # reads, loads, validates
    export_drafter(state, drafter.config, "sglang", "llama", tmp_path / "sglang")
    assert {"d2t", "t2d"} <= set(read_weights(tmp_path / "sglang" / WEIGHTS_FILE))
    # A reduced draft vocab keeps its map in both layouts.
    small, _ = make_drafter(random_target_dir)
    export_drafter(small.state_dict(), small.config, "speculators", "llama", tmp_path / "small")
    assert {"d2t", "t2d"} <= set(read_weights(tmp_path / "small" / WEIGHTS_FILE))
