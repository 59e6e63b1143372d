"""The benchmark stage's embedded measurement (plain_decoding, measure_embedded,
measure_batched: the functions `draftsmith run` calls) on SmolLM2's shapes with random weights
(random_parts.py), so it runs on a lent GPU with nothing carried but the repository. What it
gives is the engine's side of issue 46: ms per plain token, a round's draft, verify and other
ms, at batch 1 and the --batch-sizes, and whether speculative outputs equal plain decoding.
A random drafter accepts almost nothing, so its acceptance and speedup are not a drafter's.
`--topk 4 --draft-tokens 8` measures a tree's rounds instead (batch 1: the batched decoder
drafts chains). `--target builtin:smollm2-135m-instruct --drafter DIR` runs a real target and
exported drafter on the suite's test prompts instead: real acceptance, so accepted paths are
kept (a random drafter's never are).

    python benchmarks/gpu_speculative/engine_costs.py --out results/gpu_speculative/costs.jsonl
    # here: a check of the script
    python benchmarks/gpu_speculative/engine_costs.py --device cpu --prompts 2 \\
        --max-new-tokens 8 --batch-sizes 2 --out /tmp/costs.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_parts import (  # noqa: E402
    dev_length_prompts,
    random_eagle3_drafter,
    smollm2_shaped_target,
)

from draftsmith.bench.benchmark import (  # noqa: E402
    benchmark_prompts,
    measure_batched,
    measure_embedded,
    plain_decoding,
)
from draftsmith.config import BenchmarkConfig, TargetConfig  # noqa: E402
from draftsmith.serve import embedded, row_topk  # noqa: E402
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine  # noqa: E402
from draftsmith.target import load_target_model, load_tokenizer, resolve_target  # noqa: E402

KEPT = ("acceptance_length", "identical_outputs", "ms_per_plain_token", "ms_per_round",
        "ms_per_prompt", "speedup", "speedup_limit", "greedy_tokens_per_s",
        "speculative_tokens_per_s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--cache", default="static", choices=["static", "dynamic"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--topk", type=int, default=1, help="deploy.eagle_topk: >1 a tree")
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="deploy.num_draft_tokens (default: a chain's 4, a tree's most)")
    parser.add_argument("--torch-topk", action="store_true",
                        help="a tree's top k by torch operations, not the Triton kernel")
    parser.add_argument("--eager-verdicts", action="store_true",
                        help="a tree's verdicts eager, not one captured step")
    parser.add_argument("--captured-steps-on-cpu", action="store_true",
                        help="on the CPU, the steps CUDA compiles and captures, compiled and "
                        "replayed without graphs (to find a CUDA-path fault where tests run)")
    parser.add_argument("--target", default=None,
                        help="a target (target.model) instead of random SmolLM2-shaped weights")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="an exported drafter directory for --target")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.captured_steps_on_cpu:
        embedded.cuda_graphs = lambda device: True  # the engine asks this module's name
    if args.torch_topk:  # what kernel_works answers where the kernel failed its trial
        row_topk._kernel_works = False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # progress, ETA
    if args.target:
        model, engine, prompts = real_parts(args)
    else:
        model = smollm2_shaped_target(args.device).to(getattr(torch, args.dtype))
        engine = EmbeddedSpeculativeEngine(model, random_eagle3_drafter(model), num_steps=3,
                                           topk=args.topk, num_draft_tokens=args.draft_tokens,
                                           cache=args.cache)
        prompts = dev_length_prompts(args.prompts)
    if args.eager_verdicts:
        engine.tree_verdicts = engine.tree_verdict_steps
    batch_sizes = [] if engine.is_tree else args.batch_sizes
    cfg = BenchmarkConfig(num_prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                          warmup_prompts=1)
    plain = plain_decoding(engine, prompts, cfg, None)
    label = "drafter" if args.target else "random drafter"
    batch_one, _ = measure_embedded(engine, prompts, cfg, None, label, plain)
    rows = [{"batch": 1, **{k: batch_one.get(k) for k in KEPT}}]
    rows += [{k: measured.get(k) for k in ("batch", *KEPT)}
             for measured in (measure_batched(engine, prompts, cfg, None, size,
                                                              [run.tokens for run in plain])
                              for size in batch_sizes)]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            row.update(device=device, cache=engine.cache_kind, steps=engine.steps_ran(),
                       topk=engine.topk, num_draft_tokens=engine.num_draft_tokens,
                       weights=f"{args.target} + {args.drafter}" if args.target else "random",
                       dtype=args.dtype,
                       prompts=len(prompts), max_new_tokens=args.max_new_tokens)
            if engine.is_tree:  # which of the tree's CUDA-only paths ran
                row.update(tree_topk="triton" if row_topk.kernel_works(engine.device)
                           else "torch", tree_verdicts="eager" if args.eager_verdicts
                           else "the engine's (captured on CUDA)")
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


def real_parts(args: argparse.Namespace):
    """The target, an engine over the exported drafter, and the suite's test prompts
    (--prompts of each of chat, code and math)."""
    if args.drafter is None:
        raise SystemExit("--target needs --drafter: an exported drafter's directory")
    descriptor = resolve_target(TargetConfig(model=args.target))
    model = load_target_model(descriptor.path, args.device, args.dtype)
    engine = EmbeddedSpeculativeEngine.load(model, args.drafter, 3, topk=args.topk,
                                            num_draft_tokens=args.draft_tokens,
                                            cache=args.cache)
    suite = BenchmarkConfig.model_validate(
        {"suite": ["chat", "code", "math"], "splits": ["test"],
         "prompts_per_set": args.prompts})
    prompts, _ = benchmark_prompts(suite, None, load_tokenizer(descriptor))
    return model, engine, prompts


if __name__ == "__main__":
    main()
