"""The SGLang / EAGLE / SpecForge drafter layout (REFERENCE.md section 3), described once as data.

SGLang silently drops weight keys it does not know and never reports missing ones, so the
exported directory is checked against this description after it is written: every expected key
with its shape and dtype, no unknown key, the config fields SGLang needs, d2t consistent with t2d.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.artifacts import atomic_path, atomic_write_json
from draftsmith.model.eagle3 import Eagle3Config

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
REQUIRED_CONFIG = ("architectures", "model_type", "num_hidden_layers", "hidden_size",
                   "intermediate_size", "num_attention_heads", "num_key_value_heads",
                   "vocab_size", "draft_vocab_size", "target_hidden_size",
                   "max_position_embeddings", "tie_word_embeddings", "eagle_config")


class ExportError(ValueError):
    pass


def expected_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype kind) for the SGLang layout; 'float' means the weight dtype."""
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    k = len(cfg.aux_layer_ids)
    return {
        "fc.weight": ((H, k * cfg.target_hidden_size), "float"),
        "midlayer.input_layernorm.weight": ((H,), "float"),
        "midlayer.hidden_norm.weight": ((H,), "float"),
        "midlayer.post_attention_layernorm.weight": ((H,), "float"),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), "float"),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), "float"),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), "float"),
        "midlayer.self_attn.o_proj.weight": ((H, q), "float"),
        "midlayer.mlp.gate_proj.weight": ((I, H), "float"),
        "midlayer.mlp.up_proj.weight": ((I, H), "float"),
        "midlayer.mlp.down_proj.weight": ((H, I), "float"),
        "norm.weight": ((H,), "float"),
        "lm_head.weight": ((cfg.draft_vocab_size, H), "float"),
        "d2t": ((cfg.draft_vocab_size,), "int64"),
        "t2d": ((cfg.vocab_size,), "bool"),
    }


def sglang_layer_ids(canonical: list[int], family: str) -> list[int]:
    """Ids to write into eagle_config so SGLang captures the outputs of `canonical` layers.

    SGLang captures the INPUT of a layer; the output of layer c is the input of layer c+1.
    - llama, qwen and most others: SGLang adds 1 to every id -> write c.
    - deepseek (DeepSeek V2/V3/V3.2, Kimi-K2/K2.5, GLM MoE DSA / 4.7 lite): SGLang adds 1 only
      when the first id is 1, otherwise uses the ids as inputs -> write c when c[0] == 1, c+1
      when c[0] >= 2, and refuse c[0] == 0 (no list makes SGLang capture layer 1's input then).
    - gpt-oss: ids used as they are only if max(ids) == num_layers, else +1 -> write c.
    """
    if family in ("llama", "qwen", "gpt-oss"):
        return list(canonical)
    if family == "deepseek":
        if canonical[0] == 1:
            return list(canonical)
        if canonical[0] == 0:
            raise ExportError(
                f"aux layers {canonical} (outputs) cannot be expressed for SGLang on a "
                "DeepSeek-family target: it captures the input of layer id+1 only when the "
                "first id is 1, so the output of layer 0 is unreachable together with the "
                "others. Extract with a first aux layer >= 1 and retrain."
            )
        return [c + 1 for c in canonical]
    raise ExportError(f"unknown target family {family!r}; expected llama, qwen, deepseek, gpt-oss")


def sglang_config(cfg: Eagle3Config, family: str, dtype: str) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(cfg.aux_layer_ids, family),
            "use_aux_hidden_state": True,
        },
        # Not read by SGLang: lets draftsmith map the ids back without knowing the family rule.
        "draftsmith": {"canonical_aux_layer_ids": cfg.aux_layer_ids, "target_family": family},
    }


def export_sglang(state: dict[str, torch.Tensor], cfg: Eagle3Config, family: str,
                  out_dir: str | Path) -> dict[str, Any]:
    """Write config.json + model.safetensors in the SGLang layout, validate them, return the
    written config."""
    out_dir = Path(out_dir)
    expected = expected_tensors(cfg)
    tensors = {name: state[name].detach().cpu().contiguous() for name in expected}
    dtype = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    with atomic_path(out_dir / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", sglang_config(cfg, family, dtype))
    return validate_sglang(out_dir)


def config_from_sglang(config: dict[str, Any]) -> Eagle3Config:
    ours = config.get("draftsmith", {})
    return Eagle3Config(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=config.get("rope_theta", 1e4),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        aux_layer_ids=ours.get("canonical_aux_layer_ids",
                               config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        hidden_act=config.get("hidden_act", "silu"),
    )


def validate_sglang(drafter_dir: str | Path) -> dict[str, Any]:
    """Check a directory against the SGLang layout; raise ExportError listing every problem."""
    drafter_dir = Path(drafter_dir)
    problems: list[str] = []
    config_path = drafter_dir / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{drafter_dir}: no config.json")
    config = json.loads(config_path.read_text())
    missing_fields = [f for f in REQUIRED_CONFIG if f not in config]
    if missing_fields:
        raise ExportError(f"{config_path}: missing config fields {missing_fields} (SGLang fails "
                          "without draft_vocab_size and mis-loads without the others)")
    if config["architectures"] != [ARCHITECTURE]:
        problems.append(f"architectures is {config['architectures']}, expected [{ARCHITECTURE!r}]")
    if config["num_hidden_layers"] != 1 or config["tie_word_embeddings"] is not False:
        problems.append("num_hidden_layers must be 1 and tie_word_embeddings false")
    eagle = config["eagle_config"]
    if not eagle.get("use_aux_hidden_state") or not eagle.get("eagle_aux_hidden_state_layer_ids"):
        problems.append("eagle_config needs use_aux_hidden_state: true and "
                        "eagle_aux_hidden_state_layer_ids")
    cfg = config_from_sglang(config)
    expected = expected_tensors(cfg)
    weights = drafter_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise ExportError(f"{drafter_dir}: no {WEIGHTS_FILE}")
    with safe_open(str(weights), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing keys (SGLang would leave them random): {missing}")
    if unknown:
        problems.append(f"unknown keys (SGLang would silently drop them): {unknown}")
    float_dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else None
    for name, (shape, kind) in expected.items():
        if name not in tensors:
            continue
        t = tensors[name]
        if tuple(t.shape) != shape:
            problems.append(f"{name}: shape {tuple(t.shape)}, expected {shape}")
        want = {"int64": torch.int64, "bool": torch.bool}.get(kind, float_dtype)
        if t.dtype != want:
            problems.append(f"{name}: dtype {t.dtype}, expected {want}")
    if not problems and {"d2t", "t2d"} <= tensors.keys():
        d2t, t2d = tensors["d2t"], tensors["t2d"]
        target_ids = d2t + torch.arange(d2t.numel())
        if (target_ids.min() < 0 or target_ids.max() >= t2d.numel()
                or not bool(t2d[target_ids].all()) or int(t2d.sum()) != d2t.numel()):
            problems.append("d2t and t2d disagree: d2t must hold offsets (target = draft + d2t) "
                            "to exactly the ids t2d marks")
    if problems:
        raise ExportError(f"{drafter_dir} is not a valid SGLang EAGLE-3 drafter:\n  - "
                          + "\n  - ".join(problems))
    return config
