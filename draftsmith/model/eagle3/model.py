"""The EAGLE-3 drafter, as SGLang's `LlamaForCausalLMEagle3` runs it (docs/drafter-kinds.md),
with EAGLE-3.1's norms as options (their names are speculators' and vLLM's).

    h      = fc(cat(aux_1, aux_2, aux_3))                        # [B, T, H]  step 0 only
    x      = cat(input_layernorm(embed(tok)), hidden_norm(h))    # [B, T, 2H]
    h'     = h + o_proj(attn(q, k, v of x))                      # residual is h before its norm
    out    = h' + mlp(post_attention_layernorm(h'))              # [B, T, H]  -> next step's h
    logits = lm_head(norm(out))                                  # [B, T, draft_vocab]

EAGLE-3.1 (speculators 0.9.0 trains with the first, second and fourth on; vLLM 0.32 reads all
four, SGLang 0.5.23 all but norm_before_residual):
- norm_before_fc: fc's input is input_norm(cat(aux_1, aux_2, aux_3)), one RMSNorm over [K*Ht];
- fc_norm: each aux state through its own RMSNorm (fc_norm.i) before the concatenation (after
  input_norm when both are on, in the order both engines apply them);
- norm_before_residual: the residual is hidden_norm(h), not h;
- norm_output: the next step's h is norm(out), not out (logits are lm_head(norm(out)) either way).

Anchor indexing for test-time training (TTT): at step j, anchor t sits at position t + j, reads
the embedding of token t+j+1 and predicts token t+j+2; its hidden input is step j-1's `out` at
the same anchor. It attends causally to the step-0 keys of its document and to its own keys of
steps 1..j (one diagonal per step), which is exactly what it sees when drafting a chain.

Three attention paths compute that mask: `sdpa` builds it densely ([T, (j+1)T] booleans, fine
on a CPU and for tests), `flex` describes it as a flex_attention block mask, so only the blocks
that hold allowed pairs are computed and no dense mask exists (compiled on CUDA), and the merged
paths (`cudnn`, `flash`; `reference` in float32 math for tests) run a dense causal kernel per
document and merge the diagonals in by log-sum-exp (`draftsmith/model/ttt_attention.py`).
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

from draftsmith.model import ttt_attention
from draftsmith.model.drafter import (
    BlockMask,
    TargetTiedDrafter,
    create_block_mask,
    flex_attention_fn,
)
from draftsmith.model.eagle3.options import NORM_OPTIONS
from draftsmith.model.shape import TargetTiedShape

MERGED_ATTENTION = tuple(ttt_attention.KERNELS)  # attention paths that merge per document


class Eagle3Config(TargetTiedShape):
    """Shape of the drafter. Attention and MLP sizes follow the target's unless set."""

    # EAGLE-3.1's norms (module docstring); all off is plain EAGLE-3.
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # Keys beyond this many positions back are not attended (speculators 0.9.0 trains its
    # drafters with a 2048 window; vLLM reads it from layer_types); None: no window.
    sliding_window: int | None = Field(None, ge=1)

    @property
    def norm_flags(self) -> dict[str, bool]:
        """The four EAGLE-3.1 options by name: what exported configs carry."""
        return {name: getattr(self, name) for name in NORM_OPTIONS}

    @classmethod
    def from_hf(cls, hf: dict, **rest) -> Eagle3Config:
        """The shape fields of a Hugging Face Llama-style config (a target's, or the one layer
        of an exported drafter); `rest` gives the EAGLE-3 fields."""
        return cls(**cls.layer_fields(hf), **rest)

    @classmethod
    def from_target(cls, target_config: dict, aux_layer_ids: list[int],
                    draft_vocab_size: int, **options) -> Eagle3Config:
        """A drafter for this target; options: EAGLE-3.1's norms (NORM_OPTIONS)."""
        return cls(**cls.target_fields(target_config, aux_layer_ids, draft_vocab_size),
                   **options)

    def hf_fields(self) -> dict:
        """The drafter's one decoder layer as Hugging Face Llama config fields (what exported
        configs carry, and what LlamaConfig is built from)."""
        return {
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
        }

    def llama_config(self) -> LlamaConfig:
        fields = {k: v for k, v in self.hf_fields().items() if k != "model_type"}
        return LlamaConfig(**{**fields, "rope_scaling": self.rope_scaling_copy()})


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads,
                                                  cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    @property
    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, past_kv, mask, embedding_qkv=None):
        """x [B, T, 2H] (both normed inputs, concatenated), or only the normed hidden [B, T, H]
        when embedding_qkv holds the embedding half of q, k and v already projected
        ([B, T, nh*d], [B, T, nkv*d] x 2). past_kv (k, v) [B, n_kv, S, d] or None; mask
        [B|1, 1, T, S+T] bool, a BlockMask, or the name of a merged path (then past_kv holds
        lists of the earlier steps' k and v, each [B, n_kv, T, d]). Returns the output
        [B, T, H] and this call's (k, v) [B, n_kv, T, d]."""
        B, T, _ = x.shape
        if embedding_qkv is None:
            q, k, v = (p(x) for p in self.projections)  # [B, T, nh*d], [B, T, nkv*d] x 2
        else:
            H = x.shape[-1]  # the hidden half of each weight's input columns
            q, k, v = (embedding_qkv[i] + F.linear(x, p.weight[:, H:])
                       for i, p in enumerate(self.projections))  # as above
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, d]
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(mask, str):
            past_k, past_v = past_kv if past_kv is not None else ([], [])
            y = merged_attention_of_row(q, [*past_k, k], [*past_v, v], mask)  # [B, nh, T, d]
            y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, nh*d]
            return self.o_proj(y), (k, v)
        keys = k if past_kv is None else torch.cat([past_kv[0], k], dim=2)  # [B, nkv, S+T, d]
        values = v if past_kv is None else torch.cat([past_kv[1], v], dim=2)  # [B, nkv, S+T, d]
        if isinstance(mask, BlockMask):
            y = flex_attention_fn()(q, keys, values, block_mask=mask,
                                    enable_gqa=self.n_heads != self.n_kv)  # [B, nh, T, d]
        else:
            y = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv
            )  # [B, nh, T, d]
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, nh*d]
        return self.o_proj(y), (k, v)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.llama_config())
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, past_kv=None, mask=None):
        normed = self.hidden_norm(hidden)  # [B, T, H]
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        attn, kv = self.self_attn(x, cos, sin, past_kv, mask)  # [B, T, H]
        return self._residual_and_mlp(normed if self.norm_before_residual else hidden, attn), kv

    def embedding_qkv(self, embeds):
        """The embedding half of q, k and v: input_layernorm(embeds) through the first H input
        columns of each weight. embeds [B, S, H] -> [B, S, nh*d], [B, S, nkv*d] x 2."""
        x = self.input_layernorm(embeds)  # [B, S, H]
        H = x.shape[-1]
        return tuple(F.linear(x, p.weight[:, :H]) for p in self.self_attn.projections)

    def forward_projected(self, embedding_qkv, hidden, cos, sin, past_kv=None, mask=None):
        """forward, with the embedding half of q, k and v given (embedding_qkv's output for
        these T positions): the sum of the two halves is the projection of the concatenation."""
        x = self.hidden_norm(hidden)  # [B, T, H]
        attn, kv = self.self_attn(x, cos, sin, past_kv, mask, embedding_qkv)  # [B, T, H]
        return self._residual_and_mlp(x if self.norm_before_residual else hidden, attn), kv

    def _residual_and_mlp(self, hidden, attn):
        hidden = hidden + attn  # [B, T, H]
        return hidden + self.mlp(self.post_attention_layernorm(hidden))  # [B, T, H]


