"""What every drafter kind's shape shares, and the one place it is read from a Hugging Face
config (a target's, or the decoder layers of an exported drafter).

A drafter's layers follow the target's sizes: hidden size, heads, head_dim, MLP width, RMSNorm
eps and RoPE (theta and scaling, e.g. Llama-3.1's "llama3" rope_scaling or YaRN: a drafter
that drafts at the target's positions must rotate them as the target does). No torch here:
the kinds' configs import it, and so does the export layer's config reading.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class TargetTiedShape(BaseModel):
    """The fields every drafter config has, in the order the native checkpoint's draftsmith.json
    writes them (a kind's own fields follow)."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int
    vocab_size: int  # the target's vocab (embedding rows)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # canonical: output of decoder layer i
    hidden_act: str = "silu"

    def rope_scaling_copy(self) -> dict | None:
        """rope_scaling for transformers' LlamaConfig, which writes rope_theta into the dict it
        is given: a copy, so that building a module leaves this config (and what is exported
        from it) as it was."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @staticmethod
    def layer_fields(hf: dict[str, Any]) -> dict[str, Any]:
        """The layer-shape fields of a Hugging Face config, under the drafter's names."""
        heads = hf["num_attention_heads"]
        # transformers 5 keeps RoPE settings under rope_parameters; older configs at top level.
        rope = hf.get("rope_parameters") or {}
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return {
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "num_attention_heads": heads,
            "num_key_value_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": hf.get("max_position_embeddings", 4096),
            "vocab_size": hf["vocab_size"],
            "hidden_act": hf.get("hidden_act", "silu"),
        }

    @staticmethod
    def target_fields(target_config: dict[str, Any], aux_layer_ids: list[int],
                      draft_vocab_size: int) -> dict[str, Any]:
        """Every shared field of a drafter for this target. Its MLP is Llama's SiLU MLP,
        whatever the target's activation."""
        return {**TargetTiedShape.layer_fields({**target_config, "hidden_act": "silu"}),
                "draft_vocab_size": draft_vocab_size,
                "target_hidden_size": target_config["hidden_size"],
                "aux_layer_ids": aux_layer_ids}
