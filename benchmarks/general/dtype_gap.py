"""How often the target in bf16 (whose argmax online training teaches the drafter, as the
recipe's `extract.target_dtype: bfloat16` does) picks another next token than the target in
float32 (which the benchmark verifies against), over the float32 greedy continuations of the
suite's prompts; and how often float32's top two logits lie within 0.5 of each other (near
ties: positions a target is unsure of, which a drafter can hardly be sure of either).

    python benchmarks/general/dtype_gap.py --sets chat code math --split dev \\
        --out benchmarks/results/general/curve/dtype_gap.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.artifacts import atomic_write_json  # noqa: E402
from draftsmith.bench.benchmark import benchmark_prompts  # noqa: E402
from draftsmith.config import BenchmarkConfig, TargetConfig  # noqa: E402
from draftsmith.target import load_target_model, load_tokenizer, resolve_target  # noqa: E402

NEAR_TIE = 0.5


@torch.inference_mode()
def gap_of(prompts: list[list[int]], f32, bf16, max_new_tokens: int) -> dict:
    positions = differ = near = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])  # [1, P]
        seq = f32.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)  # [1, P+N]
        exact = f32(seq).logits[0, len(prompt) - 1:-1].float()  # [N, V]
        halved = bf16(seq).logits[0, len(prompt) - 1:-1].float()  # [N, V]
        top2 = exact.topk(2, dim=-1).values  # [N, 2]
        positions += exact.shape[0]
        differ += int((exact.argmax(-1) != halved.argmax(-1)).sum())
        near += int((top2[:, 0] - top2[:, 1] < NEAR_TIE).sum())
    return {"prompts": len(prompts), "positions": positions, "bf16_argmax_differs": differ,
            "differ_share": round(differ / positions, 4),
            f"float32_top2_within_{NEAR_TIE}": round(near / positions, 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["chat", "code", "math"])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    target = resolve_target(TargetConfig(model="builtin:smollm2-135m-instruct", dtype="float32"))
    tokenizer = load_tokenizer(target)
    f32 = load_target_model(target.path, dtype="float32").eval()
    bf16 = load_target_model(target.path, dtype="bfloat16").eval()
    rows = {}
    for name in args.sets:
        cfg = BenchmarkConfig(suite=[name], splits=[args.split],
                              max_new_tokens=args.max_new_tokens)
        prompts, _ = benchmark_prompts(cfg, None, tokenizer)
        rows[name] = gap_of(prompts, f32, bf16, args.max_new_tokens)
        print(name, rows[name], flush=True)
    given = sys.argv[1:] if argv is None else argv
    command = ["python", "benchmarks/general/dtype_gap.py", *given]
    atomic_write_json(args.out, {"command": " ".join(command), "split": args.split,
                                 "max_new_tokens": args.max_new_tokens, "sets": rows})


if __name__ == "__main__":
    main()
