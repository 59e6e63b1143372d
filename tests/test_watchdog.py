"""Children die with the run that started them, even under kill -9 (draftsmith/serve/watchdog.py):
servers in their own sessions, and Prefect's temporary API server in local mode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

PARENT = """
import subprocess, sys, time
from draftsmith.serve import watchdog
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
watchdog.guard(child.pid, group=True)
print(child.pid, flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pid: int, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not alive(pid)


def start(code: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env=env)
    line = parent.stdout.readline()
    assert line.strip().isdigit(), line
    return parent, int(line)


def test_a_guarded_child_dies_when_its_parent_is_killed():
    parent, child = start(PARENT, "wait")
    try:
        assert alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert wait_gone(child), f"pid {child} outlived its killed parent"
    finally:
        if alive(child):
            os.killpg(child, signal.SIGKILL)


def test_a_normal_exit_leaves_kept_children_alone():
    parent, child = start(PARENT, "exit")
    try:
        assert parent.wait(timeout=60) == 0
        time.sleep(2)  # what the watchdog would need to act on a lost parent
        assert alive(child)  # a server kept on purpose (deploy.keep_serving) survives
    finally:
        os.killpg(child, signal.SIGKILL)


@pytest.mark.timeout(300)
def test_prefects_temporary_server_dies_with_a_killed_run(tmp_path):
    code = ("from flows.local import start_temporary_api\n"
            "api = start_temporary_api()\n"
            "api.wait_ready()\n"
            "print(api.process.pid, flush=True)\n"
            "import time; time.sleep(600)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    parent, server = start(code, env=env)
    try:
        assert alive(server)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert wait_gone(server), f"Prefect's temporary server (pid {server}) survived"
    finally:
        if alive(server):
            os.kill(server, signal.SIGKILL)


@pytest.mark.timeout(300)
def test_a_database_from_another_prefect_version_is_named_with_the_fix(tmp_path):
    """A PREFECT_HOME whose database a newer Prefect migrated: Prefect's own server fails on
    the unknown alembic revision, and the error names the database and what to do."""
    import sqlite3

    home = tmp_path / "prefect"
    home.mkdir()
    with sqlite3.connect(home / "prefect.db") as db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        db.execute("INSERT INTO alembic_version VALUES ('ffffffffffff')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    run = subprocess.run([sys.executable, "-c", "from flows.local import start_temporary_api\n"
                          "start_temporary_api().wait_ready()"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    assert "No such revision" in run.stderr  # Prefect's own error, printed above ours
    assert (f"the database {home / 'prefect.db'} was written by another Prefect version: "
            "set PREFECT_HOME to a new folder") in run.stderr
