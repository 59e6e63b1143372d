"""How many operations the host dispatches per speculative round and per plain token on the
embedded engine's static path, outside its captured steps (issue 46). On a GPU each one is a
launch or at least a trip through the dispatcher while the GPU may wait; a captured step counts
as one replay plus one copy per input it does not read in place. Counted with a
TorchDispatchMode on the CPU, where CapturedStep replays over the same buffers as on CUDA, over
SmolLM2-shaped random parts (random_parts.py): the count is the same on any device. The
figure is the difference between generating 48 and 24 tokens, divided by the extra rounds, so
the prompt's forward drops out.

    python benchmarks/gpu_speculative/host_ops.py \
        --out benchmarks/results/gpu_speculative/host_ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_parts import random_eagle3_drafter, smollm2_shaped_target  # noqa: E402

from draftsmith import compiling  # noqa: E402
from draftsmith.serve import embedded  # noqa: E402
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, plain_generate  # noqa: E402


class Counting(TorchDispatchMode):
    """Counts aten operations, except inside a captured step, which counts as its replay
    and the copies into its input buffers."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def counted_captures(mode: Counting) -> None:
    replay = compiling.CapturedStep.__call__

    def call(self, *args, **kwargs):
        leaves = tree_flatten((args, kwargs))[0]
        mode.inside = True
        try:
            return replay(self, *args, **kwargs)
        finally:
            mode.inside = False
            mode.counts["<graph replay>"] += 1
            mode.counts["<input buffer copy>"] += sum(
                isinstance(x, torch.Tensor) and not compiling.is_fixed(x) for x in leaves)

    compiling.CapturedStep.__call__ = call


def per_extra(mode: Counting, run, short: int, long: int) -> tuple[dict, float]:
    """Operations per extra round (or token) between a run of `short` and one of `long`
    new tokens."""
    counts, rounds = [], []
    for tokens in (short, long):
        mode.counts.clear()
        with mode:
            rounds.append(run(tokens).verify_rounds)
        counts.append(mode.counts.copy())
    extra = counts[1] - counts[0]
    per = rounds[1] - rounds[0]
    return {op: round(n / per, 2) for op, n in extra.most_common()}, sum(extra.values()) / per


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    # The static path as CUDA runs it: steps captured (here, replayed without graphs), not
    # compiled (the count is the host's, and inductor's CPU build takes minutes).
    embedded.cuda_graphs = lambda device: True
    embedded.compiled_once = lambda fn, **_options: fn
    mode = Counting()
    counted_captures(mode)
    model = smollm2_shaped_target("cpu")
    engine = EmbeddedSpeculativeEngine(model, random_eagle3_drafter(model), num_steps=3,
                                       cache="static")
    prompt = list(range(1000, 1060))
    engine.generate(prompt, 8, None)  # captures made before counting
    plain_generate(engine.runner, prompt, 8, None)
    round_ops, round_total = per_extra(
        mode, lambda tokens: engine.generate(prompt, tokens, None), 24, 48)
    plain_ops, plain_total = per_extra(
        mode, lambda tokens: plain_generate(engine.runner, prompt, tokens, None), 24, 48)
    result = {"per_round": round(round_total, 2), "per_plain_token": round(plain_total, 2),
              "round_operations": round_ops, "plain_operations": plain_ops,
              "num_steps": 3, "steps_ran": engine.steps_ran()}
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
