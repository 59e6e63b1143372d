"""The training step's parts that are not matmuls, timed alone on one GPU (issue 18's profile).

Llama-3.1-8B-shaped drafter (hidden 4096, 32 heads, 8 KV heads, head_dim 128, draft vocab
32000), rows of 8192 tokens. Each part prints one JSON line:
  * optimizer: MasterWeightAdamW's torch path (float32 gradient copies, clip_grad_norm_, fused
    AdamW, copy back) against the single pass (`adamw_on_masters`, compiled), with the largest
    difference of the masters after the same steps;
  * attention: flex attention forward + backward over the TTT masks of steps 0 and 2, at
    1 x 8192 and 4 x 2048, for several kernel_options; SDPA's flash and cuDNN kernels on the
    plain causal step-0 case as a reference;
  * loss: the fused lm_head + soft CE (forward, gradients included) at several chunk sizes;
  * masks: building the TTT block masks of a row.

    python benchmarks/train_kernels.py --parts optimizer attention loss masks
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from draftsmith.model.eagle3.model import Eagle3Drafter, flex_attention, ttt_block_masks
from draftsmith.model.ttt_attention import document_segments, merged_ttt_attention
from draftsmith.train.loss import fused_linear_soft_ce
from draftsmith.train.optim import MasterWeightAdamW

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, DRAFT_VOCAB, TOKENS = 32, 8, 128, 4096, 32000, 8192


def timed(fn, iters: int = 10, warmup: int = 3) -> float:
    """Milliseconds per call (CUDA events around `iters` calls after `warmup`)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def drafter_params() -> list[torch.nn.Parameter]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from train_throughput import shape

    drafter = Eagle3Drafter(shape())
    drafter.lm_head.weight.requires_grad_(False)
    with torch.no_grad():
        for p in drafter.parameters():
            p.data = p.data.bfloat16()
    drafter.cuda()
    return [p for p in drafter.parameters() if p.requires_grad]


class OptimizerStep:
    def __init__(self, params, grads, opt):
        self.params, self.grads, self.opt = params, grads, opt

    def __call__(self) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g.clone()
        self.opt.step(1.0)


def part_optimizer() -> None:
    params = drafter_params()
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    start = [p.detach().clone() for p in params]
    results = {}
    masters = {}
    for single_pass in (False, True):
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
        opt = MasterWeightAdamW(params, lr=1e-4, weight_decay=0.01, single_pass=single_pass)
        step = OptimizerStep(params, grads, opt)
        for _ in range(5):  # the same five steps for both: compared below
            step()
        masters[single_pass] = [m.detach().clone() for m in opt.master]
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = timed(step)
        # The clone of the gradients is part of both; timed alone below.
        results["single_pass" if single_pass else "torch"] = {
            "ms_per_step": round(ms, 3),
            "extra_peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)}
        del opt
        torch.cuda.empty_cache()
    clone_ms = timed(lambda: [g.clone() for g in grads])
    diff = max((a - b).abs().max().item() for a, b in zip(masters[False], masters[True],
                                                          strict=True))
    emit({"part": "optimizer", "parameters_m": round(sum(p.numel() for p in params) / 1e6, 1),
          **results, "grad_clone_ms": round(clone_ms, 3), "max_master_diff_after_5": diff})


FLEX_VARIANTS = {
    "default": {},
    "tma": {"USE_TMA": True},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "fwd_128x128_s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2},
    "bwd_s2": {"bwd_num_stages": 2},
    "bwd_128": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                "bwd_BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8},
}


def part_attention(variants: list[str], steps: list[int], deadline: float) -> None:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    g = torch.Generator(device="cuda").manual_seed(0)
    for doc in (8192, 2048):
        docs = torch.arange(TOKENS, device="cuda")[None] // doc  # [1, T]
        masks = ttt_block_masks(docs, 3)
        for j in steps:
            q = torch.randn(1, HEADS, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                            generator=g).requires_grad_()  # [1, nh, T, d]
            kv_len = (j + 1) * TOKENS
            k = torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                            generator=g).requires_grad_()  # [1, nkv, (j+1)T, d]
            v = torch.randn_like(k).requires_grad_()  # [1, nkv, (j+1)T, d]
            dout = torch.randn_like(q)  # [1, nh, T, d]
            reference: list = []
            documents = document_segments(docs[0].cpu())
            for name in variants:
                if time.monotonic() > deadline:
                    emit({"part": "attention", "skipped": f"{doc=} {j=} {name}: deadline"})
                    continue
                if name.startswith("merged_"):
                    timing = time_merged(q, k, v, dout, documents, name.removeprefix("merged_"),
                                         reference)
                else:
                    timing = time_flex(q, k, v, dout, masks[j], FLEX_VARIANTS[name], reference)
                emit({"part": "attention", "doc": doc, "ttt_step": j, "variant": name, **timing})
            if doc == TOKENS and j == 0:  # one causal document: the dense kernels' case
                from torch.nn.attention import SDPBackend

                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    emit({"part": "attention", "doc": doc, "ttt_step": 0,
                          "variant": f"sdpa_{backend.name.lower()}_causal",
                          **time_sdpa(q, k, v, dout, backend)})


