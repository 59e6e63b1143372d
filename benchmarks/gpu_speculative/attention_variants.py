"""The embedded engine's static-path step costs under each attention and dtype (issue 46).

speculative_profile.py found half of SmolLM2's 3.1 ms plain step on an H100 in SDPA's
memory-efficient kernel (57 us a layer, float32, a decode step over a 512-slot static cache).
This times the product's steps with SmolLM2's shapes (random weights, gpu_speculative/
random_parts.py: costs only, no acceptance) for each variant:

    sdpa     transformers' SDPA attention, as the static path ran until now
    decode   the matmul decode step (draftsmith/model/grouped_attention.py, grouped_verify_matmul)
             at up to 16 queries (the static path's default since it was measured here)
    math     SDPA restricted to its math backend (torch.nn.attention.sdpa_kernel)
    +autotune  inductor's max_autotune_gemm on top (Triton GEMM templates against cuBLAS)

Each variant is measured by the benchmark stage's own functions (plain_decoding,
measure_embedded: the figures a report gives), in its own process (a fresh compile). The
processes compile at once and take turns on the GPU (a lock around the timed part), so the
figures do not share the GPU. Per variant one JSON line in --out: decoding of the dev-length
prompts one at a time (plain ms a token; speculative ms a round, split as the benchmark splits
it; speculative outputs against plain), with the plain tokens of each variant, to compare the
variants' outputs. (The H100's runs of 2026-12-06 timed the same steps with the script's own
arithmetic, the same definitions.) (Batches are left out: in a
first version, a batch of 12 timed after the batch-1 decoding took 842 ms a forward against
11.8 ms in the benchmark stage, a cause not looked into; the benchmark stage times batches alone.)

    python benchmarks/gpu_speculative/attention_variants.py --device cuda --out OUT.jsonl
    python benchmarks/gpu_speculative/attention_variants.py --device cpu --prompts 1 \\
        --max-new-tokens 4 --variants sdpa decode --out /tmp/variants.jsonl   # a check here
    python benchmarks/gpu_speculative/attention_variants.py --summarize RUNS.jsonl ... \\
        --out summary.json
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
VARIANTS = ("sdpa", "decode", "math", "decode+autotune", "bf16:sdpa", "bf16:decode")


def measure(variant: str, args) -> dict:
    """The benchmark stage's own measurement (plain_decoding, measure_embedded) of one variant,
    after a warm-up outside the GPU's lock."""
    from random_parts import dev_length_prompts, random_eagle3_drafter, smollm2_shaped_target

    from draftsmith.bench.benchmark import measure_embedded, plain_decoding
    from draftsmith.config import BenchmarkConfig
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, StaticTargetRunner

    dtype, _, attention = variant.rpartition(":")
    attention, _, tune = attention.partition("+")
    if tune:
        import torch._inductor.config as inductor_config
        inductor_config.max_autotune_gemm = True
    model = smollm2_shaped_target(args.device)
    if dtype:
        model = model.to(getattr(torch, {"bf16": "bfloat16"}[dtype]))
    backend = contextlib.nullcontext()
    if attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = sdpa_kernel([SDPBackend.MATH])
    with backend:
        engine = EmbeddedSpeculativeEngine(model, random_eagle3_drafter(model), num_steps=3,
                                           cache="static")
        width = engine.num_steps + 1
        if attention != "decode":  # the target's own attention, as the static path ran before
            aux_layer_ids = engine.runner.aux_layer_ids
            engine.runner.close()
            engine.runner = StaticTargetRunner(model, aux_layer_ids, (1, width),
                                               decode_attention=False)
        prompts = dev_length_prompts(3 * args.prompts)
        cfg = BenchmarkConfig(num_prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                              warmup_prompts=1)

        def measured(prompts: list[list[int]]) -> tuple[dict, list]:
            plain = plain_decoding(engine, prompts, cfg, None)
            return measure_embedded(engine, prompts, cfg, None, variant, plain)[0], plain

        started = time.perf_counter()
        measured(prompts[:1])  # compile and capture, other variants still on the GPU
        row = {"variant": variant, "device": torch.cuda.get_device_name()
               if args.device == "cuda" else "cpu", "warm_s": round(time.perf_counter() - started)}
        with open(args.out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the GPU to this variant alone
            summary, plain = measured(prompts)
    row.update({key: summary[key] for key in ("ms_per_plain_token", "ms_per_round",
                                               "identical_outputs")})
    row.update({"width": width, "steps": engine.steps_ran(),
                "attention": model.config._attn_implementation,
                "plain_tokens": [g.tokens for g in plain]})
    return row


def summarize(paths: list[Path]) -> dict:
    """Per variant over the runs in `paths`: each figure's runs (low to high), and how many
    prompts' plain tokens equal those of the first run of SDPA in the same dtype."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    reference = {}
    for row in rows:
        dtype = row["variant"].rpartition(":")[0] or "float32"
        if row["variant"].endswith("sdpa"):
            reference.setdefault(dtype, row["plain_tokens"])
    summary = {}
    for variant in dict.fromkeys(row["variant"] for row in rows):
        runs = [row for row in rows if row["variant"] == variant]
        dtype = variant.rpartition(":")[0] or "float32"
        same = [sum(a == b for a, b in zip(row["plain_tokens"], reference[dtype], strict=True))
                for row in runs]
        summary[variant] = {
            "device": runs[0]["device"], "runs": len(runs),
            "ms_per_plain_token": sorted(row["ms_per_plain_token"] for row in runs),
            "ms_per_round": {part: sorted(row["ms_per_round"][part] for row in runs)
                             for part in ("draft", "verify", "other")},
            "plain_tokens_as_sdpa": [f"{n}/{len(reference[dtype])}" for n in same]}
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=2, help="of each dev set's lengths")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="JSONL",
                        help="no run: fold earlier runs' lines into --out (JSON)")
    args = parser.parse_args(argv)
    if args.summarize:
        args.out.write_text(json.dumps(summarize(args.summarize), indent=1) + "\n")
        return
    if args.one:
        row = measure(args.one, args)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    common = ["--device", args.device, "--prompts", str(args.prompts), "--max-new-tokens",
              str(args.max_new_tokens), "--out", str(args.out)]
    # A list, not a dict: a variant named twice is two runs.
    children = [(v, subprocess.Popen([sys.executable, __file__, "--one", v, *common]))
                for v in args.variants]
    for variant, child in children:
        print(f"{variant}: rc {child.wait()}", flush=True)
    for line in args.out.read_text().splitlines():
        row = json.loads(line)
        print(json.dumps({k: v for k, v in row.items() if k != "plain_tokens"}), flush=True)


if __name__ == "__main__":
    main()
