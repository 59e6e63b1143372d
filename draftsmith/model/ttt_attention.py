"""TTT attention from a dense causal kernel per document plus the diagonals, merged exactly.

At TTT step j a query attends causally to the step-0 keys of its document and to its own keys
of steps 1..j (`draftsmith/model/eagle3.py`). flex_attention computes that as one block-sparse
kernel. Here the causal part runs on a dense attention kernel (cuDNN's, FA3-class on Hopper),
the j diagonal keys are j dot products per query, and the two parts are merged through their
log-sum-exps, as ring attention merges the chunks of a sequence. The backward pass hands the
dense kernel the merged output and log-sum-exp: with them its gradients are exactly the causal
part's share of the merged attention's.

Documents are the runs of equal document id in a packed row (padding, id -1, is one more run:
flex lets padding see only padding, causally). They are read on the host, from the row before
it goes to the device, so that no step waits for the GPU.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from draftsmith.compiling import compiled_once

Segments = tuple[tuple[int, int], ...]  # (start, end) of each document of the row

_ROW = threading.local()


@contextlib.contextmanager
def row_documents(documents: Segments):
    """The documents of the row whose TTT steps run inside: the attention reads them here,
    outside the compiled decoder layer, which never sees them (a compiled graph would be
    specialised on each row's layout)."""
    previous = getattr(_ROW, "documents", None)
    _ROW.documents = documents
    try:
        yield
    finally:
        _ROW.documents = previous


def current_documents() -> Segments:
    documents = getattr(_ROW, "documents", None)
    if not documents:
        raise RuntimeError("merged TTT attention outside Eagle3Drafter.forward_ttt_hidden: "
                           "no row documents set (use row_documents)")
    return documents


def document_segments(document_ids: torch.Tensor) -> Segments:
    """Runs of equal id in document_ids [T] (a host tensor): ((start, end), ...)."""
    ids = document_ids.reshape(-1).tolist()
    bounds = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
    return tuple(zip(bounds[:-1], bounds[1:], strict=True))


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, n_kv, T, d] -> [B, heads, T, d]: query head h reads kv head h // (heads / n_kv)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def reduce_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of expand_heads: [B, heads, T, d] -> [B, kv_heads, T, d]."""
    B, H, T, d = x.shape
    return x.view(B, kv_heads, H // kv_heads, T, d).sum(2)


class ReferenceCausal:
    """Causal attention within each document in float32 math, any device: the contract the GPU
    kernels keep (forward returns the log-sum-exp; backward takes an output and log-sum-exp,
    which may be the merged ones), checked against SDPA in the tests."""

    name = "reference"

    def forward(self, q, k, v, segments: Segments, scale: float):
        out = torch.empty_like(q)  # [B, nh, T, d]
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)  # [B, nh, T]
        for a, b in segments:
            s = self._scores(q[:, :, a:b], k[:, :, a:b], scale)  # [B, nh, n, n]
            lse[:, :, a:b] = s.logsumexp(-1)
            out[:, :, a:b] = (s.softmax(-1) @ expand_heads(v[:, :, a:b].float(), q.shape[1])
                              ).to(q.dtype)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, segments: Segments, scale: float, saved):
        heads, kv_heads = q.shape[1], k.shape[1]
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        for a, b in segments:
            do = dout[:, :, a:b].float()  # [B, nh, n, d]
            p = (self._scores(q[:, :, a:b], k[:, :, a:b], scale)
                 - lse[:, :, a:b, None]).exp()  # [B, nh, n, n]
            dv[:, :, a:b] = reduce_heads(p.transpose(-1, -2) @ do, kv_heads)
            dp = do @ expand_heads(v[:, :, a:b].float(), heads).transpose(-1, -2)  # [B,nh,n,n]
            delta = (do * out[:, :, a:b].float()).sum(-1, keepdim=True)  # [B, nh, n, 1]
            ds = p * (dp - delta) * scale  # [B, nh, n, n]
            dq[:, :, a:b] = ds @ expand_heads(k[:, :, a:b].float(), heads)
            dk[:, :, a:b] = reduce_heads(ds.transpose(-1, -2) @ q[:, :, a:b].float(), kv_heads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def _scores(q, k, scale):
        s = q.float() @ expand_heads(k.float(), q.shape[1]).transpose(-1, -2) * scale
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return s.masked_fill(~causal, float("-inf"))  # [B, nh, n, n]


class CudnnCausal:
    """cuDNN's fused attention (through torch's private SDPA ops, which return the log-sum-exp
    and take it back in the backward pass), one call per document. kv heads are expanded for
    the kernel when expand_kv (cuDNN builds without grouped-query support)."""

    name = "cudnn"

    def __init__(self, expand_kv: bool = False):
        self.expand_kv = expand_kv

    def _op(self, q, k, v, scale):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0,
                                                                  True, False, scale=scale)

    def _forward_one(self, q, k, v, scale):
        """One document; a kernel refusing grouped-query heads is retried (and from then on
        called) with the kv heads expanded."""
        try:
            return self._op(q, *self._kv(k, v, q.shape[1]), scale)
        except RuntimeError:
            if self.expand_kv:
                raise
            self.expand_kv = True
            return self._op(q, *self._kv(k, v, q.shape[1]), scale)

    def _kv(self, k, v, heads):
        if self.expand_kv:
            return expand_heads(k, heads).contiguous(), expand_heads(v, heads).contiguous()
        return k.contiguous(), v.contiguous()

    def forward(self, q, k, v, segments: Segments, scale: float):
        if q.dtype not in (torch.bfloat16, torch.float16):
            # cuDNN given float32 returns NaN without an error (seen on an H200).
            raise ValueError(f"the {self.name} kernel takes bfloat16 or float16, not {q.dtype}:"
                             f" train in bfloat16, or use the reference kernel for float32")
        out = torch.empty_like(q)  # [B, nh, T, d]
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)  # [B, nh, T]
        saved = []
        for a, b in segments:
            o, seg_lse, cq, ck, mq, mk, seed, offset, _ = self._forward_one(
                q[:, :, a:b].contiguous(), k[:, :, a:b], v[:, :, a:b], scale)
            out[:, :, a:b] = o
            lse[:, :, a:b] = seg_lse.reshape(lse[:, :, a:b].shape)
            saved.append((tuple(seg_lse.shape), cq, ck, mq, mk, seed, offset))
        return out, lse, saved

    def backward(self, dout, q, k, v, out, lse, segments: Segments, scale: float, saved):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for (a, b), (lse_shape, *aux) in zip(segments, saved, strict=True):
            ks, vs = self._kv(k[:, :, a:b], v[:, :, a:b], q.shape[1])
            g_q, g_k, g_v = self._backward_op(
                dout[:, :, a:b].contiguous(), q[:, :, a:b].contiguous(), ks, vs,
                out[:, :, a:b].contiguous(), lse[:, :, a:b].reshape(lse_shape).contiguous(),
                aux, scale)
            if self.expand_kv:
                g_k, g_v = reduce_heads(g_k.float(), k.shape[1]), reduce_heads(g_v.float(),
                                                                               k.shape[1])
            dq[:, :, a:b], dk[:, :, a:b], dv[:, :, a:b] = g_q, g_k, g_v
        return dq, dk, dv

    def _backward_op(self, dout, q, k, v, out, lse, aux, scale):
        cq, ck, mq, mk, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True, scale=scale)


