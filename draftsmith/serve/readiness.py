"""Readiness, not liveness: a server is ready for the pipeline only when its port is open,
/health answers 200, /server_info reports a supported SGLang version and shows the speculative
settings we launched it with, and one real generation returns tokens (a seeds' health check
said 200 before the model had loaded)."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from draftsmith.config import DeployConfig
from draftsmith.errors import TransientError
from draftsmith.serve.process import ManagedProcess
from draftsmith.serve.sglang_launch import UnsupportedSGLangError, check_sglang_version

log = logging.getLogger(__name__)


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


def server_info(client: httpx.Client) -> dict[str, Any]:
    for path in ("/server_info", "/get_server_info"):  # newer and older SGLang
        response = client.get(path)
        if response.status_code == 200:
            return response.json()
    raise ReadinessError("server_info", "neither /server_info nor /get_server_info answers 200")


def check_server_version(info: dict[str, Any], url: str) -> None:
    try:
        check_sglang_version(info.get("version"), f"the server at {url}")
    except UnsupportedSGLangError as err:
        raise ReadinessError("version", str(err)) from None


def check_speculative_settings(info: dict[str, Any], cfg: DeployConfig,
                               drafter_dir: str | None) -> None:
    if drafter_dir is None:  # a baseline server must not speculate
        if info.get("speculative_algorithm"):
            raise ReadinessError("server_info", f"speculative_algorithm is "
                                 f"{info['speculative_algorithm']!r} on a server started "
                                 "without speculation")
        return
    if info.get("speculative_algorithm") != cfg.speculative_algorithm:
        raise ReadinessError("server_info", f"speculative_algorithm is "
                             f"{info.get('speculative_algorithm')!r}, expected "
                             f"{cfg.speculative_algorithm!r}")
    served = info.get("speculative_draft_model_path")
    if served is None or Path(served).resolve() != Path(drafter_dir).resolve():
        raise ReadinessError("server_info", f"speculative_draft_model_path is {served!r}, "
                             f"expected {drafter_dir}")
    if cfg.num_steps is not None:
        for key, want in (("speculative_num_steps", cfg.num_steps),
                          ("speculative_eagle_topk", cfg.eagle_topk),
                          ("speculative_num_draft_tokens", cfg.num_draft_tokens)):
            if info.get(key) != want:
                raise ReadinessError("server_info", f"{key} is {info.get(key)!r}, expected {want}")


def wait_until_ready(url: str, cfg: DeployConfig, drafter_dir: str | None,
                     process: ManagedProcess | None = None,
                     timeout_s: float | None = None) -> dict[str, Any]:
    """Run the checks in order; return the server's info. Raises ReadinessError naming
    the check that failed and why."""
    started = time.monotonic()
    timeout_s = timeout_s if timeout_s is not None else cfg.startup_timeout_s
    wait_for_port(cfg.host, cfg.port, process, timeout_s)
    log.info("server port %s:%d open after %.0fs", cfg.host, cfg.port, time.monotonic() - started)
    with httpx.Client(base_url=url, timeout=120.0) as client:
        health = client.get("/health")
        if health.status_code != 200:
            raise ReadinessError("health", f"/health answered {health.status_code}: "
                                 f"{health.text[:200]}")
        info = server_info(client)
        check_server_version(info, url)
        check_speculative_settings(info, cfg, drafter_dir)
        response = client.post("/generate", json={
            "text": "Speculative decoding is", "sampling_params": {"max_new_tokens": 8,
                                                                   "temperature": 0.0}})
        if response.status_code != 200:
            raise ReadinessError("generation", f"/generate answered {response.status_code}: "
                                 f"{response.text[:200]}")
        meta = response.json().get("meta_info", {})
        if not meta.get("completion_tokens"):
            raise ReadinessError("generation",
                                 f"/generate returned no tokens: {response.text[:200]}")
    log.info("server ready at %s after %.0fs (%s, %s steps)", url, time.monotonic() - started,
             info.get("speculative_algorithm"), info.get("speculative_num_steps"))
    return info