class Eagle3Drafter(TargetTiedDrafter):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        k = len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.input_norm = LlamaRMSNorm(k * cfg.target_hidden_size, eps=cfg.rms_norm_eps) \
            if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(
            LlamaRMSNorm(cfg.target_hidden_size, eps=cfg.rms_norm_eps) for _ in range(k)) \
            if cfg.fc_norm else None
        self.fc = nn.Linear(k * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())
        self.register_vocab_map(cfg)
        self.reset_parameters()

    def layer_and_norm(self, embedding_qkv, offset, hidden, cos, sin, past_kv=None, mask=None):
        """The decoder layer at TTT step `offset`, then the final norm: the next step's hidden
        [B, T, H] (out, or norm(out) with norm_output), norm(out) [B, T, H] (lm_head's input)
        and this step's (k, v). embedding_qkv: the row's embedding projections
        ([B, T+steps-1, .] each, `embedding_projections`), of which this step reads positions
        offset..offset+T-1."""
        T = hidden.shape[1]
        window = tuple(p[:, offset:offset + T] for p in embedding_qkv)  # [B, T, .] each
        out, kv = self.midlayer.forward_projected(window, hidden, cos, sin, past_kv,
                                                  mask)  # [B, T, H]
        normed = self.norm(out)  # [B, T, H]
        return (normed if self.config.norm_output else out), normed, kv

    def embedding_projections(self, input_ids, steps: int, dtype: torch.dtype):
        """The embedding half of q, k and v for every TTT step of a row, computed once.

        Step j reads the embedding of token t+j+1 at anchor t: window j of the row's tokens
        shifted by one and padded by `steps - 1`. input_layernorm and the projections act on
        each position alone, so step j's embedding projections are window j of one
        projection: one GEMM a row instead of one a step, forward and backward (autograd
        sums the steps' gradients over the windows first). input_ids [B, T] ->
        [B, T+steps-1, nh*d], [B, T+steps-1, nkv*d] x 2."""
        tokens = F.pad(input_ids[:, 1:], (0, steps))  # [B, T+steps-1]: token t+1 at t, then 0
        embeds = self.embed_tokens(tokens).to(dtype)  # [B, T+steps-1, H]
        fn = self.__dict__.get("_compiled_embedding_qkv", self.midlayer.embedding_qkv)
        return fn(embeds)

    @property
    def layer_fn(self):
        compiled = self.__dict__.get("_compiled_layer")
        return self.layer_and_norm if compiled is None else compiled

    def compile_layer(self, enabled: bool = True) -> None:
        """torch.compile the decoder layer and the final norm (fuses norms, RoPE, SiLU-mul and
        flex attention; an eager RMSNorm alone is eight passes over [T, H] forward and back).
        Kept outside the module tree so state_dict names stay SGLang's."""
        if enabled:
            # One graph per TTT step (the keys grow by T each step), for training and for
            # no-grad validation: 2 x 16 steps at most, above dynamo's default limit of 8.
            import torch._dynamo

            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config,
                                                                        name)))
            self.__dict__["_compiled_layer"] = torch.compile(self.layer_and_norm, dynamic=False)
            self.__dict__["_compiled_embedding_qkv"] = torch.compile(
                self.midlayer.embedding_qkv, dynamic=False)
        else:
            self.__dict__.pop("_compiled_layer", None)
            self.__dict__.pop("_compiled_embedding_qkv", None)

    @property
    def compiled(self) -> bool:
        return "_compiled_layer" in self.__dict__

    def rope(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary(hidden, position_ids)  # cos, sin [B, T, d]

    def step(self, input_ids, hidden, position_ids, past_kv=None, mask=None):
        """One drafting step. input_ids [B, T]; hidden [B, T, H] (fc output at step 0, the
        previous step's output after); position_ids [B, T]. Returns the next step's hidden
        [B, T, H] (out before the final norm, or after it with norm_output), logits [B, T, D]
        and this step's (k, v)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rope(hidden, position_ids)
        out, kv = self.midlayer(embeds, hidden, cos, sin, past_kv, mask)  # [B, T, H]
        normed = self.norm(out)  # [B, T, H]
        logits = self.lm_head(normed)  # [B, T, D]
        return (normed if self.config.norm_output else out), logits, kv

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux states, after EAGLE-3.1's input norms when on."""
        aux = aux.to(self.fc.weight.dtype)  # [B, T, K*Ht]
        if self.input_norm is not None:
            aux = self.input_norm(aux)  # [B, T, K*Ht]
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)  # K x [B, T, Ht]
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)],
                            dim=-1)  # [B, T, K*Ht]
        return self.fc(aux)  # [B, T, H]

    def forward_ttt_hidden(self, input_ids, aux, position_ids, document_ids, steps: int,
                           attention: str = "sdpa", documents: ttt_attention.Segments = ()
                           ) -> list[torch.Tensor]:
        """Unrolled TTT over packed rows, up to lm_head's input: norm(out) per step, each
        [B, T, H], where step j at anchor t goes on to predict token t+j+2. input_ids,
        position_ids, document_ids [B, T] (position ids restart at 0 in each document); aux
        [B, T, K*Ht]. documents: the row's (start, end) runs of document ids, known on the
        host (merged paths; read from document_ids, with a device sync, when not given). The
        trainer applies lm_head fused with the loss, so [T, draft_vocab] logits never
        persist."""
        merged = attention in MERGED_ATTENTION
        window = self.config.sliding_window
        if merged and window is not None:
            raise ValueError(f"attention {attention!r} runs a dense causal kernel per document "
                             f"and cannot apply this drafter's sliding window ({window}); use "
                             "train.attention=auto, flex or sdpa")
        if merged:
            if document_ids.shape[0] != 1:
                raise ValueError(f"attention {attention!r} takes one packed row at a time, "
                                 f"not a batch of {document_ids.shape[0]}")
            documents = documents or ttt_attention.document_segments(document_ids[0].cpu())
            masks = [attention] * steps
        elif attention == "flex":
            masks = ttt_block_masks(document_ids, steps, window)
        else:
            masks = ttt_masks(document_ids, steps, window)
        hidden = self.project_aux(aux)  # [B, T, H]
        embedding_qkv = self.embedding_projections(input_ids, steps, hidden.dtype)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        normed = []
        with ttt_attention.row_documents(documents):
            for j in range(steps):
                past = None
                if keys:
                    past = (list(keys), list(values)) if merged else \
                        (torch.cat(keys, dim=2), torch.cat(values, dim=2))  # [B, nkv, jT, d]
                cos, sin = self.rope(hidden, position_ids + j)
                hidden, normed_j, (k, v) = self.layer_fn(embedding_qkv, j, hidden, cos, sin,
                                                         past, masks[j])  # [B, T, H] each
                keys.append(k)
                values.append(v)
                normed.append(normed_j)
        return normed


