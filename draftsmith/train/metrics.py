"""Training metrics kept as counts (summable across batches and ranks), divided only at the end.

Per TTT step j over loss-masked positions:
    full_acc_j = positions where steps 0..j were all right / positions
    cond_acc_j = positions where steps 0..j were all right / positions where 0..j-1 were right
    tau        = 1 + sum_j full_acc_j   (simulated acceptance length, greedy chain drafting)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepCounts:
    steps: int
    loss_sum: torch.Tensor = field(init=False)  # [S] summed per-position loss
    loss_positions: torch.Tensor = field(init=False)  # [S] positions that carried a loss
    positions: torch.Tensor = field(init=False)  # [S] loss-masked positions
    chain_correct: torch.Tensor = field(init=False)  # [S] positions with steps 0..j all right
    prefix_correct: torch.Tensor = field(init=False)  # [S] positions with steps 0..j-1 all right

    def __post_init__(self):
        zeros = lambda: torch.zeros(self.steps, dtype=torch.float64)  # noqa: E731
        self.loss_sum, self.loss_positions, self.positions = zeros(), zeros(), zeros()
        self.chain_correct, self.prefix_correct = zeros(), zeros()

    def add(self, other: StepCounts) -> None:
        for name in ("loss_sum", "loss_positions", "positions", "chain_correct", "prefix_correct"):
            getattr(self, name).add_(getattr(other, name))

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepCounts:
        """The inverse of as_tensor: t [5, S] (loss_sum, loss_positions, positions,
        chain_correct, prefix_correct)."""
        counts = cls(t.shape[1])
        t = t.detach().double().cpu()
        counts.loss_sum, counts.loss_positions, counts.positions = t[0], t[1], t[2]
        counts.chain_correct, counts.prefix_correct = t[3], t[4]
        return counts

    def as_tensor(self) -> torch.Tensor:
        return torch.stack([self.loss_sum, self.loss_positions, self.positions,
                            self.chain_correct, self.prefix_correct])  # [5, S]

    def summary(self) -> dict[str, float]:
        safe = lambda n, d: (n / d).item() if d > 0 else 0.0  # noqa: E731
        out: dict[str, float] = {}
        tau = 1.0
        for j in range(self.steps):
            out[f"loss_{j}"] = safe(self.loss_sum[j], self.loss_positions[j])
            out[f"full_acc_{j}"] = safe(self.chain_correct[j], self.positions[j])
            out[f"cond_acc_{j}"] = safe(self.chain_correct[j], self.prefix_correct[j])
            tau += out[f"full_acc_{j}"]
        out["tau"] = tau
        return out


def count_step(counts: StepCounts, j: int, loss_sum: torch.Tensor, loss_positions: int,
               mask: torch.Tensor, chain_right: torch.Tensor, prefix_right: torch.Tensor) -> None:
    """mask, chain_right, prefix_right: bool [...], same shape."""
    counts.loss_sum[j] += loss_sum.detach().double().cpu()
    counts.loss_positions[j] += loss_positions
    counts.positions[j] += mask.sum().item()
    counts.chain_correct[j] += (mask & chain_right).sum().item()
    counts.prefix_correct[j] += (mask & prefix_right).sum().item()
