"""The drafter's layer shape is read from the target's config in one place
(draftsmith/model/shape.py), for every kind: a target whose RoPE is scaled (Llama-3.1's
"llama3" scaling, in either of transformers' spellings) gives EAGLE-3 and DFlash drafters that
carry the scaling into their config, their rotary embedding and their exported config, and read
it back from the export."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.config import DFlashOptions, DrafterConfig
from draftsmith.export.convert import export_drafter, read_drafter
from draftsmith.model.kinds import build_drafter, kind_named
from tests.test_eagle3 import vocab_map

AUX_IDS = [1, 3, 4]
DRAFT_VOCAB = 256
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SETTINGS = {"eagle3": DrafterConfig(kind="eagle3"),
            "dflash": DrafterConfig(kind="dflash",
                                    dflash=DFlashOptions(block_size=4, mask_token_id=5))}
# Where each export keeps the drafter's layer config.
EXPORTS = [("eagle3", "sglang", None), ("eagle3", "speculators", "transformer_layer_config"),
           ("dflash", "speculators", "transformer_layer_config")]


def scaled_target(target_dir, spelling: str) -> dict:
    """The tiny target's config with Llama-3.1's RoPE scaling, as transformers 4 writes it (a
    top-level rope_scaling) or as transformers 5 does (rope_parameters, theta inside)."""
    config = {**json.loads((target_dir / "config.json").read_text()),
              "max_position_embeddings": 131072}  # past the scaling's original 8192
    config.pop("rope_scaling", None)
    theta = config.pop("rope_theta", None) or \
        (config.pop("rope_parameters", None) or {}).get("rope_theta", 10000.0)
    config.pop("rope_parameters", None)
    if spelling == "rope_scaling":
        return {**config, "rope_theta": theta, "rope_scaling": dict(LLAMA3_SCALING)}
    return {**config, "rope_parameters": {"rope_theta": theta, **LLAMA3_SCALING}}


def unscaled_target(target_dir) -> dict:
    config = {**json.loads((target_dir / "config.json").read_text()),
              "max_position_embeddings": 131072}
    config.pop("rope_scaling", None)
    rope = config.pop("rope_parameters", None) or {}
    return {**config, "rope_theta": config.get("rope_theta", rope.get("rope_theta", 10000.0))}


def shape(kind: str, target_config: dict):
    return kind_named(kind).build_config(target_config, AUX_IDS, DRAFT_VOCAB, SETTINGS[kind])


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_both_kinds_carry_the_target_rope_scaling_into_config_and_rotary(random_target_dir,
                                                                        kind, spelling):
    scaled = shape(kind, scaled_target(random_target_dir, spelling))
    plain = shape(kind, unscaled_target(random_target_dir))
    assert scaled.rope_scaling == LLAMA3_SCALING
    assert plain.rope_scaling is None
    assert scaled.rope_theta == plain.rope_theta
    scaled_rotary, plain_rotary = build_drafter(scaled).rotary, build_drafter(plain).rotary
    assert scaled.rope_scaling == LLAMA3_SCALING  # building the module left the config alone
    assert scaled_rotary.rope_type == "llama3" and plain_rotary.rope_type == "default"
    # llama3 scaling slows the low frequencies down by `factor` and keeps the high ones.
    ratio = plain_rotary.inv_freq / scaled_rotary.inv_freq  # [d/2]
    assert ratio[0].item() == pytest.approx(1.0)
    assert ratio[-1].item() == pytest.approx(LLAMA3_SCALING["factor"])


@pytest.mark.parametrize(("kind", "layout", "section"), EXPORTS,
                         ids=[f"{k}-{name}" for k, name, _ in EXPORTS])
def test_the_export_carries_the_rope_scaling_and_reads_it_back(random_target_dir, tmp_path,
                                                                kind, layout, section):
    cfg = shape(kind, scaled_target(random_target_dir, "rope_parameters"))
    torch.manual_seed(0)
    drafter = build_drafter(cfg)
    drafter.load_target_parts(torch.randn(cfg.vocab_size, cfg.hidden_size),
                              *vocab_map(cfg.vocab_size, DRAFT_VOCAB))
    config = export_drafter(drafter.state_dict(), cfg, layout, "llama", tmp_path / layout)
    layer = config[section] if section else config
    assert layer["rope_scaling"] == LLAMA3_SCALING
    assert layer["rope_theta"] == cfg.rope_theta
    written = json.loads((tmp_path / layout / "config.json").read_text())
    assert (written[section] if section else written)["rope_scaling"] == LLAMA3_SCALING
    assert read_drafter(tmp_path / layout).config.rope_scaling == LLAMA3_SCALING
