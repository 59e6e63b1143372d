"""The target's attention at decode widths as two matmuls and a softmax, for the static path.

On an H100 in float32, SDPA sends a decode step's attention (1 to k+1 queries over a static
cache of 512 slots) to its memory-efficient kernel, which runs one thread block per head: 57 us
a layer, half of SmolLM2's 3.1 ms plain step (speculative_profile.py, 2026-12-06). Written as
matmuls, a compiled step gets cuBLAS's batched products and one fused softmax instead. Forwards
wider than DECODE_WIDTH (prompts) still go through SDPA, whose kernels suit long queries.

`use_decode_attention(model)` registers the function with transformers' AttentionInterface
(and SDPA's mask builder under the same name) and sets it on the model.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DECODE_ATTENTION = "draftsmith_decode"
DECODE_WIDTH = 16  # widest query block that runs as matmuls: a verify's k+1 tokens fit


def decode_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key and value [B, Hkv, S, D], attention_mask bool [B, 1, T, S]
    (True: attend) or additive, or None -> [B, T, H, D], as transformers' attention functions
    return it. SDPA takes the forwards this does not speed up (wide ones) and those whose
    meaning is SDPA's own (no mask over several queries: causal from the first key)."""
    batch, heads, width, dim = query.shape
    if width > DECODE_WIDTH or dropout or (attention_mask is None and width > 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    # Query heads h = g * group + j share key head g (transformers' repeat_kv), so a group's
    # queries stack as rows over their shared keys: no copy of the keys per query head.
    q = query.reshape(batch, kv_heads, group * width, dim)  # [B, Hkv, G*T, D]
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [B, Hkv, G*T, S]
    scores = scores.view(batch, kv_heads, group, width, keys)  # [B, Hkv, G, T, S]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
        else:  # additive
            scores = scores + attention_mask[:, :, None]
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)  # bf16's in float32
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(value.dtype)  # [B, Hkv, G, T, S]
    out = torch.matmul(probs.view(batch, kv_heads, group * width, keys), value)  # [B, Hkv, G*T, D]
    out = out.view(batch, heads, width, dim).transpose(1, 2)  # [B, T, H, D]
    return out.contiguous(), None


def use_decode_attention(model) -> None:
    """Run `model`'s attention through decode_attention_forward from now on."""
    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(DECODE_ATTENTION)
