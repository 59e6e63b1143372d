"""The matmul decode step over several queries (draftsmith/model/grouped_attention.py), as the
embedded engine's static path verifies k + 1 tokens with it: SDPA's results at decode widths,
SDPA itself elsewhere, and the static runner that installs it gives the model its own back.
(One query, and the generate stage's use: test_generate_backend.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draftsmith.model import grouped_attention
from draftsmith.model.grouped_attention import (
    DECODE_WIDTH,
    VERIFY_ATTENTION,
    grouped_verify_matmul,
)
from draftsmith.serve.embedded import StaticTargetRunner, TargetRunner

HEADS, KV_HEADS, DIM, KEYS = 9, 3, 16, 40  # SmolLM2's grouping: 3 query heads a key head


class Module(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def qkv(width: int, batch: int = 2, dtype=torch.float64):
    generator = torch.Generator().manual_seed(width)
    q = torch.randn(batch, HEADS, width, DIM, generator=generator, dtype=dtype)  # [B, H, T, D]
    k = torch.randn(batch, KV_HEADS, KEYS, DIM, generator=generator, dtype=dtype)  # [B, Hkv, S, D]
    v = torch.randn(batch, KV_HEADS, KEYS, DIM, generator=generator, dtype=dtype)  # [B, Hkv, S, D]
    return q, k, v


def holed_mask(width: int, batch: int = 2) -> torch.Tensor:
    """bool [B, 1, T, S]: causal from slot KEYS - 8, with each row's own holes (padding)."""
    positions = torch.arange(KEYS - 8, KEYS - 8 + width)  # [T]
    mask = torch.arange(KEYS)[None, :] <= positions[:, None]  # [T, S]
    mask = mask[None, None].repeat(batch, 1, 1, 1)  # [B, 1, T, S]
    mask[0, :, :, :5] = False
    mask[1, :, :, 10:20] = False
    return mask


@pytest.mark.parametrize("width", [1, 4, DECODE_WIDTH])
def test_the_matmul_step_is_sdpas_attention(width):
    q, k, v = qkv(width)
    mask = holed_mask(width)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                              enable_gqa=True).transpose(1, 2)  # [B, T, H, D]
    out, weights = grouped_verify_matmul(Module(), q, k, v, mask, scaling=0.3)
    assert weights is None
    assert out.shape == (2, width, HEADS, DIM)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    out_additive, _ = grouped_verify_matmul(Module(), q, k, v, additive, scaling=0.3)
    torch.testing.assert_close(out_additive, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width, masked", [(DECODE_WIDTH + 1, True), (4, False), (1, False)])
def test_prompts_and_unmasked_blocks_go_through_sdpa(width, masked):
    """Wider than DECODE_WIDTH (a prompt), or no mask (for several queries, SDPA's causal from
    the first key): the result is SDPA's own, bit for bit."""
    q, k, v = qkv(width, dtype=torch.float32)
    mask = holed_mask(width) if masked else None
    expected, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.25)
    out, _ = grouped_verify_matmul(Module(), q, k, v, mask, scaling=0.25)
    assert torch.equal(out, expected)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=72, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def test_the_static_runner_attends_through_it_until_closed(monkeypatch):
    """Its 1- and 4-token steps run the matmul step (the cache's mask reaches it) and give the
    logits SDPA gives on the dynamic cache, and close() gives the model its own attention
    back."""
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    prompt, chain = list(range(3, 40)), [7, 8, 9, 10]
    dynamic = TargetRunner(model, [0, 2])
    cache = dynamic.new_cache(64)
    dynamic.forward(prompt, cache)
    expected, expected_aux = dynamic.forward(chain, cache)  # [T, V], [1, T, K*H]
    dynamic.close()

    static = StaticTargetRunner(model, [0, 2], step_widths=(1, 4))
    assert model.config._attn_implementation == VERIFY_ATTENTION[0]
    widths = []
    step = grouped_attention._verify_matmul_step

    def counted(grouped, *args):
        widths.append(grouped.shape[2] // (HEADS // KV_HEADS))
        return step(grouped, *args)

    monkeypatch.setattr(grouped_attention, "_verify_matmul_step", counted)
    cache = static.new_cache(64)
    static.forward(prompt, cache)
    assert widths == []  # the prompt: SDPA
    logits, aux = static.forward(chain, cache)
    static.drop_last(cache, 3)
    one, _ = static.forward(chain[1:2], cache)
    assert widths == [4] * 3 + [1] * 3  # a step of each width, in each of the 3 layers
    torch.testing.assert_close(one, expected[1:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, expected_aux, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    static.close()
    assert model.config._attn_implementation == "sdpa"


def test_a_query_that_sees_no_key_attends_to_nothing_as_in_sdpa():
    """A batch's left-padded short prompt: its padding's queries see no key. Their output is
    zeros, as SDPA's, not NaN, which the cache would carry into the row's later steps."""
    q, k, v = qkv(4)
    mask = holed_mask(4)
    mask[1, :, :2] = False  # row 1's first two queries: padding
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=True).transpose(1, 2)  # [B, T, H, D]
    out, _ = grouped_verify_matmul(Module(), q, k, v, mask)
    assert not out.isnan().any()
    assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2]))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
