"""Operations the online prefill dispatches for one training row of short samples, before and
after the batched gather and argmax (commit 5c7ad13), counted on a CPU.

On the H200 the general recipe's online training ran at 1.2-1.5 steps/s with the GPU 16% busy:
a row of ~160 short chat answers went through the target 8 samples at a time, and each sample
took its argmax, slices and casts apart. Every dispatched operation is a kernel launch on a
GPU, so their count per row is what the change is meant to cut; the GPU's step time itself is
measured on the next lease, not here.

    python benchmarks/online_prefill_ops.py --out benchmarks/results/online_prefill/ops.json

The previous implementation is read from git (`--before`), not copied.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftsmith.config import ExtractConfig, TargetConfig  # noqa: E402
from draftsmith.tiny_target import build_tiny_target  # noqa: E402
from draftsmith.train import online  # noqa: E402


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def online_module_at(commit: str) -> types.ModuleType:
    """draftsmith/train/online.py as it was at `commit`, as a module of its own."""
    show = ["git", "-C", str(REPO), "show", f"{commit}:draftsmith/train/online.py"]
    source = subprocess.run(show, check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(f"online_at_{commit}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"online.py@{commit}", "exec"), module.__dict__)  # noqa: S102
    return module


def count(module, target_dir: Path, samples, batch_size: int) -> dict:
    extract = ExtractConfig(batch_size=batch_size, batch_tokens=32768, dtype="bfloat16")
    runner = module.OnlineTarget(target_dir, TargetConfig(model=str(target_dir)), extract,
                                 [1, 14, 26], torch.device("cpu"))
    runner.samples(samples[:4])  # warm-up
    with OpCounter() as counter:
        out = runner.samples(samples)
    return {"batch_size": batch_size, "ops": sum(counter.ops.values()),
            "argmax_calls": counter.ops["aten.argmax"], "linear_calls": counter.ops["aten.mm"]
            + counter.ops["aten.addmm"] + counter.ops["aten.linear"] + counter.ops["aten.matmul"],
            "samples": len(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="c20e4f5", help="a commit before the change")
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    # SmolLM2's depth (30 layers) at a tiny width: a forward's operation count follows depth.
    target_dir = build_tiny_target(Path(tempfile.mkdtemp()) / "target", train_steps=0,
                                   vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=30)
    lengths = torch.randint(60, 400, (args.samples,)).tolist()  # the general recipe: ~200
    samples = [online.TokenSample(f"s{i}", torch.randint(0, 512, (n,)),
                                  torch.ones(n, dtype=torch.uint8))
               for i, n in enumerate(lengths)]
    before = online_module_at(args.before)
    rows = [{"code": args.before, **count(before, target_dir, samples, 8)},
            {"code": "now", **count(online, target_dir, samples, 8)},
            {"code": "now", **count(online, target_dir, samples, 256)}]
    result = {"samples": args.samples, "mean_length": sum(lengths) / len(lengths),
              "rows": rows, "command": " ".join(sys.argv)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
