"""Progress: the rate and ETA a user watches in the log and the Prefect UI."""

from __future__ import annotations

import pytest

from draftsmith import progress as progress_module
from draftsmith.progress import Progress


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    return now


def run(progress: Progress, clock: list[float], steps: int, seconds_each: float) -> None:
    for _ in range(steps):
        clock[0] += seconds_each
        progress.update(1)


def test_a_resumed_run_rates_only_what_it_does_itself(clock):
    """Resumed at step 300 of 1182: the first line after the resume said 30.9 step/s and an
    ETA of 28 s (the 300 earlier steps counted as done in this process's first seconds)."""
    progress = Progress("train", total=1182, unit="step", done=300)
    run(progress, clock, 50, 0.2)  # 5 steps/s
    assert progress.rate == pytest.approx(5.0)
    assert progress.eta_s == pytest.approx((1182 - 350) / 5.0)
    assert progress.message().startswith("train: 350/1182 steps, 5.0 step/s, ETA 2m46s")


def test_the_warm_up_leaves_the_rate_once_it_is_a_window_old(clock):
    """A compiled training step: 80 slow steps while kernels compile, then 5 steps/s. The
    rate since the start would promise hours at first and lag for minutes."""
    progress = Progress("train", total=1200, unit="step")
    run(progress, clock, 80, 1.0)
    run(progress, clock, 600, 0.2)  # two minutes at 5 steps/s
    assert progress.rate == pytest.approx(5.0, rel=0.05)
    assert progress.eta_s == pytest.approx((1200 - 680) / 5.0, rel=0.05)
    assert progress.done / (clock[0] - 1000.0) < 3.5  # what the whole-run average would say
