"""What a prompt of a length not seen before costs an eager forward (issue 46).

In the bf16 benchmark of 2026-12-06 (lease `f`), a prompt whose length the process had not
met took about 45 ms more in the target's eager prefill (23 against 68-73 ms) and up to 0.8 s
more in the drafter's first round, where float32 showed no such cost. The suspect is SDPA's
cuDNN backend, which builds an execution plan for each new shape. This times the eager
prefill of the static path (StaticTargetRunner.forward, as the benchmark stage runs a prompt)
over SmolLM2-shaped random weights (gpu_speculative/random_parts.py) at new and at repeated
lengths, with SDPA as it comes, without cuDNN (torch.nn.attention.sdpa_kernel), and as the
static path runs a prompt since: padded to a width captured when the cache was made
(`captured`, without cuDNN as every decoder runs), taking turns, one JSON line per forward:

    python benchmarks/gpu_speculative/new_shape_cost.py --device cuda --out OUT.jsonl
    python benchmarks/gpu_speculative/new_shape_cost.py --device cpu --lengths 4 \\
        --out /tmp/shapes.jsonl   # a check here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_parts import AUX_LAYER_IDS, smollm2_shaped_target  # noqa: E402

from draftsmith.serve.embedded import StaticTargetRunner  # noqa: E402

WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


ATTENTIONS = ("sdpa", "without cudnn", "captured")


def timed_prefill(runner: StaticTargetRunner, length: int, attention: str) -> float:
    """Seconds for one eager forward of a `length`-token prompt into an emptied static cache
    of 512 slots, the GPU's work included."""
    ids = list(range(1000, 1000 + length))
    cache = runner.new_cache(512)
    context = nullcontext() if attention == "sdpa" else sdpa_kernel(WITHOUT_CUDNN)
    sync = torch.cuda.synchronize if runner.model.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    with context:
        runner.forward(ids, cache, last_only=True)  # as a prompt: its last logits
    sync()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=int, default=20,
                        help="new lengths per attention (each then timed again, seen)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model = smollm2_shaped_target(args.device).to(getattr(torch, args.dtype))
    eager = StaticTargetRunner(model, AUX_LAYER_IDS, compile_steps=False)  # prompts until now
    # the runner the engine makes; its decode steps are never called here, so never compiled
    captured = StaticTargetRunner(model, AUX_LAYER_IDS, step_widths=(1, 4), compile_steps=True)
    runners = {"sdpa": eager, "without cudnn": eager, "captured": captured}
    for attention in ATTENTIONS:  # kernels loaded, widths captured, outside the timings
        timed_prefill(runners[attention], 16, attention)
    rows = []
    # The attentions take turns; each gets lengths of its own, so each is new to it.
    for i in range(args.lengths):
        for j, attention in enumerate(ATTENTIONS):
            length = 40 + len(ATTENTIONS) * i + j
            for seen in ("new", "seen"):
                rows.append({"attention": attention, "length": length, "shape": seen,
                             "ms": round(1000 * timed_prefill(runners[attention], length,
                                                              attention), 3),
                             "dtype": args.dtype,
                             "device": torch.cuda.get_device_name() if args.device == "cuda"
                             else args.device})
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for attention in ATTENTIONS:
        for seen in ("new", "seen"):
            times = [r["ms"] for r in rows if r["attention"] == attention and r["shape"] == seen]
            print(json.dumps({"attention": attention, "shape": seen, "forwards": len(times),
                              "median_ms": round(statistics.median(times), 2),
                              "max_ms": max(times)}))


if __name__ == "__main__":
    main()
