"""Local mode's Prefect API: a temporary Prefect server for the run (what `draftsmith run` uses
when no Prefect API is configured), the server Prefect itself would start, but started before
Prefect is imported: it boots on the other core while this process imports Prefect and the
flow (each takes seconds). It is guarded, so that it dies with the run even when the run is
killed with -9 (Prefect stops its own at a normal exit only).

When a Prefect API may be configured somewhere only Prefect reads (a profile, prefect.toml,
pyproject.toml, .env), Prefect decides after it is imported, and its own temporary server is
started, guarded, if none is configured after all.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: a profiles file leaves the choice to Prefect
    tomllib = None

from draftsmith.serve import watchdog

# A first start migrates a new database: on a busy machine that takes longer than Prefect's
# default wait.
STARTUP_TIMEOUT_S = 120.0


def configured_elsewhere() -> bool:
    """Whether a Prefect API URL may be set other than in the environment."""
    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH", home / "profiles.toml")).expanduser()
    if profiles.is_file():
        if tomllib is None:
            return True
        try:
            data = tomllib.loads(profiles.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            return True  # Prefect will say what is wrong with it
        active = os.environ.get("PREFECT_PROFILE") or data.get("active") or "ephemeral"
        if "PREFECT_API_URL" in data.get("profiles", {}).get(active, {}):
            return True
    cwd = Path.cwd()
    pyproject = cwd / "pyproject.toml"
    return ((cwd / "prefect.toml").is_file()
            or (pyproject.is_file() and "[tool.prefect" in pyproject.read_text())
            or ((cwd / ".env").is_file() and "PREFECT_" in (cwd / ".env").read_text()))


def database() -> str:
    """The Prefect server's database, as its settings name it (SQLite under PREFECT_HOME
    unless a connection URL is set)."""
    for name in ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"):
        if os.environ.get(name):
            return f"the database of {name}"
    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    return f"the database {home / 'prefect.db'}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TemporaryApi:
    """Prefect's API server (uvicorn on prefect.server.api.server:create_app, as Prefect starts
    its temporary server) on a free loopback port, for this run."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error",
             "--lifespan", "on"], env=env, stdin=subprocess.DEVNULL)
        watchdog.guard(self.process.pid)
        atexit.register(self.stop)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"Prefect's temporary API server exited with code "
                    f"{self.process.returncode} before it was ready (port {self.port}); its "
                    f"error is printed above. If that error names an alembic revision, "
                    f"{database()} was written by another Prefect version: set PREFECT_HOME "
                    f"to a new folder, or run with the Prefect that wrote it")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"{self.url}/health", timeout=5) as response:
                if response.status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"Prefect's temporary API server at {self.url} not ready after "
                           f"{timeout_s:.0f}s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        watchdog.release(self.process.pid)


def start_temporary_api() -> TemporaryApi | None:
    """Start the run's temporary API server, and point this process's Prefect at it: call
    before Prefect is imported, then `wait_ready()` before the flow runs. None when a Prefect
    API is configured, or may be (then call `start_prefects_own()` once Prefect is imported)."""
    if os.environ.get("PREFECT_API_URL") or configured_elsewhere():
        return None
    api = TemporaryApi()
    os.environ["PREFECT_API_URL"] = api.url
    return api


def start_prefects_own() -> None:
    """Prefect's own temporary server, started now and guarded; nothing to do when a Prefect
    server is configured."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    server = SubprocessASGIServer()
    # A first start migrates a new database: on a busy machine that takes longer than
    # Prefect's default wait.
    server.start(timeout=int(max(STARTUP_TIMEOUT_S,
                                 PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())))
    if server.server_process is not None:
        watchdog.guard(server.server_process.pid)
