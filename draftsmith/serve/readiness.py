"""Readiness, not liveness: a server is ready for the pipeline only when its port is open,
/health answers 200, the server reports the speculative settings it was launched with, and one
real generation returns tokens (a seeds' health check said 200 before the model had loaded).
What is common to the engines is here; each engine's checks of its own endpoints are in its
module (draftsmith/serve/sglang_launch.py, draftsmith/serve/vllm_launch.py)."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Mapping

from draftsmith.errors import InputError, TransientError
from draftsmith.serve.process import ManagedProcess

# What engines put before a line of their output: vLLM's "(EngineCore pid=1838) " and
# "ERROR 12-06 06:20:11 [core.py:1330] ", SGLang's "[2025-12-06 06:20:11 TP0] ", torch's
# "[rank0]: ".
_LINE_PREFIX = re.compile(
    r"^(?:\([^()]*pid=\d+\)\s*"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\]\s*"
    r"|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[^\]]*\]\s*"
    r"|\[rank\d+\]:\s*)+")
# The last line of a Python traceback: "ModuleNotFoundError: No module named 'flashinfer'",
# "torch.OutOfMemoryError: CUDA out of memory. ...".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]*(?:Error|Exception)(?::\s.*)?$")
# An exception that only points at another one printed before it (vLLM's API server when its
# engine core died: "Engine core initialization failed. See root cause above").
_POINTS_ABOVE = re.compile(r"(?i)\b(?:root cause|errors?|messages?|logs?|traceback) above\b")
# A module the server imports is missing or does not import: the environment is wrong, and
# every attempt fails the same way until it is fixed.
_INSTALL_ERRORS = ("ModuleNotFoundError", "ImportError")


class ReadinessError(TransientError, RuntimeError):
    def __init__(self, check: str, why: str):
        super().__init__(f"server not ready: {check} check failed: {why}")
        self.check, self.why = check, why

    def __reduce__(self):  # pickled into Prefect's task state: rebuilt from both arguments
        return type(self), (self.check, self.why)


class ServerInstallError(InputError, RuntimeError):
    """The server exited before opening its port on a module it could not import: not retried
    (a ReadinessError is), since the next attempt would import from the same environment."""


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def first_error(output: str) -> str | None:
    """The exception that stopped a server, as its traceback's last line names it, engines'
    line prefixes stripped: the first one printed that does not only point at another (the
    cause is printed first, its wrappers after it, in other processes of the server)."""
    errors = [line for line in (_LINE_PREFIX.sub("", raw).strip() for raw in output.splitlines())
              if _EXCEPTION_LINE.match(line)]
    causes = [error for error in errors if not _POINTS_ABOVE.search(error)]
    return (causes or errors or [None])[0]


def exit_error(host: str, port: int, process: ManagedProcess,
               fixes: Mapping[str, str] | None = None) -> ReadinessError | ServerInstallError:
    """Why a server exited before opening its port, from its whole output: the 40 lines the
    process keeps often hold only the wrappers of the error that stopped it. `fixes`: what to
    do, by a piece of that error's line."""
    cause = first_error(process.output())
    why = f"the server exited with code {process.exit_code()} before opening {host}:{port}"
    if cause:
        why += f": {cause} (first error in {process.log_file})"
        fix = next((fix for piece, fix in (fixes or {}).items() if piece in cause), None)
        if fix:
            why += f"; fix: {fix}"
    why += f"; its last output:\n{process.recent_output()}"
    if cause and cause.split(":", 1)[0].rsplit(".", 1)[-1] in _INSTALL_ERRORS:
        return ServerInstallError(f"server not ready: port check failed: {why}")
    return ReadinessError("port", why)


def wait_for_port(host: str, port: int, process: ManagedProcess | None, timeout_s: float,
                  poll_s: float = 1.0, fixes: Mapping[str, str] | None = None) -> None:
    """Raises ServerInstallError for a server that exited on a missing module, ReadinessError
    for any other exit or a port still closed after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not port_open(host, port):
        if process is not None and process.exit_code() is not None:
            raise exit_error(host, port, process, fixes)
        if time.monotonic() > deadline:
            raise ReadinessError("port", f"{host}:{port} not open after {timeout_s:.0f}s "
                                 "(raise deploy.startup_timeout_s for big targets)")
        time.sleep(poll_s)
