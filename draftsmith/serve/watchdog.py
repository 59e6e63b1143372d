"""Children that die with the process that started them, even when it is killed with -9.

A run starts long-lived children in their own sessions (servers, and Prefect's temporary API
server in local mode); signals to the run's process group miss them, and a SIGKILL gives the run
no chance to stop them. So the first guarded child also starts a watchdog: a small process that
reads the pids to guard from a pipe. The kernel closes the pipe when the run dies however it
dies; at end of file the watchdog kills what it guards. A run that exits normally says so first
("exit"), and the watchdog leaves alone what is left (a server kept on purpose).

    python -m draftsmith.serve.watchdog   (started by guard(); reads +PID, -PID, +GROUP:PGID)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

_lock = threading.Lock()
_watchdog: subprocess.Popen | None = None


def _send(line: str) -> None:
    global _watchdog
    with _lock:
        if _watchdog is None or _watchdog.poll() is not None:
            _watchdog = subprocess.Popen(
                [sys.executable, "-m", "draftsmith.serve.watchdog"], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                start_new_session=True)  # out of the run's group: a group kill leaves it
            atexit.register(_normal_exit)
        assert _watchdog.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):
            _watchdog.stdin.write(line + "\n")
            _watchdog.stdin.flush()


def guard(pid: int, group: bool = False) -> None:
    """Kill `pid` (its whole process group when `group`) if this process dies first."""
    _send(f"+{'GROUP:' if group else ''}{pid}")


def release(pid: int, group: bool = False) -> None:
    """Stop guarding `pid` (it was stopped, or is to outlive this process on purpose)."""
    _send(f"-{'GROUP:' if group else ''}{pid}")


def _normal_exit() -> None:
    global _watchdog
    with _lock:
        if _watchdog is not None and _watchdog.poll() is None and _watchdog.stdin:
            with contextlib.suppress(BrokenPipeError, ValueError, OSError):
                _watchdog.stdin.write("exit\n")
                _watchdog.stdin.close()
        _watchdog = None


def _kill(entry: str, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if entry.startswith("GROUP:"):
            os.killpg(int(entry.removeprefix("GROUP:")), sig)
        else:
            os.kill(int(entry), sig)


def main() -> None:
    # The run's Ctrl-C or SIGTERM is for the run; the watchdog acts when its pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    guarded: list[str] = []
    for line in sys.stdin:
        line = line.strip()
        if line == "exit":
            return
        if line.startswith("+"):
            guarded.append(line[1:])
        elif line.startswith("-") and line[1:] in guarded:
            guarded.remove(line[1:])
    # End of file without "exit": the process that started us is gone.
    for entry in guarded:
        _kill(entry, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(e) for e in guarded):
        time.sleep(0.2)
    for entry in guarded:
        _kill(entry, signal.SIGKILL)


def _alive(entry: str) -> bool:
    pid = int(entry.removeprefix("GROUP:"))
    try:
        os.kill(pid, 0) if not entry.startswith("GROUP:") else os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


if __name__ == "__main__":
    main()
