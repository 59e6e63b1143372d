"""The DFlash drafter: block diffusion in one forward pass, as vLLM 0.32 runs it
(`model_executor/models/qwen3_dflash.py`, `DFlashQwen3ForCausalLM`) and SGLang 0.5.23 loads it
(`srt/models/dflash.py`).

The target's aux states become a context every layer attends to; the block is the last known
token followed by mask tokens, and each mask position predicts its own token:

    ctx    = hidden_norm(fc(cat(aux_1, ..., aux_K)))             # [C, H]  positions 0..n-1
    x      = embed([x_n, MASK, ..., MASK])                       # [Q, H]  positions n..n+Q-1
    per layer (Qwen3-shaped: RMSNorm on each head's q and k):
      q    = rope(q_norm(q_proj(input_layernorm(x))))            # [Q, nh, d]
      k, v = rope(k_norm(k_proj(.))), v_proj(.) of ctx and of input_layernorm(x)  # [C+Q, nkv, d]
      x    = x + o_proj(attn(q, k, v))                           # the block sees all of ctx and
      x    = x + mlp(post_attention_layernorm(x))                #   itself (non-causal by default)
    logits = lm_head(norm(x))[1:]                                # [Q-1, draft_vocab] drafts 1..Q-1

The context's keys and values skip input_layernorm (vLLM projects hidden_norm(fc(aux)) once per
layer and caches it). The embedding is the target's, frozen (vLLM and SGLang share it); the
mask token is a target token id. Training (speculators' anchored blocks) runs many blocks of one
packed row at once: block j starts at anchor a_j, sees the context of its document before a_j
and its own block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from draftsmith.model.drafter import (
    BlockMask,
    TargetTiedDrafter,
    create_block_mask,
    flex_attention_fn,
)
from draftsmith.model.shape import TargetTiedShape


class DFlashConfig(TargetTiedShape):
    """Shape of the DFlash drafter. Attention and MLP sizes follow the target's."""

    num_hidden_layers: int = Field(ge=1)  # the drafter's own decoder layers
    block_size: int = Field(ge=2)  # trained block: the known token + block_size - 1 masks
    mask_token_id: int = Field(ge=0)
    causal: bool = False  # within the block; the context is always fully visible

    @classmethod
    def from_target(cls, target_config: dict, aux_layer_ids: list[int], draft_vocab_size: int,
                    **options) -> DFlashConfig:
        """A drafter for this target; options: num_hidden_layers, block_size, mask_token_id,
        causal."""
        return cls(**cls.target_fields(target_config, aux_layer_ids, draft_vocab_size),
                   **options)

    def llama_config(self) -> LlamaConfig:
        """The sizes transformers' Llama parts (MLP, RoPE) are built from."""
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling_copy(), hidden_act=self.hidden_act,
                           max_position_embeddings=self.max_position_embeddings,
                           vocab_size=self.vocab_size)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads,
                                                  cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin):
        """x [B, N, H] -> k, v [B, nkv, N, d], k normed per head and rotated."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, N, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.n_kv, self.head_dim).transpose(1, 2)  # [B, nkv, N, d]
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)  # [B, nkv, N, d]
        return k, v

    def forward(self, x, context_kv, cos, sin, mask):
        """x [B, Q, H] (the block, after input_layernorm); context_kv: keys_values of the
        context ([B, nkv, C, d] each); cos, sin [B, Q, d] at the block's positions; mask
        [B|1, 1, Q, C+Q] bool (True: may attend), a BlockMask, or None (all visible)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        k, v = self.keys_values(x, cos, sin)  # [B, nkv, Q, d] each
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)  # [B, nh, Q, d]
        keys = torch.cat([context_kv[0], k], dim=2)  # [B, nkv, C+Q, d]
        values = torch.cat([context_kv[1], v], dim=2)  # [B, nkv, C+Q, d]
        if isinstance(mask, BlockMask):
            y = flex_attention_fn()(q, keys, values, block_mask=mask,
                                    enable_gqa=self.n_heads != self.n_kv)  # [B, nh, Q, d]
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                               enable_gqa=self.n_heads != self.n_kv)
        y = y.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim)  # [B, Q, nh*d]
        return self.o_proj(y)  # [B, Q, H]


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.llama_config())

    def forward(self, x, context_kv, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context_kv, cos, sin, mask)  # [B, Q, H]
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, Q, H]

    def context_kv(self, context, cos, sin):
        """This layer's keys and values of the context (no input_layernorm: vLLM projects
        hidden_norm(fc(aux)) as it is). A method of the layer, so that FSDP gathers its
        parameters for it (`register_fsdp_forward_method`)."""
        return self.self_attn.keys_values(context, cos, sin)


