"""What making a stage's output cost: wall seconds, peak GPU memory, bytes on disk.

`Stage.execute` measures while the stage's engine function runs; `finish_stage` reads the
meter when it writes the manifest, so the cost is part of the output's descriptor and is shown
wherever its figures are (the run summary, `draftsmith compare`), Cached runs included: a
Cached stage shows what it cost to make.

- `seconds`: the attempt that finished the output (a training run resumed from a checkpoint
  counts from its resume).
- `peak_gpu_gib`: the most memory this process's PyTorch held on any GPU while the stage ran;
  None where the process used no GPU. Work in child processes (torchrun workers, a served
  engine) is not in it.
- `disk_bytes`: the files the output holds.

A stage finished outside a measured run (its parts joined from several hosts, a function
called directly) has seconds and peak None, and its bytes on disk.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from pydantic import BaseModel

_started: ContextVar[float | None] = ContextVar("stage_started", default=None)


class StageCost(BaseModel):
    seconds: float | None = None
    peak_gpu_gib: float | None = None
    disk_bytes: int


def _cuda():
    """torch.cuda when this process has initialized CUDA, else None (never initializes it, and
    never imports torch for a stage that did not)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda


@contextmanager
def measuring() -> Iterator[None]:
    """Measure the stage that runs inside: its seconds, and the GPU peak from here on."""
    if (cuda := _cuda()) is not None:
        for device in range(cuda.device_count()):
            cuda.reset_peak_memory_stats(device)
    token = _started.set(time.monotonic())
    try:
        yield
    finally:
        _started.reset(token)


def cost_now(disk_bytes: int) -> StageCost:
    """The running stage's cost so far, with the bytes its output holds."""
    started = _started.get()
    if started is None:
        return StageCost(disk_bytes=disk_bytes)
    peak = None
    if (cuda := _cuda()) is not None:
        peak = round(max(cuda.max_memory_allocated(d) for d in range(cuda.device_count()))
                     / 2**30, 3)
    return StageCost(seconds=round(time.monotonic() - started, 2), peak_gpu_gib=peak,
                     disk_bytes=disk_bytes)


def describe(cost: StageCost | None) -> str:
    """`41.2 s, GPU peak 3.10 GiB, 120.5 MB on disk` (the parts that were measured)."""
    if cost is None:
        return "-"
    parts = [] if cost.seconds is None else [f"{cost.seconds:.1f} s"]
    if cost.peak_gpu_gib is not None:
        parts.append(f"GPU peak {cost.peak_gpu_gib:.2f} GiB")
    parts.append(f"{cost.disk_bytes / 1e6:.1f} MB on disk")
    return ", ".join(parts)
