"""Child servers in their own process group, their output streamed line by line.

A server (SGLang, or torchrun later) is started with start_new_session, so stopping it stops
every process it spawned (tensor-parallel workers, schedulers), and a watchdog
(draftsmith/serve/watchdog.py) stops it if the run dies without stopping it (kill -9). Its
output goes to a file and to the "draftsmith.child" logger as it arrives, never block-buffered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import threading
from collections import deque
from pathlib import Path

from pydantic import BaseModel

from draftsmith.serve import watchdog

log = logging.getLogger("draftsmith.child")


class ServerLaunch(BaseModel):
    """How a server is started: its argv (never through a shell) and environment, and where it
    listens. drafter_dir None: served without speculation (the benchmark's baseline)."""

    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    drafter_dir: str | None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell(self) -> str:
        """For people to read and paste; the launcher itself never goes through a shell."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)

# Every child this process started and has not stopped: a cancelled or failed run stops them all
# (they run in their own sessions, so a signal to the run's process group misses them).
_started: list[ManagedProcess] = []


class ManagedProcess:
    def __init__(self, argv: list[str], log_file: str | Path, env: dict[str, str] | None = None,
                 name: str = "server"):
        self.argv, self.log_file, self.name = argv, Path(log_file), name
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen | None = None
        self.tail: deque[str] = deque(maxlen=40)
        self._reader: threading.Thread | None = None
        self._log_start = 0

    def start(self) -> ManagedProcess:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        # The log is appended to (the deploy command's outlives its server): this run's part
        # starts here.
        self._log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
        )
        _started.append(self)
        watchdog.guard(self.process.pid, group=True)  # dies with us, even under kill -9
        log.info("%s: started pid %d: %s", self.name, self.process.pid, " ".join(self.argv))
        self._reader = threading.Thread(target=self._stream, daemon=True)
        self._reader.start()
        return self

    def _stream(self) -> None:
        assert self.process and self.process.stdout
        with open(self.log_file, "a", buffering=1) as sink:
            # The exact command heads its log: what ran is never a guess when reading it later.
            sink.write(f"$ {shlex.join(self.argv)}\n")
            for line in self.process.stdout:
                line = line.rstrip("\n")
                sink.write(line + "\n")
                self.tail.append(line)
                log.info("%s | %s", self.name, line)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def recent_output(self) -> str:
        return "\n".join(self.tail)

    def output(self, drain_s: float = 10.0) -> str:
        """This run's whole output, read back from the log file. Of an exited process, the
        output still in the pipe is read first (for up to `drain_s`: a child of its group that
        is still running holds the pipe open), so recent_output() is complete after it too."""
        if self._reader is not None and self.exit_code() is not None:
            self._reader.join(timeout=drain_s)
        if not self.log_file.is_file():
            return ""
        with open(self.log_file, "rb") as written:
            written.seek(self._log_start)
            return written.read().decode(errors="replace")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`; safe to call twice."""
        if self.process is None:
            return
        with contextlib.suppress(ValueError):
            _started.remove(self)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s: still running %.0fs after SIGTERM; killing its group", self.name,
                        grace_s)
        with contextlib.suppress(ProcessLookupError):  # stragglers, even if the leader exited
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        watchdog.release(self.process.pid, group=True)
        if self._reader:
            self._reader.join(timeout=5)
        log.info("%s: stopped (exit code %s)", self.name, self.process.returncode)

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_started(grace_s: float = 30.0) -> int:
    """Stop every child this process started that is still registered (servers kept for later
    runs included); returns how many. For cancellation and failure of a run."""
    count = 0
    while _started:
        child = _started[-1]
        log.info("%s: stopping pid %d (the run that started it is ending)", child.name, child.pid)
        child.stop(grace_s)
        count += 1
    return count