class FlashCausal(CudnnCausal):
    """torch's FlashAttention-2 kernels (grouped-query native), one call per document."""

    name = "flash"

    def _op(self, q, k, v, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                                  scale=scale)

    def _backward_op(self, dout, q, k, v, out, lse, aux, scale):
        cq, ck, mq, mk, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale)


KERNELS = {"reference": ReferenceCausal, "cudnn": CudnnCausal, "flash": FlashCausal}
_KERNEL_INSTANCES: dict[str, object] = {}


def kernel_named(name: str):
    """One instance per kernel name, so what it learns (expand_kv) is learnt once."""
    if name not in _KERNEL_INSTANCES:
        _KERNEL_INSTANCES[name] = KERNELS[name]()
    return _KERNEL_INSTANCES[name]


def merge_diagonals(q, out_c, lse_c, ks, vs, scale: float):
    """Merge the diagonal keys of steps 1..j into the causal part: q, out_c [B, nh, T, d],
    lse_c [B, nh, T] float32, ks/vs j x [B, nkv, T, d]. Returns the merged output [B, nh, T, d]
    (q's dtype) and log-sum-exp [B, nh, T]. Query heads are grouped over their kv head
    ([B, nkv, g, T, ...]) so no kv tensor is expanded."""
    B, H, T, d = q.shape
    kv = ks[0].shape[1]
    qg = q.reshape(B, kv, H // kv, T, d).float()  # [B, nkv, g, T, d]
    scores = [(qg * k[:, :, None].float()).sum(-1) * scale for k in ks]  # j x [B, nkv, g, T]
    lse_c = lse_c.reshape(B, kv, H // kv, T)
    lse = torch.stack([lse_c, *scores]).logsumexp(0)  # [B, nkv, g, T]
    out = (lse_c - lse).exp()[..., None] * out_c.reshape(B, kv, H // kv, T, d).float()
    for score, v in zip(scores, vs, strict=True):
        out = out + (score - lse).exp()[..., None] * v[:, :, None].float()  # [B, nkv, g, T, d]
    return out.reshape(B, H, T, d).to(q.dtype), lse.reshape(B, H, T)


def merge_diagonals_backward(q, dout, out, lse, ks, vs, scale: float):
    """The diagonals' share of the gradients: dq [B, nh, T, d] float32 (added to the causal
    kernel's), and dk, dv of each diagonal step [B, nkv, T, d]."""
    B, H, T, d = q.shape
    kv = ks[0].shape[1]
    qg = q.reshape(B, kv, H // kv, T, d).float()  # [B, nkv, g, T, d]
    do = dout.reshape(B, kv, H // kv, T, d).float()  # [B, nkv, g, T, d]
    lse = lse.reshape(B, kv, H // kv, T)
    delta = (do * out.reshape(B, kv, H // kv, T, d).float()).sum(-1)  # [B, nkv, g, T]
    dq = torch.zeros_like(qg)  # [B, nkv, g, T, d]
    dks, dvs = [], []
    for k, v in zip(ks, vs, strict=True):
        kf, vf = k[:, :, None].float(), v[:, :, None].float()  # [B, nkv, 1, T, d]
        p = ((qg * kf).sum(-1) * scale - lse).exp()  # [B, nkv, g, T]
        dvs.append((p[..., None] * do).sum(2).to(v.dtype))  # [B, nkv, T, d]
        ds = p * ((do * vf).sum(-1) - delta) * scale  # [B, nkv, g, T]
        dq = dq + ds[..., None] * kf
        dks.append((ds[..., None] * qg).sum(2).to(k.dtype))  # [B, nkv, T, d]
    return dq.reshape(B, H, T, d), dks, dvs


def _on_device(fn, x: torch.Tensor):
    """fn compiled on CUDA (its dozen elementwise passes fused into a few kernels), eager
    elsewhere."""
    return compiled_once(fn, dynamic=False) if x.is_cuda else fn


class _MergedTTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, segments, scale, q, k0, v0, *diagonal):
        # q [B, nh, T, d]; k0, v0 [B, nkv, T, d] (step 0); diagonal: k_1..k_j, v_1..v_j
        j = len(diagonal) // 2
        out, lse, saved = kernel.forward(q, k0, v0, segments, scale)  # causal part
        if j:
            out, lse = _on_device(merge_diagonals, q)(q, out, lse, list(diagonal[:j]),
                                                      list(diagonal[j:]), scale)
        ctx.kernel, ctx.segments, ctx.scale, ctx.saved, ctx.j = kernel, segments, scale, saved, j
        ctx.save_for_backward(q, k0, v0, out, lse, *diagonal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse, *diagonal = ctx.saved_tensors
        j, scale = ctx.j, ctx.scale
        dout = dout.contiguous()
        # Given the merged output and log-sum-exp, the kernel's gradients are the causal part's
        # share of the merged attention's.
        dq, dk0, dv0 = ctx.kernel.backward(dout, q, k0, v0, out, lse, ctx.segments, scale,
                                           ctx.saved)
        if not j:
            return None, None, None, dq, dk0, dv0
        dq_diagonal, dks, dvs = _on_device(merge_diagonals_backward, q)(
            q, dout, out, lse, list(diagonal[:j]), list(diagonal[j:]), scale)
        return None, None, None, (dq.float() + dq_diagonal).to(q.dtype), dk0, dv0, *dks, *dvs


def merged_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         segments: Segments, kernel_name: str = "cudnn",
                         scale: float | None = None) -> torch.Tensor:
    """TTT attention of step len(keys) - 1: q [B, nh, T, d]; keys/values: steps 0..j, each
    [B, nkv, T, d]; segments: the row's documents. Returns [B, nh, T, d]."""
    kernel = kernel_named(kernel_name) if isinstance(kernel_name, str) else kernel_name
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _MergedTTTAttention.apply(kernel, segments, scale, q, keys[0], values[0],
                                     *keys[1:], *values[1:])
