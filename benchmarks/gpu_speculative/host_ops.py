"""How many operations the host dispatches per speculative round and per plain token on the
embedded engine's static path, outside its captured steps (issue 46). On a GPU each one is a
launch or at least a trip through the dispatcher while the GPU may wait; a captured step counts
as one replay plus one copy per input it does not read in place. Counted with a
TorchDispatchMode on the CPU, where CapturedStep replays over the same buffers as on CUDA, over
SmolLM2-shaped random parts (random_parts.py): the count is the same on any device. The
figure is the difference between generating 48 and 24 tokens, divided by the extra rounds, so
the prompt's forward drops out.

`after_read_per_round` counts only the operations between a round's read of the GPU (the
verdicts' `.tolist()`) and the replay of the next verify forward: while the host runs those,
the GPU has only what was enqueued before the read to work on. A round that drafts the next
one before it reads leaves the drafter's graph there; a round that drafts after it reads
leaves the GPU idle for its drafting's host part. `--batch N` counts the batched decoder's
rounds the same way (its prompts' read, before the first round's drafting, is one entry).
`--topk 4 --draft-tokens 8` counts a tree's rounds (its verify is the target's tree step).

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
from draftsmith.serve.embedded_batch import BatchedSpeculativeDecoder  # noqa: E402


class Counting(TorchDispatchMode):
    """Counts aten operations, except inside a captured step, which counts as its replay
    and the copies into its input buffers."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.inside = False
        self.after_read: int | None = None  # operations since the last read, until a verify
        self.after_reads: list[int] = []  # per read, those operations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.count(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, operation: str) -> None:
        self.counts[operation] += 1
        if self.after_read is not None:
            self.after_read += 1

    def read(self) -> None:
        self.after_read = 0

    def verify_replayed(self) -> None:
        if self.after_read is not None:
            self.after_reads.append(self.after_read)
        self.after_read = None


def counted_captures(mode: Counting, verify_steps: list) -> None:
    """Captured steps count as their replay and input copies; a replay of one of
    `verify_steps` (the target's) ends the count since the last read."""
    replay = compiling.CapturedStep.__call__

    def call(self, *args, **kwargs):
        leaves = tree_flatten((args, kwargs))[0]
        mode.inside = True
        try:
            return replay(self, *args, **kwargs)
        finally:
            mode.inside = False
            mode.count("<graph replay>")
            for _ in range(sum(isinstance(x, torch.Tensor) and not compiling.is_fixed(x)
                               for x in leaves)):
                mode.count("<input buffer copy>")
            if self in verify_steps:
                mode.verify_replayed()

    compiling.CapturedStep.__call__ = call
    tolist = torch.Tensor.tolist

    def read(tensor):
        if not mode.inside:
            mode.read()
        return tolist(tensor)

    torch.Tensor.tolist = read


def per_extra(mode: Counting, run, short: int, long: int) -> tuple[dict, float]:
    """Operations per extra round (or token) between a run of `short` and one of `long`
    new tokens. run(tokens) -> how many rounds (or tokens) it made."""
    counts, rounds = [], []
    for tokens in (short, long):
        mode.counts.clear()
        with mode:
            rounds.append(run(tokens))
        counts.append(mode.counts.copy())
    extra = counts[1] - counts[0]
    per = rounds[1] - rounds[0]
    return {op: round(n / per, 2) for op, n in extra.most_common()}, sum(extra.values()) / per


def after_reads(mode: Counting, run, tokens: int) -> list[int]:
    """Per read of a run of `tokens` new tokens, the operations until the next verify."""
    mode.after_reads, mode.after_read = [], None
    with mode:
        run(tokens)
    return mode.after_reads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=0,
                        help="also a batch of this many prompts (the batched decoder)")
    parser.add_argument("--topk", type=int, default=1, help="deploy.eagle_topk: >1 a tree")
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="deploy.num_draft_tokens (default: a chain's 4, a tree's most)")
    args = parser.parse_args(argv)
    # The static path as CUDA runs it: steps captured (here, replayed without graphs), not
    # compiled (the count is the host's, and inductor's CPU build takes minutes).
    embedded.cuda_graphs = lambda device: True
    embedded.compiled_once = lambda fn, **_options: fn
    mode = Counting()
    model = smollm2_shaped_target("cpu")
    engine = EmbeddedSpeculativeEngine(model, random_eagle3_drafter(model), num_steps=3,
                                       topk=args.topk, num_draft_tokens=args.draft_tokens,
                                       cache="static")
    counted_captures(mode, [engine.runner._captured.compiled,
                            engine.runner._tree_captured.compiled])
    prompt = list(range(1000, 1060))
    # captures made, and caches grown to the longest run (a tree's takes more slots), before
    # counting
    engine.generate(prompt, 48, None)
    plain_generate(engine.runner, prompt, 8, None)
    round_ops, round_total = per_extra(
        mode, lambda tokens: engine.generate(prompt, tokens, None).verify_rounds, 24, 48)
    plain_ops, plain_total = per_extra(
        mode, lambda tokens: plain_generate(engine.runner, prompt, tokens, None).verify_rounds,
        24, 48)
    speculative = after_reads(mode, lambda tokens: engine.generate(prompt, tokens, None), 48)
    result = {"per_round": round(round_total, 2), "per_plain_token": round(plain_total, 2),
              "after_read_per_round": collections.Counter(speculative).most_common(),
              "round_operations": round_ops, "plain_operations": plain_ops,
              "num_steps": 3, "topk": engine.topk, "num_draft_tokens": engine.num_draft_tokens,
              "steps_ran": engine.steps_ran()}
    if args.batch:
        decoder = BatchedSpeculativeDecoder(engine)
        prompts = [list(range(1000 + 7 * row, 1060 + 7 * row)) for row in range(args.batch)]
        decoder.generate(prompts, 8, None)  # captures made before counting
        batch_ops, batch_total = per_extra(
            mode, lambda tokens: decoder.generate(prompts, tokens, None).forwards, 24, 48)
        batch_reads = after_reads(mode, lambda tokens: decoder.generate(prompts, tokens, None),
                                  48)
        result["batch"] = {"rows": args.batch, "per_round": round(batch_total, 2),
                           "after_read_per_round": collections.Counter(batch_reads).most_common(),
                           "round_operations": batch_ops}
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
