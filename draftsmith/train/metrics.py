"""Training metrics kept as counts (summable across batches and ranks), divided only at the end.

Per TTT step j over loss-masked positions:
    full_acc_j = positions where steps 0..j were all right / positions
    cond_acc_j = positions where steps 0..j were all right / positions where 0..j-1 were right
    tau        = 1 + sum_j full_acc_j   (simulated acceptance length, greedy chain drafting)

and, on validation, the acceptance length greedy chain decoding would measure, replayed over the
stored answers (tokens per verify round). Tau averages over every answer position; decoding
only drafts from where a round starts, which is more often just after a hard token (a run of
easy tokens is crossed in one round and counted once), so the replay comes out below tau. On
the quality benchmark it equals the embedded engine's measured acceptance prompt for prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepCounts:
    steps: int
    # Greedy chain decoding replayed over the answers (validation only): rounds and tokens.
    replay_rounds: float = 0.0
    replay_tokens: float = 0.0
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
        self.replay_rounds += other.replay_rounds
        self.replay_tokens += other.replay_tokens

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

    def flat(self) -> torch.Tensor:
        """Every count in one float64 vector [5*S + 2], the replay's rounds and tokens last:
        one all-reduce sums them all."""
        replay = torch.tensor([self.replay_rounds, self.replay_tokens], dtype=torch.float64)
        return torch.cat([self.as_tensor().flatten(), replay])  # [5*S + 2]

    @classmethod
    def from_flat(cls, t: torch.Tensor, steps: int) -> StepCounts:
        """The inverse of flat."""
        counts = cls.from_tensor(t[:5 * steps].view(5, steps))
        counts.replay_rounds, counts.replay_tokens = float(t[-2]), float(t[-1])
        return counts

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
        if self.replay_rounds:
            out["acceptance_replayed"] = self.replay_tokens / self.replay_rounds
        return out


def replay_chain_decoding(runs: torch.Tensor, loss_mask: torch.Tensor,
                          document_ids: torch.Tensor) -> tuple[int, int]:
    """Greedy chain decoding of every answer of a packed row, replayed: (verify rounds, tokens
    they produced). runs [T]: at anchor t, how many drafts in a row the target accepts (0 to
    the TTT steps); loss_mask, document_ids [T]. An answer is a run of loss-masked tokens of one
    document after at least one prompt token; its first token comes from the prompt's forward.
    A round at anchor p (the last known token is p + 1) adds the runs[p] accepted drafts and the
    target's own next token, and the next round's anchor is p + runs[p] + 1."""
    runs_, mask, docs = runs.long().tolist(), loss_mask.bool().tolist(), document_ids.tolist()
    rounds = tokens = 0
    t, T = 0, len(mask)
    while t < T:
        if not mask[t]:
            t += 1
            continue
        first = t
        while t + 1 < T and mask[t + 1] and docs[t + 1] == docs[first]:
            t += 1
        last, t = t, t + 1
        if first == 0 or docs[first - 1] != docs[first]:
            continue  # no prompt before it: nothing a decoder would have answered
        p = first - 1
        while p + 1 < last:
            rounds += 1
            tokens += min(1 + runs_[p], last - (p + 1))  # the answer's end cuts the last round
            p += 1 + runs_[p]
    return rounds, tokens
