"""Where in-process generation spends its time on a GPU (issue 27: the static cache stopped
at about 44K tokens/s, at 2,048 and at 4,096 rows alike; continuous batching ran at 3K).

Three parts, one JSON line each (and the profiler's tables in the log):
1. `static`: the stage's path (StaticCache, compiled decode step) at --batch rows. One batch
   warms it up, the next is profiled: GPU busy time against wall time, the kernels that take
   it, and how many decode steps ran for rows that had already ended their turn.
2. `generate_batch` with its defaults, and 3. with its compile level 3 and CUDA graphs: the
   attention implementation it picked, tokens/s, and answers identical to the static path's.

    python benchmarks/generation_profile.py --out benchmarks/results/generation_speed/profile.jsonl
    python benchmarks/generation_profile.py --smoke --out /tmp/profile.jsonl   # CPU, tiny target
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # draftsmith, and generation_speed beside it
from generation_speed import sorted_prompts  # noqa: E402

from draftsmith.config import TargetConfig  # noqa: E402
from draftsmith.generate.transformers_backend import (  # noqa: E402
    TransformersGenerator,
    cache_length,
)
from draftsmith.target import load_target_model, load_tokenizer, resolve_target  # noqa: E402

log = logging.getLogger("generation_profile")


def write(out: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_static(model, tokenizer, prompts, batch, max_new_tokens, device, out) -> list:
    """Answers of two batches; the second is profiled."""
    from torch.profiler import ProfilerActivity, profile

    generator = TransformersGenerator(model, tokenizer, max_new_tokens=max_new_tokens,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static",
                                      batch_size=batch,
                                      longest_prompt=max(len(p) for p in prompts))
    began = time.perf_counter()
    answers = [c.token_ids for c in generator.complete_tokens(prompts[:batch])]
    synchronize(device)
    warm_s = time.perf_counter() - began
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        second = [c.token_ids for c in generator.complete_tokens(prompts[batch:2 * batch])]
        synchronize(device)
        wall = time.perf_counter() - began
    answers += second
    events = prof.key_averages()
    # Kernels only: an op's device time is its kernels' again (the first run, 2026-12-03,
    # summed both and reported a busy share of 1.68).
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:5]
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    log.info("static, batch %d, profiled batch:\n%s", batch, events.table(sort_by=sort,
                                                                          row_limit=25))
    tokens = sum(len(a) for a in second)
    steps = max(len(a) for a in second)
    write(out, {"part": "static", "batch": batch, "warm_batch_s": round(warm_s, 1),
                "profiled_batch_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
                "gpu_busy_share": round(gpu_us / 1e6 / wall, 3) if gpu_us else None,
                "top_kernels_s": {e.key[:80]: round(e.self_device_time_total / 1e6, 3)
                                  for e in top},
                "decode_steps": steps, "completion_tokens": tokens,
                # A padded batch decodes every row for its longest answer.
                "row_steps_used_share": round(tokens / (steps * len(second)), 3),
                "cache_length": cache_length(generator.longest_prompt, max_new_tokens)})
    return answers


def run_generate_batch(model, tokenizer, prompts, max_new_tokens, settings: dict, name: str,
                       reference: list, out: Path, device: str) -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    began = time.perf_counter()
    try:
        results = model.generate_batch(inputs=prompts, generation_config=config,
                                       continuous_batching_config=ContinuousBatchingConfig(
                                           **settings))
    except Exception as err:  # noqa: BLE001 - recorded: the next part still runs
        write(out, {"part": name, "settings": settings,
                    "error": f"{type(err).__name__}: {str(err)[:300]}"})
        return
    synchronize(device)
    seconds = time.perf_counter() - began
    ordered = [results[k] for k in sorted(results, key=lambda k: int(k.rsplit("_", 1)[-1]))]
    answers = [list(r.generated_tokens) for r in ordered]
    same = [a == b for a, b in zip(answers, reference, strict=False)]
    write(out, {"part": name, "settings": settings, "prompts": len(prompts),
                "seconds_with_warmup": round(seconds, 1),
                "tokens_per_s_with_warmup": round(sum(map(len, answers)) / seconds, 1),
                "attn_implementation": model.config._attn_implementation,
                "identical_to_static": {"identical": sum(same), "compared": len(same)}})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--skip-generate-batch", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = "cpu" if args.smoke else "cuda"
    batch = 4 if args.smoke else args.batch
    max_new = 8 if args.smoke else args.max_new_tokens
    target = resolve_target(TargetConfig(model="builtin:tiny" if args.smoke
                                         else "builtin:smollm2-135m-instruct"))
    tokenizer = load_tokenizer(target)
    # Two batches over the whole length range of the generation benchmark's prompts.
    prompts = sorted_prompts(tokenizer, 4 * batch)[::2][:2 * batch]
    dtype = "float32" if args.smoke else "bfloat16"
    model = load_target_model(target.path, device, dtype)
    reference = profile_static(model, tokenizer, prompts, batch, max_new, device, args.out)
    if args.skip_generate_batch:
        return
    fresh = load_target_model(target.path, device, dtype)  # the static path changed its attention
    run_generate_batch(fresh, tokenizer, prompts, max_new, {}, "generate_batch-defaults",
                       reference, args.out, device)
    if device == "cuda":
        run_generate_batch(fresh, tokenizer, prompts, max_new,
                           {"default_compile_level": 3, "use_cuda_graph": True,
                            "max_requests_per_batch": batch},
                           "generate_batch-compiled", reference, args.out, device)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
