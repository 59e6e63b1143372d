"""Riding out a Prefect API that is away for a while (a server restart, a dropped network).

What Prefect already rides out: task states and heartbeats are events, which its client keeps
and sends again once it reconnects; run logs are sent in batches. What it does not: a call the
flow makes itself (read a child run's state, create or update an artifact, renew a GPU slot's
lease) raises once its client has retried for about a minute. Here such calls are retried for
as long as orchestration.api_outage_s allows, and work that needs no API (a GPU stage
computing) never waits on one: progress updates go out from a thread of their own and are
dropped while the API is away (the next one carries the latest figures).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

log = logging.getLogger("draftsmith.api_outage")

T = TypeVar("T")
# Between two attempts while the API is away: short first, then at most this long.
MAX_WAIT_S = 15.0


def is_outage(err: BaseException) -> bool:
    """A failure to reach the API, or an answer that says it is down (5xx), as opposed to a
    refusal that no retry changes (4xx)."""
    if isinstance(err, httpx.TransportError):
        return True
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code >= 500
    return False


def api_call(action: Callable[[], T], what: str, outage_s: float) -> T:
    """`action()`, tried again while the Prefect API is unreachable, for up to `outage_s`
    seconds; the log says when the API went away and when it came back."""
    started = time.monotonic()
    wait, failures = 1.0, 0
    while True:
        try:
            result = action()
        except Exception as err:
            if not is_outage(err):
                raise
            away = time.monotonic() - started
            if away >= outage_s:
                raise ApiOutageError(
                    f"{what}: the Prefect API has been unreachable for {away:.0f} s "
                    f"(orchestration.api_outage_s={outage_s:g}): {type(err).__name__}: {err}. "
                    "Bring the server back and run again: finished stages are reused"
                ) from err
            if failures == 0:
                log.warning("%s: the Prefect API is unreachable (%s: %s); trying again for up "
                            "to %.0f s (orchestration.api_outage_s), the work goes on", what,
                            type(err).__name__, err, outage_s)
            failures += 1
            time.sleep(min(wait, max(0.0, outage_s - away)))
            wait = min(2 * wait, MAX_WAIT_S)
            continue
        if failures:
            log.warning("%s: the Prefect API is back after %.0f s", what,
                        time.monotonic() - started)
        return result


class ApiOutageError(RuntimeError):
    """The Prefect API stayed away longer than orchestration.api_outage_s."""


def wait_for_api(what: str, outage_s: float) -> None:
    """Return once the Prefect API answers (at once when it does): a flow run that finished its
    work during an outage waits here, so that Prefect can record how it ended."""
    from prefect.client.orchestration import get_client

    def healthy() -> None:
        with get_client(sync_client=True) as client:
            error = client.api_healthcheck()
        if error is not None:
            raise error

    api_call(healthy, what, outage_s)


class LatestOnly:
    """Sends the latest of a stream of updates from a thread of its own: the caller never waits
    on the API, and updates that find it away are replaced by the next one."""

    def __init__(self, send: Callable[[Any], None], what: str, retry_s: float = 5.0):
        self._send, self._what, self._retry_s = send, what, retry_s
        self._pending: Any = None
        self._has_pending = False
        self._closed = False
        self._away = False
        self._condition = threading.Condition()
        # The thread runs in the creator's context: Prefect's run context names the task and
        # flow run an artifact belongs to.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,),
                                        name=f"send {what}", daemon=True)
        self._thread.start()

    def put(self, update: Any) -> None:
        with self._condition:
            self._pending, self._has_pending = update, True
            self._condition.notify()

    def close(self, last: Any = None, timeout_s: float = 30.0) -> None:
        """Send `last` (when given) and stop; waits at most timeout_s for the API."""
        with self._condition:
            if last is not None:
                self._pending, self._has_pending = last, True
            self._closed = True
            self._condition.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._has_pending and not self._closed:
                    self._condition.wait()
                if not self._has_pending:
                    return
                update, self._has_pending = self._pending, False
                closing = self._closed
            try:
                self._send(update)
                if self._away:
                    log.info("%s: the Prefect API is back", self._what)
                    self._away = False
            except Exception as err:  # noqa: BLE001 - an update is never worth a failed stage
                if not self._away:
                    log.warning("%s: not sent (%s: %s); the work goes on, and the latest "
                                "figures are sent once the Prefect API answers", self._what,
                                type(err).__name__, err)
                    self._away = True
                if closing:
                    return
                with self._condition:
                    if not self._has_pending:
                        self._pending, self._has_pending = update, True
                    self._condition.wait(self._retry_s)