@torch.compiler.disable
def merged_attention_of_row(q, keys, values, kernel: str):
    """The merged TTT attention over the documents of the row being run, outside the compiled
    layer: the documents change with every row, and a compiled graph would be rebuilt for
    each layout."""
    return ttt_attention.merged_ttt_attention(q, keys, values, ttt_attention.current_documents(),
                                              kernel)


def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """Along dim 1 of x [B, T, ...]: x[:, t + n] at index t; positions past the end get `fill`."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_masks(document_ids: torch.Tensor, steps: int,
              window: int | None = None) -> list[torch.Tensor]:
    """Boolean attention masks for TTT, one per step: [B, 1, T, (j+1)*T] for step j.

    Step-0 keys: causal and within the same document (and, with a sliding window, fewer than
    `window` positions back). Keys of steps 1..j: only the query's own anchor (a diagonal).
    True = may attend.
    """
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device)
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    back = idx[None, :, None] - idx[None, None, :]  # [1, T, T] query minus key position
    causal = same_doc & (back >= 0) & (back < (window or T + 1))  # [B, T, T]
    diagonal = torch.eye(T, dtype=torch.bool, device=document_ids.device).expand(B, T, T)
    blocks = [causal]
    masks = []
    for j in range(steps):
        if j:
            blocks.append(diagonal)
        masks.append(torch.cat(blocks, dim=-1)[:, None])  # [B, 1, T, (j+1)T]
    return masks


def ttt_mask_mod(document_ids: torch.Tensor, T: int, window: int | None = None):
    """The TTT mask as a flex mask_mod over keys of steps 0..j laid end to end ([(j+1)T]):
    step-0 keys causal within the document (and within the sliding window), a later step's
    key only at the query's own anchor. Padding tokens carry document id -1 and see only each
    other."""
    reach = window or T + 1

    def mask_mod(b, h, q_idx, kv_idx):
        kv_step = kv_idx // T
        kv_pos = kv_idx - kv_step * T
        same_doc = document_ids[b, q_idx] == document_ids[b, kv_pos]
        causal = (kv_step == 0) & (kv_pos <= q_idx) & (q_idx - kv_pos < reach) & same_doc
        return causal | ((kv_step > 0) & (kv_pos == q_idx))

    return mask_mod


def ttt_block_masks(document_ids: torch.Tensor, steps: int,
                    window: int | None = None) -> list[BlockMask]:
    """flex_attention block masks, one per TTT step (the same mask as ttt_masks, never dense on
    CUDA: create_block_mask is compiled there)."""
    B, T = document_ids.shape
    mask_mod = ttt_mask_mod(document_ids, T, window)
    compiled = document_ids.is_cuda
    return [create_block_mask(mask_mod, B, None, T, (j + 1) * T, device=document_ids.device,
                              _compile=compiled) for j in range(steps)]
