"""A grouped-query target's attention for decode steps over a static cache, as transformers
attention implementations (AttentionInterface).

SDPA sends a decode step, a few queries over a long padded cache, to kernels that read the
cache slowly: cuDNN's took 627 us a call for 2,048 rows over a 768-token cache on an H200
(the generate stage, issue 27), and on an H100 in float32 the memory-efficient kernel took 57 us
a layer for one sequence's 1 or 4 queries over 512 slots, half of SmolLM2's plain step in the
embedded engine (2026-12-06). Here each KV head's query heads are stacked on the query axis, so
the cache is read once per KV head, and the step is computed by `attend`: SDPA itself, two
batched matmuls with a float32 softmax (which torch.compile fuses), or flex attention, for one
query: the generate stage's static cache (`generate.decode_attention`). The embedded engine's
static path uses the matmul step for up to DECODE_WIDTH queries (`grouped_verify_matmul`: its
verify steps' k + 1). Every other forward (prompts, models without grouped heads, no mask) is
transformers' SDPA.
"""

from __future__ import annotations

import torch

GROUPED_DECODE = "draftsmith_grouped_decode"
GROUPED_DECODE_MATMUL = "draftsmith_grouped_decode_matmul"
GROUPED_DECODE_FLEX = "draftsmith_grouped_decode_flex"
GROUPED_VERIFY_MATMUL = "draftsmith_grouped_verify_matmul"
DECODE_WIDTH = 16  # most queries a matmul decode step takes


def _grouped_decode(attend, widest: int, module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
                    scaling: float | None, **kwargs):
    """transformers' SDPA attention, except for decode steps (at most `widest` queries) of a
    grouped-query model with a mask, which `attend` computes. Heads are ordered as repeat_kv
    orders them (query head h reads KV head h // g), so query [B, nkv * g, T, d] viewed as
    [B, nkv, g * T, d] puts each KV head's g query heads on the query axis (row j * T + t is
    query t of the KV head's j-th query head)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, head_dim = query.shape
    if q_len > widest or groups == 1 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    grouped = query.reshape(batch, key.shape[1], groups * q_len, head_dim)  # [B, nkv, g*T, d]
    # Several queries: the mask [B, 1, 1, T, S] meets the scores as [B, nkv, g, T, S] (a view)
    mask = attention_mask if q_len == 1 else attention_mask[:, :, None]
    scale = scaling if scaling is not None else head_dim ** -0.5
    out = attend(grouped, key, value, mask, dropout, scale)  # [B, nkv, g*T, d]
    out = out.reshape(batch, heads, q_len, head_dim).transpose(1, 2)  # [B, T, nh, d]
    return out.contiguous(), None


def _sdpa_step(grouped, key, value, mask, dropout: float, scale: float) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)  # [B, nkv, g, d]


def _matmul_probs(grouped, key, mask, scale: float) -> torch.Tensor:
    """The attention weights, in float32 at least: [B, nkv, g*T, S]. mask: [B, 1, 1, S] for one
    query, [B, 1, 1, T, S] for T."""
    scores = grouped @ key.transpose(-1, -2)  # [B, nkv, g*T, S]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale  # as above
    if mask.dim() == 5:
        scores = scores.view(*scores.shape[:2], -1, *mask.shape[-2:])  # [B, nkv, g, T, S]
    scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
              else scores + mask)  # as above
    return scores.softmax(-1).flatten(2, -2)  # [B, nkv, g*T, S]


def _matmul_step(grouped, key, value, mask, dropout: float, scale: float) -> torch.Tensor:
    """Two batched matmuls with a float32 softmax, which torch.compile fuses (decode runs
    without dropout)."""
    return _matmul_probs(grouped, key, mask, scale).to(value.dtype) @ value  # [B, nkv, g*T, d]


def _verify_matmul_step(grouped, key, value, mask, dropout: float, scale: float) -> torch.Tensor:
    """_matmul_step for several queries, where a query that sees no key (a left-padded
    prompt's padding, within DECODE_WIDTH) attends to nothing, as in SDPA, instead of
    writing NaN into its row's cache."""
    probs = _matmul_probs(grouped, key, mask, scale).nan_to_num(0.0)  # [B, nkv, g*T, S]
    return probs.to(value.dtype) @ value  # [B, nkv, g*T, d]


def _flex_step(grouped, key, value, mask, dropout: float, scale: float) -> torch.Tensor:
    """torch's flex attention with the padding mask as a block mask, so blocks of the cache
    that no row sees (left padding, positions not yet written) are not read at all. Compiled
    (as generate compiles the static cache's decode step) it is flex decoding's split-KV
    Triton kernel; in eager mode torch computes it unfused, which only tests do. Additive
    masks count as masks only: a position is seen when its bias is above the dtype's min."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows = mask[:, 0, -1, :]  # [B, S]: the decode step's own row of the mask
    seen = rows if rows.dtype == torch.bool else rows > torch.finfo(rows.dtype).min  # [B, S]

    def visible(b, h, q_idx, kv_idx):
        return seen[b, kv_idx]

    blocks = create_block_mask(visible, B=grouped.shape[0], H=None, Q_LEN=grouped.shape[2],
                               KV_LEN=key.shape[2], device=grouped.device)
    return flex_attention(grouped, key, value, block_mask=blocks, scale=scale)  # [B, nkv, g, d]


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """The static cache's decode attention: SDPA, reading each KV head once (one query)."""
    return _grouped_decode(_sdpa_step, 1, module, query, key, value, attention_mask, dropout,
                           scaling, **kwargs)


def grouped_decode_matmul(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """The decode step as two batched matmuls (`_matmul_step`, one query)."""
    return _grouped_decode(_matmul_step, 1, module, query, key, value, attention_mask,
                           dropout, scaling, **kwargs)


def grouped_verify_matmul(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """The embedded engine's decode and verify steps as two batched matmuls
    (`_verify_matmul_step`, up to DECODE_WIDTH queries)."""
    return _grouped_decode(_verify_matmul_step, DECODE_WIDTH, module, query, key, value,
                           attention_mask, dropout, scaling, **kwargs)


def grouped_decode_flex(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs):
    """The decode step as flex attention (`_flex_step`, one query)."""
    return _grouped_decode(_flex_step, 1, module, query, key, value, attention_mask, dropout,
                           scaling, **kwargs)


# the generate stage's decode_attention setting -> (the name transformers knows it by, the
# function)
DECODE_ATTENTION = {"sdpa": (GROUPED_DECODE, grouped_decode_attention),
                    "matmul": (GROUPED_DECODE_MATMUL, grouped_decode_matmul),
                    "flex": (GROUPED_DECODE_FLEX, grouped_decode_flex)}
# the embedded engine's static path
VERIFY_ATTENTION = (GROUPED_VERIFY_MATMUL, grouped_verify_matmul)


def register_grouped_decode() -> None:
    """Make the decode attentions implementations transformers knows (masks as SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    for name, function in (*DECODE_ATTENTION.values(), VERIFY_ATTENTION):
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def use_decode_attention(model, decode_attention: str) -> None:
    """Run `model`'s attention through DECODE_ATTENTION[decode_attention] from now on."""
    register_grouped_decode()
    model.set_attn_implementation(DECODE_ATTENTION[decode_attention][0])


def use_verify_attention(model) -> None:
    """Run `model`'s attention through grouped_verify_matmul from now on."""
    register_grouped_decode()
    model.set_attn_implementation(VERIFY_ATTENTION[0])
