"""Which samples go into which shard, and which samples share a forward pass.

Both decisions are made from the data alone, before any compute: a rerun after a crash, or
another rank of a data-parallel world, computes any shard from exactly the same batches, so
the shard's bytes do not depend on who computed it or when.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.extract.store import ShardSpec


def plan_shards(split: str, rows: list[dict], shard_tokens: int) -> list[ShardSpec]:
    """Samples sorted by (length, id), cut into shards of at least `shard_tokens` tokens (the
    last may be smaller). Sorting by length is the bucketing: neighbours have similar lengths,
    so batches drawn from one shard pad little."""
    ordered = sorted(rows, key=lambda r: (len(r["input_ids"]), r["id"]))
    specs: list[ShardSpec] = []
    ids: list[str] = []
    tokens: list[int] = []
    for row in ordered:
        ids.append(row["id"])
        tokens.append(len(row["input_ids"]))
        if sum(tokens) >= shard_tokens:
            specs.append(ShardSpec(split, len(specs), tuple(ids), tuple(tokens)))
            ids, tokens = [], []
    if ids:
        specs.append(ShardSpec(split, len(specs), tuple(ids), tuple(tokens)))
    return specs


@dataclass(frozen=True)
class BatchPlan:
    batches: list[list[int]]  # positions within the shard
    real_tokens: int
    padded_tokens: int

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


def plan_batches(lengths: list[int] | tuple[int, ...], batch_size: int,
                 batch_tokens: int | None) -> BatchPlan:
    """Consecutive samples (already sorted by length) grouped while the batch has at most
    `batch_size` samples and its padded size (samples x longest) stays within `batch_tokens`.
    A sample longer than `batch_tokens` runs alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    padded = 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        fits = len(current) < batch_size and (
            batch_tokens is None or grown * (len(current) + 1) <= batch_tokens)
        if current and not fits:
            batches.append(current)
            padded += longest * len(current)
            current, grown = [], n
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
        padded += longest * len(current)
    return BatchPlan(batches, sum(lengths), padded)
