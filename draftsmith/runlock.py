"""One run root, one writer: the locks that keep two runs (or two copies of a stage) apart.

A run holds `<run_root>/.locks/run.lock` from its first stage to its summary; a stage holds
`<run_root>/.locks/<stage>-<key>.lock` while it computes (a stage spread over several hosts:
one lock per part). A second run on the same run root, say a schedule that fires while a run
started from the UI still goes, waits for the first and then finds its stages done; with
orchestration.run_root_wait_s it waits that long and is then refused, its error naming the run
that holds the root. Two GPU flow runs of one stage (a stage flow started by hand beside the
pipeline's) take turns the same way, so a stage is never computed twice at once.

The locks are the operating system's (flock, through filelock): a process that dies, even by
kill -9 or with its host, holds nothing, so a lock left behind is never waited on. Beside
each lock, `<name>.json` says who holds it (run name, flow run, pid, host, since when); the
holder deletes it when it lets go, so one found on taking the lock was left by a holder that
was killed, and is reported as a take-over. On a shared filesystem (NFS) the lock is the
server's: a host that goes down releases it when its lease expires (90 s on NFSv4 by default).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

from draftsmith.artifacts import atomic_write_json
from draftsmith.errors import InputError

log = logging.getLogger(__name__)

LOCKS_DIR = ".locks"
RUN_LOCK = "run"
# How often a waiting run looks at the lock, and says again in the log who it waits for.
POLL_S = 1.0
REMIND_S = 300.0


class RunRootBusyError(InputError, RuntimeError):
    """Another run holds the run root (or is computing the stage) for longer than this run
    was told to wait; the message names it. Retrying at once would find it still there."""


@dataclass
class Holder:
    """Who holds a lock: what a waiting run names in its log and in its error."""

    run: str  # the run's name (`tiny, data 3f2a9c1b`) or the command that started it
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    since: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(
        timespec="seconds"))
    flow_run: str | None = None  # the Prefect flow run's id, where it runs under Prefect
    url: str | None = None  # the flow run's page in the Prefect UI
    stage: str | None = None

    def describe(self) -> str:
        where = f"pid {self.pid} on {self.host}, since {self.since}"
        if self.flow_run:
            where = f"flow run {self.flow_run}, {where}"
        if self.url:
            where += f", {self.url}"
        text = f"run '{self.run}' ({where})"
        return f"stage {self.stage} of {text}" if self.stage else text

    def same_process(self, other: Holder) -> bool:
        return (self.pid, self.host) == (other.pid, other.host)

    def is_gone(self) -> bool:
        """Whether this holder's process has ended (only knowable on its own host)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def lock_path(run_root: str | Path, name: str) -> Path:
    return Path(run_root) / LOCKS_DIR / f"{name}.lock"


def holder_path(run_root: str | Path, name: str) -> Path:
    return Path(run_root) / LOCKS_DIR / f"{name}.json"


def read_holder(run_root: str | Path, name: str) -> Holder | None:
    """Who holds (or, if it was killed, last held) the lock; None when nobody recorded it."""
    try:
        return Holder(**json.loads(holder_path(run_root, name).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def _describe_other(run_root: str | Path, name: str) -> str:
    other = read_holder(run_root, name)
    if other is None or other.is_gone():  # it has the lock but has not said so yet
        return "another run (starting up)"
    return other.describe()


@contextmanager
def hold(run_root: str | Path, name: str, holder: Holder, wait_s: float | None,
         what: str) -> Iterator[Holder | None]:
    """Hold the lock `name` of `run_root` for the block. When another process holds it, wait
    (wait_s: at most this long; None: as long as it lives), saying in the log whom for, then
    raise RunRootBusyError naming it. Yields the holder a killed process left behind, if the
    lock was taken over from one (None otherwise). `what`: what the lock guards, for the
    messages ("run root /x", "stage train")."""
    path = lock_path(run_root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    started = time.monotonic()
    reminded = None
    while True:
        waited = time.monotonic() - started
        try:
            step = POLL_S if wait_s is None else max(0.0, min(POLL_S, wait_s - waited))
            lock.acquire(timeout=step, poll_interval=min(0.1, POLL_S))
            break
        except Timeout:
            waited = time.monotonic() - started
            other = _describe_other(run_root, name)
            if wait_s is not None and waited >= wait_s:
                raise RunRootBusyError(
                    f"{what} is in use by {other}; refused after waiting {waited:.0f} s "
                    f"(orchestration.run_root_wait_s={wait_s:g}). Wait for that run to finish "
                    "(its finished stages are then reused, not computed again), stop it, or "
                    "give this run another run_root") from None
            if reminded is None or time.monotonic() - reminded >= REMIND_S:
                reminded = time.monotonic()
                limit = ("as long as it runs" if wait_s is None
                         else f"up to {wait_s:g} s, orchestration.run_root_wait_s")
                log.warning("%s is in use by %s; waiting for it (%s)", what, other, limit)
    try:
        left = read_holder(run_root, name)
        if left is not None and not left.same_process(holder):
            log.warning("%s: took over the lock of %s, which ended without releasing it "
                        "(killed, or its host went down); what it finished is kept and what "
                        "it left unfinished resumes", what, left.describe())
        else:
            left = None
        if waited >= POLL_S:
            log.info("%s: free now, after %.0f s", what, waited)
        atomic_write_json(holder_path(run_root, name), asdict(holder))
        yield left
    finally:
        with suppress(OSError):
            holder_path(run_root, name).unlink(missing_ok=True)
        lock.release()


def stage_lock_name(stage: str, key: str, part: str | None = None) -> str:
    return f"{stage}-{key}" + (f"-{part}" if part else "")
