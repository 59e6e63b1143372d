"""Where a speculative round's time goes: drafting, verification, and the rest.

On CUDA the host runs ahead of the GPU: a round enqueues its drafting and its verify forward
and reads the GPU once, at its end, for the drafts and the target's verdicts together. A
host clock read between the two would only see how long the launches took, and a
synchronize there to make it honest would cost the overlap it measures. So on CUDA each
phase ends at an event on the GPU's own timeline: drafting ends when the drafts exist,
verification when the target's logits do. What follows (the read, the bookkeeping) is the
rest of the round. Elsewhere every operation has finished when it returns, and the host's
clock says the same thing.
"""

from __future__ import annotations

import time
from itertools import pairwise

import torch


class RoundClock:
    """`start()` at the round's start, `end(phase)` as each phase's work has been enqueued,
    and `read()` once the round has read the GPU (which waits for everything enqueued):
    seconds per phase, in order."""

    def __init__(self, device: torch.device, phases: tuple[str, ...] = ("draft", "verify")):
        self.phases = phases
        self.on_gpu = device.type == "cuda"
        marks = len(phases) + 1
        # Made once and reused every round: an event is re-recorded, never re-made.
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] \
            if self.on_gpu else []
        self._times = [0.0] * marks
        self._next = 0

    def start(self) -> None:
        self._next = 0
        self._mark()

    def end(self, phase: str) -> None:
        if self._next > len(self.phases) or self.phases[self._next - 1] != phase:
            raise RuntimeError(f"round clock: {phase!r} ended out of order; phases are "
                               f"{self.phases}, start() first")
        self._mark()

    def read(self) -> dict[str, float]:
        if self._next != len(self.phases) + 1:
            raise RuntimeError(f"round clock: read before every phase of {self.phases} ended")
        if self.on_gpu:
            spans = [begin.elapsed_time(end) / 1000 for begin, end in pairwise(self._events)]
        else:
            spans = [end - begin for begin, end in pairwise(self._times)]
        return dict(zip(self.phases, spans, strict=True))

    def add_to(self, result) -> None:
        """read(), each phase's seconds added to result's `<phase>_seconds` (a Generation's
        draft_seconds and verify_seconds)."""
        for phase, seconds in self.read().items():
            setattr(result, f"{phase}_seconds", getattr(result, f"{phase}_seconds") + seconds)

    def _mark(self) -> None:
        if self.on_gpu:
            self._events[self._next].record()
        else:
            self._times[self._next] = time.perf_counter()
        self._next += 1
