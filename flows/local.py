"""Local mode's Prefect API: Prefect's own temporary server (what `draftsmith run` uses when no
PREFECT_API_URL is set), started before the flow and guarded, so that it dies with the run even
when the run is killed with -9 (Prefect stops it at a normal exit only)."""

from __future__ import annotations

import os

from draftsmith.serve import watchdog


def start_temporary_api() -> None:
    """Start Prefect's temporary server now (the flow's client finds the same instance) and
    guard it; nothing to do when a Prefect server is configured."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or os.environ.get("PREFECT_API_URL"):
        return
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    server = SubprocessASGIServer()
    # A first start migrates a new database: on a busy machine that takes longer than
    # Prefect's default wait.
    server.start(timeout=max(120, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
    if server.server_process is not None:
        watchdog.guard(server.server_process.pid)
