"""Readiness, not liveness: a server is ready for the pipeline only when its port is open,
/health answers 200, the server reports the speculative settings it was launched with, and one
real generation returns tokens (a seeds' health check said 200 before the model had loaded).
What is common to the engines is here; each engine's checks of its own endpoints are in its
module (draftsmith/serve/sglang_launch.py, draftsmith/serve/vllm_launch.py)."""

from __future__ import annotations

import socket
import time

from draftsmith.errors import TransientError
from draftsmith.serve.process import ManagedProcess


class ReadinessError(TransientError, RuntimeError):
    def __init__(self, check: str, why: str):
        super().__init__(f"server not ready: {check} check failed: {why}")
        self.check, self.why = check, why

    def __reduce__(self):  # pickled into Prefect's task state: rebuilt from both arguments
        return type(self), (self.check, self.why)


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def wait_for_port(host: str, port: int, process: ManagedProcess | None, timeout_s: float,
                  poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_open(host, port):
        if process is not None and process.exit_code() is not None:
            raise ReadinessError("port", f"the server exited with code {process.exit_code()} "
                                 f"before opening {host}:{port}; its last output:\n"
                                 f"{process.recent_output()}")
        if time.monotonic() > deadline:
            raise ReadinessError("port", f"{host}:{port} not open after {timeout_s:.0f}s "
                                 "(raise deploy.startup_timeout_s for big targets)")
        time.sleep(poll_s)
