"""compiled_once: one torch.compile per function and options, shared by every caller; and
CapturedStep's buffers, state and outputs (its replays without CUDA, as the CPU runs them)."""

from __future__ import annotations

import torch

from draftsmith import compiling
from draftsmith.compiling import CapturedStep, fixed_address


def test_a_function_is_compiled_once_for_every_caller(monkeypatch):
    made = []

    def fake_compile(fn, **options):
        made.append(options)
        return lambda *args: fn(*args)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(compiling, "_COMPILED", {})

    def plus_one(x):
        return x + 1

    first = compiling.compiled_once(plus_one, dynamic=False)
    assert compiling.compiled_once(plus_one, dynamic=False) is first
    other = compiling.compiled_once(plus_one)  # other options: another compiled function
    assert other is not first and made == [{"dynamic": False}, {}]
    assert first(1) == 2 and other(2) == 3


class Counter:
    """A step with state, as a StaticCache's forward: it writes its input at its counter's
    slot of a fixed buffer, advances the counter and returns the running sum."""

    def __init__(self):
        self.buffer = torch.zeros(8)  # [8]
        self.count = torch.zeros((), dtype=torch.long)
        fixed_address(self.buffer)

    def step(self, x: torch.Tensor, buffer: torch.Tensor, scale: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        buffer.index_copy_(0, self.count.view(1), x)
        self.count.add_(1)
        return buffer.sum().view(1), x * 2 * scale  # [1], [1]

    def state(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return [self.count]


def test_a_captured_step_reads_fixed_tensors_in_place_and_copies_the_rest():
    """The fixed buffer is the one written (a cache the graph must update, not a copy of it);
    a fresh input each call reaches the step through the capture's own buffer; the warm-up
    and capture leave the step's counter where they found it."""
    counter = Counter()
    step = CapturedStep(counter.step, state=counter.state, graphs=False)
    for value in (1.0, 2.0, 3.0):
        total, doubled = step(torch.tensor([value]), counter.buffer)
        assert doubled.item() == 2 * value
    assert counter.buffer[:4].tolist() == [1.0, 2.0, 3.0, 0.0]  # each call wrote once
    assert counter.count.item() == 3 and total.item() == 6.0


def test_every_warm_up_run_starts_from_the_calls_state():
    """A captured step runs its warm-ups before it records the graph; a step that advances a
    counter (a cache's) must see each from where the call found it. The first H100 run of a
    prompt as wide as its cache wrote its second warm-up past the cache's end (2026-12-06)."""
    counter = Counter()
    seen: list[int] = []

    def step(value: torch.Tensor, buffer: torch.Tensor):
        seen.append(int(counter.count))
        return counter.step(value, buffer)

    captured = CapturedStep(step, state=counter.state, graphs=False, warmups=2)
    captured(torch.tensor([1.0]), counter.buffer)
    assert seen == [0, 0, 0]  # two warm-ups, then the call itself
    assert counter.count.item() == 1


def test_a_captured_steps_outputs_are_overwritten_by_its_next_call():
    """As a CUDA graph's: its output tensors are its own and each replay writes into them, so
    a caller keeps a copy of what it needs past the next call."""
    counter = Counter()
    step = CapturedStep(counter.step, state=counter.state, graphs=False)
    first, _ = step(torch.tensor([5.0]), counter.buffer)
    kept = first.clone()
    second, _ = step(torch.tensor([7.0]), counter.buffer)
    assert second is first and first.item() == 12.0 and kept.item() == 5.0


def test_a_captured_step_captures_once_per_signature_and_forgets_on_demand():
    counter = Counter()
    step = CapturedStep(counter.step, state=counter.state, graphs=False)
    step(torch.tensor([1.0]), counter.buffer)
    step(torch.tensor([2.0]), counter.buffer)
    assert len(step._captures) == 1  # the same shapes: one capture, replayed
    other = torch.zeros(8)
    fixed_address(other)
    step(torch.tensor([3.0]), other)  # another cache: a capture of its own
    step(torch.tensor([4.0]), counter.buffer, scale=3.0)  # another argument: one more
    assert len(step._captures) == 3
    step.forget()
    assert not step._captures