def time_flex(q, k, v, dout, mask, opts: dict, reference: list) -> dict:
    """Forward and forward + backward of compiled flex attention with these kernel_options;
    the first variant's output and dq are the reference the others are compared with."""
    fn = torch.compile(flex_attention, dynamic=False)

    def fwd():
        return fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts or None)

    def fwd_bwd():
        fwd().backward(dout)

    try:
        started = time.perf_counter()
        out = fwd()
        out.backward(dout)
        compile_s = time.perf_counter() - started
        if not reference:
            reference += [out.detach(), q.grad.clone()]
        err = max((out.detach() - reference[0]).abs().max().item(),
                  (q.grad - reference[1]).abs().max().item())
        fwd_ms = timed(lambda: fwd().detach())
        total_ms = timed(fwd_bwd)
        return {"fwd_ms": round(fwd_ms, 3), "fwd_bwd_ms": round(total_ms, 3),
                "compile_s": round(compile_s, 1), "max_diff_vs_first": err}
    except Exception as error:  # noqa: BLE001 - report the variant, go on
        return {"error": f"{type(error).__name__}: {error}"[:600]}
    finally:
        q.grad = k.grad = v.grad = None


def time_merged(q, k, v, dout, documents, kernel: str, reference: list) -> dict:
    """The merged path (a dense causal kernel per document, the diagonals merged in) on the
    same inputs: k, v [1, nkv, (j+1)T, d] are split into the steps' keys."""
    T = q.shape[2]

    def fwd():
        return merged_ttt_attention(q, list(k.split(T, dim=2)), list(v.split(T, dim=2)),
                                    documents, kernel)

    def fwd_bwd():
        fwd().backward(dout)

    try:
        out = fwd()
        out.backward(dout)
        err = None
        if reference:
            err = max((out.detach() - reference[0]).abs().max().item(),
                      (q.grad - reference[1]).abs().max().item())
        return {"fwd_ms": round(timed(lambda: fwd().detach()), 3),
                "fwd_bwd_ms": round(timed(fwd_bwd), 3), "max_diff_vs_first": err,
                "out_abs_max": out.abs().max().item()}
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {error}"[:600]}
    finally:
        q.grad = k.grad = v.grad = None


def time_sdpa(q, k, v, dout, backend) -> dict:
    from torch.nn.attention import sdpa_kernel

    def fwd():
        with sdpa_kernel(backend), torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)

    def fwd_bwd():
        with sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True).backward(dout)

    try:
        return {"fwd_ms": round(timed(fwd), 3), "fwd_bwd_ms": round(timed(fwd_bwd), 3)}
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {error}"[:600]}
    finally:
        q.grad = k.grad = v.grad = None


def part_loss() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16,
                    generator=g).requires_grad_()  # [T, H]
    weight = (torch.randn(DRAFT_VOCAB, HIDDEN, device="cuda", generator=g) * 0.02
              ).bfloat16()  # [D, H] frozen lm_head
    probs = torch.randn(TOKENS, DRAFT_VOCAB, device="cuda", generator=g).softmax(-1
                                                                                ).bfloat16()
    weights = torch.full((TOKENS,), 1.0 / TOKENS, device="cuda")  # [T]
    gemm_ms = timed(lambda: x.detach() @ weight.T)
    for chunk in (1024, 2048, 4096):
        def loss_and_grads(chunk=chunk):
            loss, _, _ = fused_linear_soft_ce(x, weight, probs, weights, chunk, compiled=True)
            loss.backward()
            x.grad = None

        ms = timed(loss_and_grads)
        emit({"part": "loss", "chunk": chunk, "ms": round(ms, 3),
              "of_which_two_gemms_ms": round(2 * gemm_ms, 3)})


def part_masks() -> None:
    for doc in (8192, 2048):
        docs = torch.arange(TOKENS, device="cuda")[None] // doc  # [1, T]
        ms = timed(lambda docs=docs: ttt_block_masks(docs, 3))
        emit({"part": "masks", "doc": doc, "ttt_steps": 3, "ms_per_row": round(ms, 3)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", nargs="+", default=["optimizer", "attention", "loss",
                                                       "masks"])
    parser.add_argument("--variants", nargs="+",
                        default=[*FLEX_VARIANTS, "merged_cudnn", "merged_flash"])
    parser.add_argument("--ttt-steps", nargs="+", type=int, default=[0, 2])
    parser.add_argument("--attention-seconds", type=float, default=600,
                        help="start no attention variant after this many seconds")
    args = parser.parse_args()
    emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    for part in args.parts:
        started = time.perf_counter()
        try:
            if part == "attention":
                part_attention(args.variants, args.ttt_steps,
                               time.monotonic() + args.attention_seconds)
            else:
                globals()[f"part_{part}"]()
        except Exception as error:  # noqa: BLE001 - one part failing must not hide the rest
            emit({"part": part, "error": f"{type(error).__name__}: {error}"[:1500]})
        emit({"part": part, "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