class DFlashDrafter(TargetTiedDrafter):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        k = len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(k * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())
        self.register_vocab_map(cfg)
        self.reset_parameters()

    def compile_layer(self, enabled: bool = True) -> None:
        """The trainer's switch for compiled paths: here the loss's softmax and fused
        cross-entropy (the layers run eagerly; flex attention is compiled on CUDA)."""
        self.__dict__["_compiled"] = enabled

    @property
    def compiled(self) -> bool:
        return self.__dict__.get("_compiled", False)

    # ------------------------------------------------------------------ the parts

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [B, C, K*Ht] as the context every layer attends to."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))  # [B, C, H]

    def rope(self, like: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary(like, position_ids)  # cos, sin [B, N, d]

    def context_kv(self, context: torch.Tensor, position_ids: torch.Tensor) -> list:
        """Each layer's keys and values of the context [B, C, H] at position_ids [B, C]:
        [(k, v) [B, nkv, C, d]] per layer (what vLLM writes into the draft's KV cache)."""
        cos, sin = self.rope(context, position_ids)
        return [layer.context_kv(context, cos, sin) for layer in self.layers]

    def block_hidden(self, block_ids: torch.Tensor, position_ids: torch.Tensor,
                     context_kv: list, mask) -> torch.Tensor:
        """The block through every layer and the final norm: block_ids, position_ids [B, Q];
        context_kv from `context_kv`; mask as DFlashAttention takes it. -> [B, Q, H]."""
        dtype = self.fc.weight.dtype
        x = self.embed_tokens(block_ids).to(dtype)  # [B, Q, H]
        cos, sin = self.rope(x, position_ids)
        for layer, kv in zip(self.layers, context_kv, strict=True):
            x = layer(x, kv, cos, sin, mask)  # [B, Q, H]
        return self.norm(x)  # [B, Q, H]

    def block_ids(self, known: torch.Tensor, length: int) -> torch.Tensor:
        """Blocks [the known token, mask, ..., mask]: known [N] -> [N, length]."""
        ids = torch.full((known.numel(), length), self.config.mask_token_id,
                         dtype=torch.long, device=known.device)  # [N, length]
        ids[:, 0] = known
        return ids

    def within_block(self, length: int, device) -> torch.Tensor:
        """Which block positions see which: all of them, or causally. [length, length]."""
        full = torch.ones(length, length, dtype=torch.bool, device=device)
        return full.tril() if self.config.causal else full

    # ------------------------------------------------------------------ training

    def row_context_kv(self, aux: torch.Tensor, position_ids: torch.Tensor) -> list:
        """A packed row's context keys and values per layer: aux [T, K*Ht], position_ids
        [T] -> [(k, v) [1, nkv, T, d]]."""
        return self.context_kv(self.context(aux[None]), position_ids[None])

    def forward_blocks(self, input_ids, aux, position_ids, document_ids, anchors,
                       attention: str = "sdpa", kv: list | None = None) -> torch.Tensor:
        """Blocks at `anchors` of one packed row, up to lm_head's input: input_ids,
        position_ids, document_ids [T]; aux [T, K*Ht]; anchors [A] (positions whose token is
        known; a block's position k predicts token anchor + k). kv: the row's context keys
        and values (`row_context_kv`), when several calls share them. Returns norm(x)
        [A, B, H] for the trained block size B; the trainer applies lm_head fused with the
        loss."""
        B = self.config.block_size
        T = input_ids.shape[0]
        if kv is None:
            kv = self.row_context_kv(aux, position_ids)
        block_ids = self.block_ids(input_ids[anchors], B).view(1, -1)  # [1, A*B]
        offsets = torch.arange(B, device=anchors.device)
        positions = (position_ids[anchors][:, None] + offsets).view(1, -1)  # [1, A*B]
        if attention == "flex":
            mask = anchored_block_mask(document_ids, anchors, B, self.config.causal, T)
        elif attention == "sdpa":
            mask = anchored_dense_mask(document_ids, anchors, B, self.config.causal)
        else:
            raise ValueError(f"the DFlash drafter trains with attention sdpa or flex (auto), not "
                             f"{attention!r}: set train.attention=auto")
        hidden = self.block_hidden(block_ids, positions, kv, mask)  # [1, A*B, H]
        return hidden.view(anchors.numel(), B, hidden.shape[-1])  # [A, B, H]


def anchored_dense_mask(document_ids: torch.Tensor, anchors: torch.Tensor, block: int,
                        causal: bool) -> torch.Tensor:
    """[1, 1, A*B, T + A*B] bool: block j sees the row's positions of its anchor's document
    before the anchor, and its own block (causally or not)."""
    T, A = document_ids.shape[0], anchors.numel()
    doc = document_ids[anchors]  # [A]
    keys = torch.arange(T, device=anchors.device)
    context = (document_ids[None, :] == doc[:, None]) & (keys[None, :] < anchors[:, None])
    context = context & (doc[:, None] != -1)  # [A, T]
    within = torch.ones(block, block, dtype=torch.bool, device=anchors.device)
    within = within.tril() if causal else within  # [B, B]
    own = torch.block_diag(*[within] * A) if A else within[:0, :0]  # [A*B, A*B]
    context = context.repeat_interleave(block, dim=0)  # [A*B, T]
    return torch.cat([context, own], dim=1)[None, None]  # [1, 1, A*B, T+A*B]


def anchored_mask_mod(document_ids: torch.Tensor, anchors: torch.Tensor, block: int,
                      causal: bool, T: int):
    """The same mask as anchored_dense_mask, as a flex mask_mod over [A*B] queries and
    [T + A*B] keys."""
    query_anchor = anchors.repeat_interleave(block)  # [A*B]

    def mask_mod(b, h, q_idx, kv_idx):
        anchor = query_anchor[q_idx]
        doc = document_ids[anchor]
        base = torch.clamp(kv_idx, max=T - 1)
        context = (kv_idx < T) & (document_ids[base] == doc) & (base < anchor) & (doc != -1)
        own = (kv_idx >= T) & ((kv_idx - T) // block == q_idx // block)
        if causal:
            own = own & (kv_idx - T <= q_idx)
        return context | own

    return mask_mod


def anchored_block_mask(document_ids, anchors, block: int, causal: bool, T: int) -> BlockMask:
    """flex_attention's block mask of anchored_mask_mod (compiled on CUDA, never dense)."""
    Q = anchors.numel() * block
    return create_block_mask(anchored_mask_mod(document_ids, anchors, block, causal, T), 1, None,
                             Q, T + Q, device=document_ids.device,
                             _compile=document_ids.is_cuda)
