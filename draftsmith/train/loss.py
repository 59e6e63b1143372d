"""TTT loss without full-vocab tensors: chunked target head, lm_head fused with the soft CE.

Targets: p = softmax(lm_head_target(final_norm(h))) restricted to the draft vocab and
renormalised, which is softmax over the draft vocab's logits alone, so only the target head's
rows for the draft vocab enter p. Whether the target's argmax lies in the draft vocab needs the
other rows too, but only their maximum: max(draft logits) >= max(other logits). Both come from
the head applied to a chunk of positions at a time, so [T, V] logits never exist; p is computed
once per row and shifted for each TTT step.

The drafter side (`fused_linear_soft_ce`) computes lm_head, the soft cross-entropy and its
gradients chunk by chunk in the forward pass and keeps only the gradients, so [T, draft_vocab]
logits of a step do not wait in memory for the backward pass.
"""

from __future__ import annotations

import torch

from draftsmith.compiling import compiled_once


class TargetHead:
    """The frozen target head, split into the draft vocab's rows and the rest."""

    def __init__(self, head: torch.Tensor, draft_ids: torch.Tensor, dtype: torch.dtype,
                 device: str | torch.device, chunk_tokens: int = 2048):
        head = head.detach()
        draft_ids = draft_ids.to(head.device)
        others = torch.ones(head.shape[0], dtype=torch.bool, device=head.device)  # [V]
        others[draft_ids] = False
        self.draft_rows = head[draft_ids].to(device, dtype)  # [D, H]
        self.chunk_tokens = chunk_tokens
        # Target id -> draft id, -1 outside the draft vocab: maps a stored target argmax.
        self.to_draft = torch.full((head.shape[0],), -1, dtype=torch.int64)  # [V]
        self.to_draft[draft_ids.cpu()] = torch.arange(draft_ids.numel())
        self.to_draft = self.to_draft.to(device)
        # Needed only for rows whose store holds no target argmax: kept on the host until then.
        # (In the compute dtype: 0.8 GB for an 8B-shaped target in bf16, 1.6 GB in float32.)
        self._other_rows_host, self._other_rows = head[others].to(dtype), None  # [V - D, H]
        self._device = device

    @property
    def other_rows(self) -> torch.Tensor:
        if self._other_rows is None:
            self._other_rows = self._other_rows_host.to(self._device)
        return self._other_rows

    @torch.no_grad()
    def targets(self, final: torch.Tensor, target_argmax: torch.Tensor | None = None,
                compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """final [T, H] (after the target's final norm) -> p [T, D] (in the head's dtype: bf16
        halves the largest tensor of the step; the loss renormalises each row in float32) and
        the target's argmax as a draft id [T] (int64), -1 where it is outside the draft vocab.

        target_argmax [T] (the target's full-vocab argmax, stored by extraction) spares the
        matmul over the V - D other rows; without it their maximum decides whether the argmax
        lies in the draft vocab: max(draft logits) >= max(other logits). compiled: fuse the
        softmax with torch.compile (CUDA)."""
        final = final.to(self.draft_rows.device, self.draft_rows.dtype)  # [T, H]
        draft_probs = _maybe_compiled(_draft_probs, compiled)
        probs, argmax = [], []
        for part in final.split(self.chunk_tokens):
            logits = part @ self.draft_rows.T  # [c, D]
            if target_argmax is None:
                best, best_id = logits.float().max(-1)  # [c]
                if self.other_rows.shape[0]:
                    other_best = (part @ self.other_rows.T).amax(-1).float()  # [c]
                    best_id = torch.where(best >= other_best, best_id, -1)  # [c]
                argmax.append(best_id)
            probs.append(draft_probs(logits, self.draft_rows.dtype))  # [c, D]
        if target_argmax is not None:
            argmax = [self.to_draft[target_argmax.to(self.to_draft.device).long()]]  # [T]
        return torch.cat(probs), torch.cat(argmax)  # [T, D], [T]


def _chunk_ce(logits: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor,
              grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: logits [c, D], probs [c, D], weights [c] -> CE [c] (float32), argmax [c]
    and d(sum w*CE)/d(logits) [c, D] in grad_dtype."""
    logits = logits.float()  # [c, D]
    p = probs.float()  # [c, D]
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)  # exact sum 1 after bf16 storage
    lse = logits.logsumexp(-1, keepdim=True)  # [c, 1]
    ce = lse[:, 0] - (p * logits).sum(-1)  # [c]  (sum p = 1)
    grad = (logits - lse).exp_().sub_(p).mul_(weights[:, None])  # [c, D]
    return ce, logits.argmax(-1), grad.to(grad_dtype)


def _maybe_compiled(fn, compiled: bool):
    """fn, or its torch.compile'd form: the float32 passes over a [c, D] chunk (about ten in
    _chunk_ce) fused into one or two kernels; the matmuls around them stay cuBLAS calls."""
    return compiled_once(fn) if compiled else fn


def _draft_probs(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return logits.float().softmax(-1).to(dtype)  # [c, D]


class _LinearSoftCE(torch.autograd.Function):
    """sum_t w_t * CE(p_t, softmax(x_t W^T)) with gradients computed in the forward pass."""

    @staticmethod
    def forward(ctx, x, weight, probs, weights, chunk, compiled):
        # x [T, H]; weight [D, H]; probs [T, D]; weights [T] float32
        chunk_ce = _maybe_compiled(_chunk_ce, compiled)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.empty_like(x) if need_x else None  # [T, H]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None  # [D, H]
        ce_all, argmax_all = [], []
        for start in range(0, x.shape[0], chunk):
            xc = x[start:start + chunk]  # [c, H]
            ce, argmax, grad_logits = chunk_ce(xc @ weight.T, probs[start:start + chunk],
                                               weights[start:start + chunk], x.dtype)
            ce_all.append(ce)  # [c]
            argmax_all.append(argmax)  # [c]
            if grad_x is not None:
                grad_x[start:start + chunk] = grad_logits @ weight  # [c, H]
            if grad_w is not None:
                grad_w.add_(grad_logits.T @ xc)  # [D, H] accumulated in float32
        ce = torch.cat(ce_all)  # [T]
        argmax = torch.cat(argmax_all)  # [T]
        loss = (ce * weights).sum()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ce, argmax)  # metrics: never part of a graph
        return loss, ce, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_argmax):
        grad_x, grad_w = ctx.saved_tensors
        gx = grad_x * grad_loss.to(grad_x.dtype) if grad_x is not None else None
        gw = (grad_w * grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gx, gw, None, None, None, None


def fused_linear_soft_ce(x: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor,
                         weights: torch.Tensor, chunk: int = 2048, compiled: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted soft cross-entropy of lm_head(x) against probs, chunk by chunk.

    x [T, H] (the drafter's norm output), weight [D, H] (lm_head), probs [T, D], weights [T]
    (0 where a position carries no loss). Returns the weighted loss (scalar, differentiable
    into x and weight), the per-position CE [T] and the drafter's argmax [T] (no grad).
    compiled: fuse the per-chunk float32 math with torch.compile (CUDA)."""
    return _LinearSoftCE.apply(x, weight, probs, weights.float(), chunk, compiled)


def noisy_aux(aux: torch.Tensor, std: float, seed: int, device) -> torch.Tensor:
    """aux [T, K*Ht] plus Gaussian noise of `std` times each position's RMS, seeded (train
    rows only: std 0 returns aux as it is)."""
    if std <= 0:
        return aux
    g = torch.Generator(device=device).manual_seed(seed)
    rms = aux.float().pow(2).mean(-1, keepdim=True).sqrt()  # [T, 1]
    noise = torch.randn(aux.shape, generator=g, device=device)  # [T, K*Ht]
    return (aux.float() + std * rms * noise).to(aux.dtype)  # [T, K*Ht]
