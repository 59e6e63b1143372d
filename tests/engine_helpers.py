"""Helpers only the tests call, kept out of the engine: each is a thin form of what the engine
does in its own way (the trainer fuses lm_head with the loss, extraction writes shards it
planned up front, the trainer packs through plan_rows and concat_row)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.extract.store import Sample, ShardSpec, shard_tensors, write_shard
from draftsmith.model.eagle3.loss import row_loss_on_device
from draftsmith.model.eagle3.model import Eagle3Drafter
from draftsmith.train.loss import TargetHead
from draftsmith.train.metrics import StepCounts
from draftsmith.train.packing import PackedRow, concat_row, plan_rows


def forward_ttt(drafter: Eagle3Drafter, input_ids, aux, position_ids, document_ids,
                steps: int, attention: str = "sdpa") -> list[torch.Tensor]:
    """Unrolled TTT over packed rows with lm_head applied: logits per step, each [B, T, D],
    where step j at anchor t predicts token t+j+2."""
    return [drafter.lm_head(h) for h in drafter.forward_ttt_hidden(
        input_ids, aux, position_ids, document_ids, steps, attention)]


def row_loss(drafter: Eagle3Drafter, row: PackedRow, head: TargetHead | torch.Tensor,
             steps: int, step_weights: float | list[float], device: str,
             attention: str = "sdpa", aux_noise_std: float = 0.0, noise_seed: int = 0,
             chunk_tokens: int = 2048) -> tuple[torch.Tensor, StepCounts]:
    """The trainer's row loss with its counts read back as StepCounts."""
    loss, counts = row_loss_on_device(drafter, row, head, steps, step_weights, device,
                                      attention, aux_noise_std, noise_seed, chunk_tokens)
    return loss, StepCounts.from_tensor(counts)


def count_step(counts: StepCounts, j: int, loss_sum: torch.Tensor, loss_positions: int,
               mask: torch.Tensor, chain_right: torch.Tensor, prefix_right: torch.Tensor) -> None:
    """Add one TTT step's counts by hand. mask, chain_right, prefix_right: bool [...], same
    shape."""
    counts.loss_sum[j] += loss_sum.detach().double().cpu()
    counts.loss_positions[j] += loss_positions
    counts.positions[j] += mask.sum().item()
    counts.chain_correct[j] += (mask & chain_right).sum().item()
    counts.prefix_correct[j] += (mask & prefix_right).sum().item()


def pack(samples: list[Sample], row_tokens: int) -> list[PackedRow]:
    """First-fit in the given order; a sample longer than a row is cut to the row size."""
    return [concat_row(row, row_tokens) for row in plan_rows(samples, row_tokens)]


class ShardWriter:
    """Builds a store sample by sample: a shard is cut whenever `shard_tokens` tokens are
    pending (extraction plans its shards up front and writes them with write_shard too)."""

    def __init__(self, root: str | Path, split: str, shard_tokens: int):
        self.root, self.split, self.shard_tokens = Path(root), split, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._pending: list[Sample] = []

    def add(self, sample: Sample) -> None:
        self._pending.append(sample)
        if sum(len(s.input_ids) for s in self._pending) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        spec = ShardSpec(self.split, len(self.shards), tuple(s.id for s in self._pending),
                         tuple(len(s.input_ids) for s in self._pending))
        self.shards.append(write_shard(self.root, spec, shard_tensors(self._pending)))
        self._pending = []

    def close(self) -> list[dict[str, Any]]:
        self.flush()
        return self.shards
