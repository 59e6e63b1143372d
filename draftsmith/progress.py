"""Progress for long loops: counts, rate and ETA in the log at a steady cadence.

A log line (not a terminal-only bar) is what reaches the Prefect UI and the run's log file;
listeners (a Prefect progress artifact, for instance) can subscribe through `on_update`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("draftsmith.progress")

ProgressListener = Callable[["Progress"], None]
_listeners: list[ProgressListener] = []


def add_listener(listener: ProgressListener) -> None:
    _listeners.append(listener)


def remove_listener(listener: ProgressListener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """done of total units, with the rate over the last `window_s` seconds: a compiled step's
    first minutes (compiling, warming up) leave the rate once they are a window old. `done`
    counts what an earlier process finished (a resumed run), which is never in the rate."""

    def __init__(self, name: str, total: int | None, unit: str = "item", every_s: float = 5.0,
                 *, done: int = 0, window_s: float = 60.0):
        self.name, self.total, self.unit, self.every_s = name, total, unit, every_s
        self.done = done
        self.started = self._last = time.monotonic()
        self.window_s = window_s
        self._marks: deque[tuple[float, int]] = deque([(self.started, done)])  # (time, done)
        self.fields: dict[str, object] = {}

    @property
    def rate(self) -> float:
        since, done_then = self._marks[0]
        elapsed = time.monotonic() - since
        return (self.done - done_then) / elapsed if elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if not self.total or not self.rate:
            return None
        return (self.total - self.done) / self.rate

    def message(self) -> str:
        total = f"/{self.total}" if self.total else ""
        parts = [f"{self.name}: {self.done}{total} {self.unit}s", f"{self.rate:.1f} {self.unit}/s"]
        if self.eta_s is not None:
            parts.append(f"ETA {format_duration(self.eta_s)}")
        parts += [f"{k} {v}" for k, v in self.fields.items()]
        return ", ".join(parts)

    def update(self, n: int = 1, **fields: object) -> None:
        self.done += n
        self.fields.update(fields)
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._marks.append((now, self.done))
            while len(self._marks) > 2 and self._marks[1][0] <= now - self.window_s:
                self._marks.popleft()
            self._emit()

    def _emit(self) -> None:
        log.info(self.message())
        for listener in list(_listeners):
            listener(self)

    def close(self) -> None:
        self._emit()
