"""The k best draft ids of each row of logits, with their log-probabilities, in one GPU kernel.

A draft tree takes the top k of the draft vocabulary (16,384 ids in the SmolLM2 recipe) for
every frontier node at every level. Inside the captured drafting round each kernel costs a few
microseconds whatever it does, so the number of kernels is the cost:
- torch.topk is a library kernel the compiler cannot fuse, a radix select of many passes with
  one thread block a row, then a sort of the k it found;
- k argmaxes (`reference`) are k reductions, each waiting for the last: k kernels.
`triton_row_topk` gives each row one Triton program that holds the row in registers and takes
its log-sum-exp and its k argmaxes in one kernel. Ties go to the lower id on every path.
"""

from __future__ import annotations

import logging

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # torch builds without Triton: every device takes the reference
    triton = None

log = logging.getLogger(__name__)

# A row up to this wide fits one program's registers (64 floats a thread at 16 warps); a
# wider draft vocabulary takes the reference.
MAX_KERNEL_WIDTH = 32768
# Whether the kernel ran on this process's first CUDA device and agreed with the reference
# (`kernel_works`); a plain global, which a compiled round reads as a constant.
_kernel_works: bool | None = None


def reference(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of each row by torch operations: logits [F, D] -> log-probabilities [F, k]
    float32 and ids [F, k], best first, an equal logit going to the lower id."""
    scores = logits.float()  # [F, D]
    columns = torch.arange(scores.shape[-1], device=scores.device)  # [D]
    log_total = scores.logsumexp(-1, keepdim=True)  # [F, 1]
    ids = []
    remaining = scores
    for _ in range(topk):
        best_id = remaining.argmax(-1, keepdim=True)  # [F, 1]: argmax takes the first
        ids.append(best_id)
        remaining = remaining.masked_fill(columns == best_id, float("-inf"))  # [F, D]
    top = torch.cat(ids, -1)  # [F, k]
    return scores.gather(-1, top) - log_total, top  # [F, k], [F, k]


if triton is not None:

    @triton.jit
    def _row_topk_kernel(logits_ptr, logp_ptr, ids_ptr, width, row_stride,
                         K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        columns = tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * row_stride + columns, mask=columns < width,
                    other=-float("inf")).to(tl.float32)  # [BLOCK]
        top = tl.max(x, 0)
        log_total = top + tl.log(tl.sum(tl.exp(x - top), 0))
        for i in tl.static_range(K):
            value = tl.max(x, 0)
            best = tl.min(tl.where(x == value, columns, BLOCK), 0)  # the lowest id holding it
            best = tl.minimum(best, width - 1)  # a NaN row matches nothing: keep the id in range
            tl.store(logp_ptr + row * K + i, value - log_total)
            tl.store(ids_ptr + row * K + i, best.to(tl.int64))
            x = tl.where(columns == best, -float("inf"), x)  # [BLOCK]

    def _launch(kernel, logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = logits.shape
        logits = logits.contiguous()
        logp = logits.new_empty(rows, topk, dtype=torch.float32)  # [F, k]
        ids = logits.new_empty(rows, topk, dtype=torch.int64)  # [F, k]
        block = triton.next_power_of_2(width)
        kernel[(rows,)](logits, logp, ids, width, logits.stride(0), K=topk, BLOCK=block,
                        num_warps=min(16, max(4, block // 1024)))
        return logp, ids

    def triton_row_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`reference`'s result from one kernel launch (rows on the GPU; any device under
        TRITON_INTERPRET=1, which is how the CPU tests run it)."""
        return _launch(_row_topk_kernel, logits, topk)

    @triton_op("draftsmith::row_topk", mutates_args=())
    def _row_topk_op(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """triton_row_topk as an operator that torch.compile keeps in its graph."""
        return _launch(wrap_triton(_row_topk_kernel), logits, topk)


def kernel_agrees(device: torch.device) -> bool:
    """Whether the Triton kernel runs on `device` and gives the reference's top k on random
    rows with a tie. A Triton this machine cannot build, or a kernel that disagrees, is
    logged with what happened, and the caller keeps the reference."""
    if triton is None:
        return False
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)).to(device)
    logits[1, 9] = logits[1, 4000] = logits[1].max() + 1  # a tie for the first place
    try:
        logp, ids = triton_row_topk(logits, 4)
        want_logp, want_ids = reference(logits, 4)
        agrees = torch.equal(ids, want_ids) and torch.allclose(logp, want_logp, atol=1e-5)
        if not agrees:
            log.warning("row_topk: the Triton kernel disagrees with torch on %s (ids %s, "
                        "expected %s): trees take their top k by torch operations",
                        device, ids.tolist(), want_ids.tolist())
        return agrees
    except Exception as error:  # noqa: BLE001 - any failure means: do not use it
        log.warning("row_topk: the Triton kernel failed on %s (%s: %s): trees take their "
                    "top k by torch operations", device, type(error).__name__, error)
        return False


def kernel_works(device: torch.device) -> bool:
    """`kernel_agrees` on CUDA, tried once in the process (its GPUs are of one kind). Engines
    that draft trees ask before they compile their round, so a compiled round reads the
    answer only."""
    global _kernel_works
    if device.type != "cuda":
        return False
    if _kernel_works is None:
        _kernel_works = kernel_agrees(device)
    return _kernel_works


def row_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of each row of logits [F, D]: log-probabilities [F, k] float32 and ids
    [F, k], best first, an equal logit going to the lower id. One kernel on a CUDA device
    where it works (`kernel_works`); the reference elsewhere, and for rows wider than
    MAX_KERNEL_WIDTH."""
    if logits.shape[-1] <= MAX_KERNEL_WIDTH and kernel_works(logits.device):
        return _row_topk_op(logits, topk)
    return reference(logits, topk)
