"""Where a bf16 speculative decoder's output leaves plain decoding, and how close the target's
own top two logits are there: a divergence at a gap of a bf16 step or two is rounding (a wider
verify forward sums in another order), not a fault. Float32 must be identical; bf16 is a share.

    python benchmarks/gpu_speculative/bf16_divergence.py --drafter DIR --topk 4 --draft-tokens 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.bench.benchmark import benchmark_prompts  # noqa: E402
from draftsmith.config import BenchmarkConfig, TargetConfig  # noqa: E402
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, plain_generate  # noqa: E402
from draftsmith.target import load_target_model, load_tokenizer, resolve_target  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--drafter", type=Path, required=True, help="an exported drafter")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", default="static", choices=["static", "dynamic"],
                        help="the target cache (static: CUDA's default path)")
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--draft-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4, help="of each of chat, code, math")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    descriptor = resolve_target(TargetConfig(model=args.target))
    model = load_target_model(descriptor.path, args.device, "bfloat16")
    engine = EmbeddedSpeculativeEngine.load(model, args.drafter, 3, topk=args.topk,
                                            num_draft_tokens=args.draft_tokens,
                                            cache=args.cache)
    suite = BenchmarkConfig.model_validate({"suite": ["chat", "code", "math"],
                                            "splits": ["test"], "prompts_per_set": args.prompts})
    prompts, _ = benchmark_prompts(suite, None, load_tokenizer(descriptor))
    every_gap = []
    for prompt in prompts:
        plain = plain_generate(engine.runner, prompt, args.max_new_tokens, None).tokens
        speculative = engine.generate(prompt, args.max_new_tokens, None).tokens
        with torch.no_grad():  # the target's logits before each plain token
            ids = torch.tensor([prompt + plain], device=model.device)  # [1, P+N]
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()  # [N, V]
        top = logits.topk(2, -1).values  # [N, 2]
        gaps = (top[:, 0] - top[:, 1]).tolist()  # [N]
        every_gap += gaps
        pairs = zip(plain, speculative, strict=False)  # one may stop at eos sooner
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is None and len(plain) != len(speculative):
            first = min(len(plain), len(speculative))
        if first is not None and first >= len(gaps):  # the plain side stopped there
            first = len(gaps) - 1
        print(json.dumps({"prompt_tokens": len(prompt), "identical": first is None,
                          "first_difference": first,
                          "gap_there": None if first is None else gaps[first],
                          "top_logit_there": None if first is None else top[first, 0].item()}))
    gaps = torch.tensor(every_gap)  # [all positions]
    print(json.dumps({"positions": len(every_gap), "median_gap": gaps.median().item(),
                      "share_of_gaps_at_most_0.125": round((gaps <= 0.125).float().mean().item(),
                                                           4)}))


if __name__ == "__main__":
    main()
