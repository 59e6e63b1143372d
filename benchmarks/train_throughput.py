"""Drafter training throughput on one GPU with synthetic hidden states (issue 10's benchmark).

Llama-3.1-8B-shaped drafter: hidden 4096, 32 heads, 8 KV heads, intermediate 14336, target
vocab 128256, draft vocab 32000; one packed row of --tokens tokens (documents of --doc tokens)
per optimiser step; the trainer's own step: row_loss (target head in chunks over the draft
rows, flex_attention block masks, decoder layer compiled, lm_head fused with the soft CE),
backward, MasterWeightAdamW (bf16 parameters, float32 masters and AdamW state, fused AdamW),
gradient clipping.

FLOPs counted (model FLOPs, 2 per multiply-add, recomputation not counted):
  * fc: forward, and its weight gradient (the aux input needs none): 2 x 2*T*3Ht*H.
  * per TTT step: q/k/v over the hidden half of their input (H), o, gate/up/down and
    lm_head, forward 2*T*(...) and backward twice that (input and weight gradients); a
    frozen lm_head has no weight gradient, so 1x instead of 2x for it.
  * once a row: q/k/v over the embedding half of their input (H columns), which every TTT
    step reads shifted (`Eagle3Drafter.embedding_projections`), forward and backward.
  * attention: only allowed (query, key) pairs, 4*head_dim*heads FLOPs each (QK^T and PV),
    forward + 2x backward. Step j: causal pairs within each document (sum L(L+1)/2) plus
    j*T diagonal pairs. The blocks flex skips or masks inside are not counted.
  * the frozen target head that makes the targets: forward only, over the draft rows
    (2*T*H*D) when the row carries the target's argmax (extraction stores it), over the full
    vocab (2*T*H*V) with --computed-argmax (the other rows decide "argmax in draft vocab").
MFU = counted FLOPs / step time / 989.4 TFLOP/s (H200 dense bf16 peak from the data sheet);
the achieved bf16 matmul rate of a large GEMM on the same GPU is reported next to it.

`--parallel fsdp` runs the step as `train.parallel: fsdp` does, in a world of one process (a
process group of one, NCCL on a GPU, gloo on a CPU): the drafter fully_shard'ed as the trainer
shards it (float32 shards, bf16 all-gathered for compute, float32 gradient reduction), the row
through `Eagle3Drafter.in_forward`, AdamW on the float32 shards. One process shards nothing;
this measures what the FSDP machinery costs against the plain step (`--parallel none`).

    python benchmarks/train_throughput.py --tokens 8192 --ttt 3 7 --lm-head trainable frozen
    python benchmarks/train_throughput.py --tokens 8192 --ttt 3 --lm-head frozen --parallel fsdp
    python benchmarks/train_throughput.py --small --device cpu --attention sdpa --no-compile \
        --parallel fsdp --iters 2 --warmup 1 --tokens 256 --doc 64   # checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from draftsmith.extract.store import Sample
from draftsmith.model.eagle3.loss import row_loss_on_device
from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter
from draftsmith.train.loss import TargetHead
from draftsmith.train.optim import MasterWeightAdamW
from draftsmith.train.packing import PackedRow, RowPrefetcher, concat_row

PEAK_FLOPS = 989.4e12  # H200 SXM, dense bf16


def shape(small: bool = False) -> Eagle3Config:
    if small:  # a smoke-test shape for checking the script on a CPU
        return Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                            vocab_size=1000, draft_vocab_size=300, target_hidden_size=64,
                            aux_layer_ids=[1, 2, 3])
    return Eagle3Config(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                        rope_theta=500000.0, vocab_size=128256, draft_vocab_size=32000,
                        target_hidden_size=4096, aux_layer_ids=[1, 15, 28])


def flops_per_row(cfg: Eagle3Config, doc_lengths: list[int], steps: int,
                  lm_head_trainable: bool, stored_argmax: bool = True) -> dict[str, float]:
    T = sum(doc_lengths)
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    k_in = len(cfg.aux_layer_ids) * cfg.target_hidden_size
    fc = 2 * (2 * T * k_in * H)
    per_step = H * (q + 2 * kv) + q * H + 3 * H * I  # hidden half of q/k/v, o, MLP
    embedding_half = H * (q + 2 * kv)  # once a row, over T + steps - 1 positions
    layer = 3 * 2 * (steps * T * per_step + (T + steps - 1) * embedding_half)
    lm_head = (3 if lm_head_trainable else 2) * steps * 2 * T * H * cfg.draft_vocab_size
    causal_pairs = sum(n * (n + 1) // 2 for n in doc_lengths)
    pairs = sum(causal_pairs + j * T for j in range(steps))
    attention = 3 * 4 * pairs * q
    head_rows = cfg.draft_vocab_size if stored_argmax else cfg.vocab_size
    target_head = 2 * T * cfg.target_hidden_size * head_rows
    parts = {"fc": fc, "decoder_layer": layer, "lm_head": lm_head, "attention": attention,
             "target_head": target_head}
    parts["total"] = sum(parts.values())
    return parts


def matmul_tflops(device: str) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - started) / 1e12


def init_world_of_one(device: str) -> None:
    """The process group of one that FSDP shards over (no torchrun, no port)."""
    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)
    torch_dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                  store=torch_dist.HashStore(), rank=0, world_size=1)


class Setup:
    """One drafter, target head and row for every setting, so the compiled decoder layer's
    graphs (one per TTT step) are built once and reused. With --parallel fsdp the drafter is
    sharded with lm_head trainable or frozen as given (FSDP fixes which parameters take
    gradients when it shards), so each lm_head setting gets a Setup of its own."""

    def __init__(self, args, compiled: bool, lm_head: str | None = None):
        device = args.device
        self.cfg = cfg = shape(args.small)
        H = cfg.hidden_size
        g = torch.Generator().manual_seed(0)
        drafter = Eagle3Drafter(cfg)
        head = torch.randn(cfg.vocab_size, H, generator=g).bfloat16()  # [V, H]
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        drafter.load_target_parts(torch.randn(cfg.vocab_size, H, generator=g) * 0.02, d2t,
                                  t2d, target_head=head.float())
        self.lm_head = lm_head
        if args.parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            from draftsmith.train.fsdp import shard_drafter

            init_world_of_one(device)
            drafter.lm_head.weight.requires_grad_(lm_head == "trainable")
            shard_drafter(drafter, torch.bfloat16, init_device_mesh(torch.device(device).type,
                                                                    (1,)))
        else:
            with torch.no_grad():
                for p in drafter.parameters():
                    p.data = p.data.bfloat16()
            drafter.to(device)
        drafter.compile_layer(compiled)
        self.drafter, self.compiled, self.profiled = drafter, compiled, False
        self.target_head = TargetHead(head, drafter.draft_to_target_ids().cpu(), torch.bfloat16,
                                      device)
        T = args.tokens
        self.doc_lengths = [min(args.doc, T - start) for start in range(0, T, args.doc)]
        # Samples as the store serves them; each step builds its row from them, as the
        # trainer does (on the prefetch thread, into pinned memory).
        self.samples = [Sample(
            id=f"doc-{i}",
            input_ids=torch.randint(0, cfg.vocab_size, (n,), generator=g),
            loss_mask=torch.ones(n, dtype=torch.uint8),
            aux=torch.randn(n, 3 * H, generator=g).bfloat16(),
            final=torch.randn(n, H, generator=g).bfloat16(),
            # The target's greedy tokens, about 1 in 10 outside the draft vocab.
            target_argmax=None if args.computed_argmax else torch.where(
                torch.rand(n, generator=g) < 0.9,
                torch.randint(0, cfg.draft_vocab_size, (n,), generator=g),
                torch.randint(cfg.draft_vocab_size, cfg.vocab_size, (n,), generator=g),
            ).to(torch.int32),
        ) for i, n in enumerate(self.doc_lengths)]


KERNEL_KINDS = [  # (category, substrings of the kernel name), first match wins
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")),
    ("flex_attention", ("flex", "triton_tem")),
    ("optimizer", ("multi_tensor", "fused_adam", "FusedAdam", "_fused_adamw", "adam")),
    ("inductor_fused", ("triton_",)),
    ("copy_cat", ("Memcpy", "memcpy", "Memset", "copy", "Cat", "cat")),
    ("aten_elementwise", ("elementwise", "vectorized", "unrolled")),
    ("aten_reduce", ("reduce", "Reduce", "norm", "softmax")),
    ("index_gather", ("index", "gather", "scatter", "embedding")),
]


def kernel_breakdown(prof, steps: int) -> dict:
    """GPU kernel time per category and the heaviest kernels, per step (from the profiler's
    device events; launches and host time are not in it)."""
    from collections import defaultdict

    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        us = e.time_range.elapsed_us()
        kind = next((k for k, subs in KERNEL_KINDS if any(x in e.name for x in subs)), "other")
        totals[kind] += us
        counts[kind] += 1
        by_name[e.name][0] += us
        by_name[e.name][1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]
    return {
        "gpu_ms_per_step": round(sum(totals.values()) / 1000 / steps, 2),
        "categories_ms_per_step": {k: round(v / 1000 / steps, 2)
                                   for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": {k: counts[k] // steps for k in totals},
        "top_kernels": [{"name": n[:120], "ms_per_step": round(t / 1000 / steps, 3),
                         "calls_per_step": c // steps} for n, (t, c) in top],
    }


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(args, setup: Setup, steps: int, lm_head: str, adamw: str = "auto") -> dict:
    device = args.device
    drafter, T = setup.drafter, args.tokens
    if setup.lm_head is None:
        drafter.lm_head.weight.requires_grad_(lm_head == "trainable")
    elif setup.lm_head != lm_head:
        raise ValueError(f"this setup was sharded with lm_head {setup.lm_head}, not {lm_head}")
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = MasterWeightAdamW(trainable, lr=1e-5, weight_decay=0.0,
                                  single_pass={"auto": None, "torch": False,
                                               "single_pass": True}[adamw])
    weights = [0.8**j for j in range(steps)]

    prefetcher = RowPrefetcher(torch.device(device))

    def build(pin: bool) -> PackedRow:
        return concat_row(setup.samples, T, T, pin)

    pending = [prefetcher.start(build)]

    window = torch.zeros(5, steps, dtype=torch.float64, device=device)

    def one_step() -> torch.Tensor:
        # As the trainer does: this row was copied during the previous step, the next one is
        # copied now; the counts are summed on the device (the trainer reads them when it logs).
        on_device = prefetcher.wait(pending.pop())
        pending.append(prefetcher.start(build))
        loss, counts = row_loss_on_device(drafter, on_device, setup.target_head, steps, weights,
                                          device, args.attention)
        loss.backward()
        optimizer.step(1.0)
        window.add_(counts)
        return loss.detach()

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    losses = [one_step() for _ in range(args.warmup)]
    synchronize()
    warmup_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(args.iters):
        losses.append(one_step())
    synchronize()
    seconds = (time.perf_counter() - started) / args.iters
    flops = flops_per_row(setup.cfg, setup.doc_lengths, steps, lm_head == "trainable",
                          stored_argmax=not args.computed_argmax)
    result = {
        "parallel": args.parallel,
        "adamw": "single_pass" if optimizer.single_pass else "torch",
        "tokens_per_row": T, "doc_tokens": args.doc, "ttt_steps": steps, "lm_head": lm_head,
        "compiled_layer": setup.compiled, "target_argmax": "computed" if args.computed_argmax
        else "stored", "seconds_per_step": round(seconds, 4),
        "tokens_per_s": round(T / seconds), "tflops": round(flops["total"] / seconds / 1e12, 1),
        "mfu": round(flops["total"] / seconds / PEAK_FLOPS, 3),
        # Peak over the whole run of this setting, optimiser state included.
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device == "cuda" else None,
        "trainable_parameters_m": round(sum(p.numel() for p in trainable) / 1e6, 1),
        "gflops_per_row": {k: round(v / 1e9, 1) for k, v in flops.items()},
        "warmup_s": round(warmup_s, 1),
        "loss_first_last": [losses[0].item(), losses[-1].item()],
    }
    if args.profile and not setup.profiled:
        setup.profiled = True
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda"
                                               else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                one_step()
            synchronize()
        sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        breakdown = kernel_breakdown(prof, steps=2)
        with open(args.profile, "a") as f:
            f.write(f"{steps=} {lm_head=} doc={args.doc}, 2 steps\n{table}\n"
                    f"{json.dumps(breakdown, indent=1)}\n")
        result["profile_ms_per_step"] = breakdown["categories_ms_per_step"]
    pending.clear()
    prefetcher.close()
    for p in drafter.parameters():
        p.grad = None
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--doc", type=int, default=2048)
    parser.add_argument("--ttt", type=int, nargs="+", default=[3])
    parser.add_argument("--lm-head", nargs="+", default=["trainable"],
                        choices=["trainable", "frozen"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true",
                        help="eager decoder layer (flex attention stays compiled)")
    parser.add_argument("--check-attention", action="store_true",
                        help="first compare the SDPA and flex paths (outputs and gradients)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--computed-argmax", action="store_true", help=(
        "rows without the stored target argmax: the trainer applies the full-vocab head"))
    parser.add_argument("--attention", default="flex",
                        choices=["flex", "sdpa", "cudnn", "flash"])
    parser.add_argument("--small", action="store_true", help="tiny shape, to check the script")
    parser.add_argument("--adamw", nargs="+", default=["auto"],
                        choices=["auto", "torch", "single_pass"], help=(
                            "MasterWeightAdamW's step: the trainer's (auto: one pass on CUDA), "
                            "torch's fused AdamW after float32 gradient copies, or one pass"))
    parser.add_argument("--parallel", default="none", choices=["none", "fsdp"], help=(
        "fsdp: the drafter sharded as train.parallel=fsdp shards it, in a world of one"))
    parser.add_argument("--profile", type=Path,
                        help="write a torch.profiler table of 2 steps of the first setting")
    parser.add_argument("--out", type=Path, help="append each result as a JSON line here")
    args = parser.parse_args()

    def emit(obj: dict) -> None:
        line = json.dumps(obj)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    if args.device == "cuda":
        emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "matmul_bf16_tflops_8192": round(matmul_tflops("cuda"), 1)})
    if args.check_attention:
        from draftsmith.model.attention_check import compare_attention_paths

        # Flex alone in float32 (tight), then the training path: bf16, compiled layer.
        for dtype, compiled in ((torch.float32, False), (torch.bfloat16, True)):
            try:
                emit({"attention_check": compare_attention_paths(
                    "cuda", dtype=dtype, compiled_layer=compiled)})
            except Exception as err:  # noqa: BLE001 - report and go on to the benchmark
                emit({"attention_check_error": f"{type(err).__name__}: {err}"[:2000],
                      "dtype": str(dtype), "compiled_layer": compiled})
    setups: dict[str | None, Setup] = {}

    def setup_for(lm_head: str) -> Setup:
        key = lm_head if args.parallel == "fsdp" else None
        if key not in setups:
            if setups and args.parallel == "fsdp":  # one sharded drafter at a time
                setups.clear()
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            setups[key] = Setup(args, compiled=not args.no_compile, lm_head=key)
        return setups[key]

    settings = [(steps, lm_head) for steps in args.ttt for lm_head in args.lm_head]
    if args.parallel == "fsdp":  # one Setup per lm_head setting: each setting's runs together
        settings = [(steps, lm_head) for lm_head in args.lm_head for steps in args.ttt]
    settings = [(*setting, adamw) for setting in settings for adamw in args.adamw]
    for steps, lm_head, adamw in settings:
        setup = setup_for(lm_head)
        try:
            emit(bench(args, setup, steps, lm_head, adamw))
        except Exception as err:  # noqa: BLE001 - one failed setting must not hide the rest
            emit({"ttt_steps": steps, "lm_head": lm_head, "compiled_layer": setup.compiled,
                  "error": f"{type(err).__name__}: {err}"[:3000]})
            if args.parallel == "fsdp":  # the failed iteration left FSDP mid-step
                from draftsmith.train.fsdp import reset_after_failure

                reset_after_failure(setup.drafter)
            if setup.compiled:  # what the trainer falls back to
                setup.compiled = False
                setup.drafter.compile_layer(False)
                for p in setup.drafter.parameters():
                    p.grad = None
                try:
                    emit(bench(args, setup, steps, lm_head, adamw))
                except Exception as err2:  # noqa: BLE001
                    emit({"ttt_steps": steps, "lm_head": lm_head, "compiled_layer": False,
                          "error": f"{type(err2).__name__}: {err2}"[:3000]})
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
