"""Servers started by this process, so whoever started the run can stop them when it ends."""

from __future__ import annotations

import logging

from draftsmith.serve.process import ManagedProcess

log = logging.getLogger(__name__)

_running: dict[str, ManagedProcess] = {}


def register(url: str, process: ManagedProcess) -> None:
    _running[url] = process


def running(url: str) -> ManagedProcess | None:
    process = _running.get(url)
    return process if process is not None and process.exit_code() is None else None


def stop(url: str) -> None:
    process = _running.pop(url, None)
    if process is not None:
        process.stop()


def stop_all() -> int:
    """Stop every registered server (whole process groups); returns how many."""
    count = 0
    while _running:
        url, process = _running.popitem()
        log.info("stopping the server at %s", url)
        process.stop()
        count += 1
    return count
