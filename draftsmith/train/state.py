"""What a training run has done so far, typed: the position in the run (shared by the ranks),
each rank's metrics window, and the random-number states. A checkpoint holds all three, so a
resumed run continues exactly where the killed one stopped: the same rows, the same noise, the
same weights, and the same next metrics line."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """The position in the run; rank 0's copy is what the checkpoint keeps."""

    epoch: int = 0
    step_in_epoch: int = 0
    step: int = 0
    best_tau: float = -1.0
    best_epoch: int = -1
    history: list[dict] = field(default_factory=list)  # every metrics line so far
    trained: list[list[list[int]]] = field(default_factory=list)  # per rank: (epoch, row)

    @classmethod
    def start(cls, world: int) -> TrainState:
        return cls(trained=[[] for _ in range(world)])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        return cls(**{k: saved[k] for k in cls.__dataclass_fields__})

    @property
    def world(self) -> int:
        return len(self.trained)


class MetricsWindow:
    """This rank's counts since the last metrics line, kept on the device (reading them is a
    sync, done only when a line is logged), with the real tokens and the seconds they took."""

    def __init__(self, steps: int, device: torch.device):
        self.counts = torch.zeros(5, steps, dtype=torch.float64, device=device)  # [5, S]
        self.tokens = 0
        self._seconds_before = 0.0  # spent in this window before a resume
        self._started = time.monotonic()

    def add(self, counts: torch.Tensor, tokens: int) -> None:
        self.counts += counts.to(self.counts.device)
        self.tokens += tokens

    @property
    def seconds(self) -> float:
        return self._seconds_before + time.monotonic() - self._started

    def as_flat(self) -> torch.Tensor:
        """The counts and the tokens in one float64 vector [5*S + 1] (one all-reduce)."""
        return torch.cat([self.counts.cpu().flatten(),
                          torch.tensor([float(self.tokens)], dtype=torch.float64)])

    def reset(self) -> None:
        self.counts.zero_()
        self.tokens = 0
        self._seconds_before, self._started = 0.0, time.monotonic()

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts.cpu().clone(), "tokens": self.tokens,
                "seconds": self.seconds}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.counts.copy_(saved["counts"])
        self.tokens = int(saved["tokens"])
        self._seconds_before, self._started = float(saved["seconds"]), time.monotonic()


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
