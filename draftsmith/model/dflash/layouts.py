"""DFlash's tensors (vLLM's names: Qwen3-shaped layers) and its one checkpoint layout, the
speculators layout vLLM 0.32 loads."""

from __future__ import annotations

from draftsmith.export.layer_ids import engine_layer_ids
from draftsmith.export.layout import ExportError, Layout, TensorSpec, speculators_verifier
from draftsmith.model.dflash.model import DFlashConfig


def dflash_tensors(cfg: DFlashConfig, optional: bool = False) -> dict[str, TensorSpec]:
    """Every tensor of a DFlash drafter with `cfg`, in draftsmith's (= vLLM's) names: Qwen3
    layers (q_norm and k_norm per head), fc and hidden_norm for the context, the final norm,
    its own lm_head over the draft vocab, and the vocab map."""
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    specs = {"fc.weight": TensorSpec((H, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
                                     "float"),
             "hidden_norm.weight": TensorSpec((H,), "float")}
    for i in range(cfg.num_hidden_layers):
        layer = f"layers.{i}."
        specs.update({
            layer + "input_layernorm.weight": TensorSpec((H,), "float"),
            layer + "post_attention_layernorm.weight": TensorSpec((H,), "float"),
            layer + "self_attn.q_proj.weight": TensorSpec((q, H), "float"),
            layer + "self_attn.k_proj.weight": TensorSpec((kv, H), "float"),
            layer + "self_attn.v_proj.weight": TensorSpec((kv, H), "float"),
            layer + "self_attn.o_proj.weight": TensorSpec((H, q), "float"),
            layer + "self_attn.q_norm.weight": TensorSpec((d,), "float"),
            layer + "self_attn.k_norm.weight": TensorSpec((d,), "float"),
            layer + "mlp.gate_proj.weight": TensorSpec((I, H), "float"),
            layer + "mlp.up_proj.weight": TensorSpec((I, H), "float"),
            layer + "mlp.down_proj.weight": TensorSpec((H, I), "float"),
        })
    specs.update({"norm.weight": TensorSpec((H,), "float"),
                  "lm_head.weight": TensorSpec((cfg.draft_vocab_size, H), "float"),
                  "d2t": TensorSpec((cfg.draft_vocab_size,), "int64"),
                  "t2d": TensorSpec((cfg.vocab_size,), "bool")})
    if optional:
        specs["embed_tokens.weight"] = TensorSpec((cfg.vocab_size, H), "float")
    return specs


class DFlashSpeculatorsLayout(Layout):
    """DFlash for vLLM 0.32: the speculators layout (`speculators_model_type: dflash`). vLLM's
    update_dflash reads aux_hidden_state_layer_ids (inputs of layers: written canonical + 1,
    and it sets dflash_config.target_layer_ids = those - 1), mask_token_id (required),
    sliding_window_non_causal (causal = its negation, default non-causal) and
    sample_from_anchor (false: the anchor is the known token, block_size - 1 drafts); the
    Qwen3-shaped layers come from transformer_layer_config (DFlashQwen3ForCausalLM)."""

    def tensors(self, cfg: DFlashConfig, optional: bool = False) -> dict[str, TensorSpec]:
        return dflash_tensors(cfg, optional)

    def build_config(self, cfg: DFlashConfig, family, dtype, extras):
        layer = {
            "model_type": "qwen3", "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            # transformers 5 keeps RoPE here; both are written so either reader finds it.
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default",
                                **(cfg.rope_scaling or {})},
            "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": False,
            "attention_bias": False,
        }
        if cfg.rope_scaling:
            layer["rope_scaling"] = cfg.rope_scaling
        return {
            "architectures": [self.architecture],
            "speculators_model_type": "dflash",
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": cfg.block_size - 1,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": speculators_verifier(extras),
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "aux_hidden_state_layer_ids": engine_layer_ids(cfg.aux_layer_ids, family,
                                                           self.engine),
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "sliding_window_non_causal": not cfg.causal,
            "sample_from_anchor": False,
            "torch_dtype": dtype,
            "draftsmith": {"canonical_aux_layer_ids": cfg.aux_layer_ids, "target_family": family,
                           **({"target_provenance": extras["target_provenance"]}
                              if extras.get("target_provenance") else {})},
        }

    def is_layout_of(self, config):
        return config.get("speculators_model_type") == "dflash"

    def written_layer_ids(self, config):
        return list(config["aux_hidden_state_layer_ids"])

    def parse_config(self, config, family, num_layers=None):
        layer = config["transformer_layer_config"]
        if config.get("sample_from_anchor", False):
            raise ExportError("sample_from_anchor=true (the anchor position drafts too, as "
                              "DSpark does): draftsmith's DFlash drafts from the mask positions "
                              "only, as vLLM's DFlash runs it by default")
        for flag in ("use_swa", "attention_sink_bias", "attention_value_scale"):
            if (config.get("dflash_config") or {}).get(flag) or layer.get(flag):
                raise ExportError(f"{flag} is set: a DFlash variant draftsmith does not run")
        if "sliding_attention" in (layer.get("layer_types") or []):
            raise ExportError("transformer_layer_config.layer_types has sliding_attention: a "
                              "sliding-window DFlash drafter, which draftsmith does not run")
        return DFlashConfig(
            **DFlashConfig.layer_fields(layer), draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            aux_layer_ids=self.canonical_ids(config, family, num_layers),
            num_hidden_layers=layer["num_hidden_layers"],
            block_size=config.get("block_size")
            or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] + 1,
            mask_token_id=config["mask_token_id"],
            # vLLM's reading: causal = not sliding_window_non_causal, absent meaning true.
            causal=not config.get("sliding_window_non_causal", True))


DFLASH_SPECULATORS = DFlashSpeculatorsLayout(
    name="speculators", engine="vllm", architecture="DFlashSpeculator", kind="dflash",
    layer_prefix="layers.", native_prefix="layers.",
    required_config=("architectures", "speculators_model_type", "speculators_config.algorithm",
                     "speculators_config.proposal_methods", "speculators_config.verifier",
                     "transformer_layer_config.hidden_size",
                     "transformer_layer_config.num_hidden_layers",
                     "transformer_layer_config.vocab_size", "draft_vocab_size",
                     "aux_hidden_state_layer_ids", "mask_token_id"),
    identity_vocab_map_omitted=True,
    # speculators 0.9.0's trainer saves its DFlashDraftModel under its class name.
    also_read_as=("DFlashDraftModel",),
)
