"""Where the embedded engine's time goes on a GPU, plain and speculative (issue 46): on an H100
(2026-12-06) its static path took 3.36 ms a plain token and 4.12 ms to verify 4 tokens at
batch 1, where vLLM's plain stream took 1.97 ms; at batch 16 a plain step took 11.85 ms, more
than a 4-token verify of every row (9.80 ms). This profile found half of the plain step in
SDPA's attention kernel, which the static path has since replaced (grouped_verify_matmul in
draftsmith/model/grouped_attention.py; results/gpu_speculative/lease_2026-12-06d). For each
of plain and speculative decoding of the same prompts (after a warm-up on the longest), one
at a time or `--batch` together, the profiler gives wall time against GPU busy time (the sum
of kernel times), kernels and CUDA graph launches per step (a token, a round, or a batch's
forward), and the host operations that take the wall time.

One JSON line per mode in --out, and the profiler's tables in OUT.tables.txt:

    # on the GPU, with a drafter made by the recipe (speculators layout)
    python benchmarks/speculative_profile.py --drafter DRAFTER_DIR --device cuda \\
        --out benchmarks/results/gpu_speculative/profile.jsonl
    python benchmarks/speculative_profile.py --drafter DRAFTER_DIR --device cuda --batch 16 \\
        --prompts 16 --out benchmarks/results/gpu_speculative/profile.jsonl
    # here: a --trace file's CUDA graphs (the verify step, the drafter's round) and kernels
    python benchmarks/speculative_profile.py --graph-launches OUT.speculative.trace.json.gz \\
        --out graphs.jsonl
    # here: the same on the CPU, a check of the script (no figure to keep)
    python benchmarks/speculative_profile.py --drafter DRAFTER_DIR --device cpu \\
        --prompts 1 --max-new-tokens 16 --out /tmp/profile.jsonl

--random-weights takes SmolLM2's shapes and a recipe-shaped EAGLE-3.1 drafter with random
weights (gpu_speculative/random_parts.py) instead of --drafter: no GGUF to carry, the same
step and round costs, prompts of the dev sets' lengths, but a round accepts almost nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftsmith.bench.benchmark import benchmark_prompts  # noqa: E402
from draftsmith.config import BenchmarkConfig, TargetConfig  # noqa: E402
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, plain_generate  # noqa: E402
from draftsmith.serve.embedded_batch import (  # noqa: E402
    BatchedSpeculativeDecoder,
    plain_generate_batch,
)
from draftsmith.target import load_target_model, load_tokenizer, resolve_target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu_speculative"))
from random_parts import (  # noqa: E402
    dev_length_prompts,
    random_eagle3_drafter,
    smollm2_shaped_target,
)


def gpu_figures(prof, device: str) -> dict:
    """GPU busy time (kernels' own time, summed) and kernel and graph launches."""
    if device != "cuda":
        return {}
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = {e.key: e.count for e in events
                if e.key in ("cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel")}
    return {"gpu_busy_ms": round(busy_us / 1000, 3), "launches": launches}


def decode(mode: str, engine, group: list[list[int]], max_new_tokens: int,
           eos: int | None) -> tuple[int, int]:
    """Plain or speculative decoding of a group of prompts (one at a time for a group of one,
    as the benchmark's batch 1; together otherwise): tokens made and steps (forwards after
    the prompts')."""
    if len(group) == 1:
        out = (plain_generate(engine.runner, group[0], max_new_tokens, eos) if mode == "plain"
               else engine.generate(group[0], max_new_tokens, eos))
        return len(out.tokens), out.verify_rounds
    batch = (plain_generate_batch(engine.runner, group, max_new_tokens, eos) if mode == "plain"
             else BatchedSpeculativeDecoder(engine).generate(group, max_new_tokens, eos))
    return sum(len(row.tokens) for row in batch.rows), batch.forwards


def run_mode(mode: str, engine, groups: list[list[list[int]]], max_new_tokens: int,
             device: str, eos: int | None) -> tuple[dict, str]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    tokens = steps = 0
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for group in groups:
            with record_function(mode):
                made, forwards = decode(mode, engine, group, max_new_tokens, eos)
            tokens += made
            steps += forwards
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    row = {"mode": mode, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "batch": len(groups[0]), "prompts": sum(len(g) for g in groups), "tokens": tokens,
           "steps": steps,
           "wall_ms": round(1000 * wall, 1), "ms_per_step": round(1000 * wall / steps, 3),
           **gpu_figures(prof, device)}
    if "gpu_busy_ms" in row:
        row["gpu_busy_ms_per_step"] = round(row["gpu_busy_ms"] / steps, 3)
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    tables = (f"== {mode}: host operations by own CPU time\n"
              + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
              + f"\n== {mode}: by {sort}\n"
              + prof.key_averages().table(sort_by=sort, row_limit=25))
    return row, tables


def forward_costs(engine, prompt: list[int], device: str, repeats: int = 200) -> dict:
    """The target's forward alone, one token and the verify's k+1, after `prompt`: ms a
    forward (wall, with a wait for the GPU after each; a plain step and a verify add their
    reading of the logits and bookkeeping to it)."""
    runner = engine.runner
    cache = runner.new_cache(len(prompt) + 64)
    runner.forward(prompt, cache)
    costs = {}
    for width in (1, engine.num_steps + 1):
        ids = [prompt[-1]] * width
        for _ in range(3):  # warm: compile and capture this width
            runner.forward(ids, cache)
            runner.drop_last(cache, width)
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            logits, _ = runner.forward(ids, cache)
            logits[-1, 0].item()  # as a step reads its argmax: wait for the GPU
            runner.drop_last(cache, width)
        costs[f"ms_forward_{width}"] = round(1000 * (time.perf_counter() - started) / repeats,
                                             3)
    return costs


def graph_launches(trace_path: Path, top: int = 6) -> list[dict]:
    """From a --trace file: the CUDA graphs launched, grouped by their kernel count (the
    target's verify step, the drafter's round, ...), with each group's median span and GPU
    busy time per launch (us) and its costliest kernels."""
    import gzip
    from collections import Counter, defaultdict
    from statistics import median

    with gzip.open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"].get("correlation") for e in events
                if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"}
    kernels = defaultdict(list)  # a launch's correlation id -> its kernels
    for e in events:
        if e.get("cat") == "kernel" and e["args"].get("correlation") in launches:
            kernels[e["args"]["correlation"]].append(e)
    by_size = defaultdict(list)
    for graph in kernels.values():
        by_size[len(graph)].append(graph)
    rows = []
    for size, graphs in sorted(by_size.items(), key=lambda item: -len(item[1])):
        names = Counter()
        for graph in graphs:
            for k in graph:
                names[k["name"][:80]] += k["dur"] / len(graphs)
        rows.append({
            "kernels": size, "launches": len(graphs),
            "span_us": round(median(max(k["ts"] + k["dur"] for k in g) - min(k["ts"] for k in g)
                                    for g in graphs)),
            "busy_us": round(median(sum(k["dur"] for k in g) for g in graphs)),
            "top_kernels_us": {name: round(us, 1) for name, us in names.most_common(top)}})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path)
    parser.add_argument("--random-weights", action="store_true",
                        help="random SmolLM2-shaped target and drafter, instead of --drafter")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the random weights' dtype (--random-weights)")
    parser.add_argument("--prompts", type=int, default=4, help="of each dev set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1,
                        help="prompts decoded together (the benchmark's batch_sizes)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--topk", type=int, default=1, help="deploy.eagle_topk: >1 a tree")
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="deploy.num_draft_tokens (default: a chain's 4, a tree's most)")
    parser.add_argument("--trace", action="store_true",
                        help="also a Chrome trace of each mode over one group's first 16 "
                             "tokens (OUT.MODE.trace.json.gz): the kernels' order and the "
                             "GPU's idle gaps within a step")
    parser.add_argument("--graph-launches", type=Path, metavar="TRACE",
                        help="no run: summarize a --trace file's CUDA graph launches into --out")
    args = parser.parse_args(argv)
    if args.graph_launches:
        rows = graph_launches(args.graph_launches)
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return
    if (args.drafter is None) == (not args.random_weights):
        parser.error("give --drafter DIR or --random-weights (one of the two)")
    if args.random_weights:
        model = smollm2_shaped_target(args.device).to(getattr(torch, args.dtype))
        engine = EmbeddedSpeculativeEngine(model, random_eagle3_drafter(model), num_steps=3,
                                           topk=args.topk, num_draft_tokens=args.draft_tokens,
                                           cache="static")
        prompts = dev_length_prompts(3 * args.prompts)
        eos = None
    else:
        target = resolve_target(TargetConfig(model="builtin:smollm2-135m-instruct",
                                             dtype="float32"))
        tokenizer = load_tokenizer(target)
        cfg = BenchmarkConfig(suite=["chat", "code", "math"], splits=["dev"],
                              prompts_per_set=args.prompts, max_new_tokens=args.max_new_tokens)
        prompts, _ = benchmark_prompts(cfg, None, tokenizer)
        model = load_target_model(target.path, args.device, "float32")
        engine = EmbeddedSpeculativeEngine.load(model, args.drafter, num_steps=3,
                                                topk=args.topk,
                                                num_draft_tokens=args.draft_tokens,
                                                cache="static")
        eos = tokenizer.eos_token_id
    # The longest prompts first, as the benchmark's warm-up: compile, record graphs, grow the
    # caches to what every group needs.
    prompts = sorted(prompts, key=len, reverse=True)
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    groups = [g for g in groups if len(g) == args.batch]  # one shape: no compile while measured
    if not groups:
        parser.error(f"--batch {args.batch}: more than the {len(prompts)} prompts")
    for mode in ("speculative", "plain"):  # speculative first: its caches are the longer
        decode(mode, engine, groups[0], args.max_new_tokens, eos)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.batch == 1:
        costs = {"mode": "forward", **forward_costs(engine, groups[0][0], args.device)}
        print(json.dumps(costs), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(costs) + "\n")
    tables = []
    for mode in ("plain", "speculative"):
        row, table = run_mode(mode, engine, groups, args.max_new_tokens, args.device, eos)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        tables.append(table)
    args.out.with_suffix(".tables.txt").write_text("\n\n".join(tables))
    if args.trace:
        for mode in ("plain", "speculative"):
            write_trace(mode, engine, groups[0], args.device, eos,
                        args.out.with_suffix(f".{mode}.trace.json.gz"))


def write_trace(mode: str, engine, group: list[list[int]], device: str, eos: int | None,
                path: Path) -> None:
    """A Chrome trace of one group's first 16 tokens (short: a full run's trace is too big
    to bring back from a lease)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        decode(mode, engine, group, 16, eos)
        if device == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))  # gzipped by its .gz suffix


if __name__ == "__main__":
    main()
