"""One run root, one writer, with real `draftsmith run` processes on the random tiny target.

A stands-in for a second GPU flow run of generate (a process holding generate's stage lock, as
a generate flow started by hand beside the pipeline's would) keeps run A waiting inside the
pipeline, with the run root's lock held: a deterministic moment, whatever the machine's load.
Then: run B waits for A, naming it; run C, told not to wait, is refused naming it; A is
killed -9 and B takes its lock over; once the stage's other holder lets go, B computes each
stage once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftsmith import runlock
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(900)
BIN = Path(sys.executable).parent
RECORDS = 8


def write_config(root: Path, target: Path) -> Path:
    raw = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    for source in raw["data"]["sources"]:
        source["path"] = str(REPO / "examples" / source["path"])
        source["limit"] = RECORDS
    raw.update(run_root=str(root / "runs"), name="locked")
    raw["target"]["model"] = str(target)
    raw["generate"]["max_new_tokens"] = 4
    raw["merge"]["draft_vocab_size"] = 128  # the random target has 512 tokens
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Process:
    """A command started in its own process group, its output in a file."""

    def __init__(self, name: str, argv: list[str], root: Path, env: dict[str, str]):
        self.log_path = root / f"{name}.log"
        self.process = subprocess.Popen(argv, stdout=open(self.log_path, "w"),  # noqa: SIM115
                                        stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                        env=env, cwd=root, start_new_session=True, text=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            output = self.output()
            if text in output:
                return output
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not in the output of {self.log_path.name} "
                             f"(exit {self.process.poll()}):\n{self.output()[-4000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait()


def test_a_second_run_waits_or_is_refused_and_a_dead_runs_lock_is_taken_over(
        tmp_path, random_target_dir):
    from draftsmith.config import load_config
    from draftsmith.plan import RunPlan
    from draftsmith.target import resolve_target

    config_path = write_config(tmp_path, random_target_dir)
    config = load_config(config_path)
    run_root = Path(config.run_root)
    generate = RunPlan(config, resolve_target(config.target)).plan_for("generate")
    stage_lock = runlock.stage_lock_name("generate", generate.key)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    run = [str(BIN / "draftsmith"), "run", str(config_path), "--to", "merge"]
    holder = Process("holder", [sys.executable, "-c", (
        "import sys; from draftsmith import runlock\n"
        f"with runlock.hold({str(run_root)!r}, {stage_lock!r}, "
        "runlock.Holder(run='generate by hand', stage='generate'), None, 'generate'):\n"
        "    print('held', flush=True); sys.stdin.read()")], tmp_path, env)
    started = []
    try:
        holder.wait_for("held")
        a = Process("a", run, tmp_path, env)
        started.append(a)
        # A holds the run root, and waits inside its generate task for the stage's holder.
        a.wait_for("is in use by stage generate of run 'generate by hand'")
        b = Process("b", run, tmp_path, env)
        started.append(b)
        b_waits = b.wait_for(f"run root {run_root} is in use by run 'locked, data")
        assert f"pid {a.pid} on" in b_waits and "waiting for it (as long as it runs)" in b_waits
        refused = subprocess.run([*run, "--set", "orchestration.run_root_wait_s=0"], env=env,
                                 cwd=tmp_path, capture_output=True, text=True, timeout=600)
        said = refused.stdout + refused.stderr
        assert refused.returncode == 2, said
        assert f"run root {run_root} is in use by run 'locked, data" in said, said[-3000:]
        assert f"pid {a.pid} on" in said and "orchestration.run_root_wait_s=0" in said
        assert "stage generate" not in said.split("is in use by")[0][-200:]
        a.stop()  # kill -9: its lock is the kernel's to release
        b.wait_for("took over the lock of run 'locked, data")
        b.wait_for("is in use by stage generate of run 'generate by hand'")
        holder.process.stdin.close()  # the stage's other holder finishes
        assert holder.process.wait(timeout=60) == 0
        assert b.process.wait(timeout=600) == 0, b.output()[-4000:]
    finally:
        for process in (*started, holder):
            process.stop()
    output = b.output()
    for stage in ("generate", "merge"):
        assert f"stage {stage}: Completed" in output, output[-3000:]
    # Each prompt was answered once: by B, after the stage's other holder let go.
    journals = sorted((run_root / "generate" / "answers").glob("*/answers*.jsonl"))
    keys = [json.loads(line)["key"] for path in journals
            for line in path.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 2 * RECORDS
    assert not list((run_root / runlock.LOCKS_DIR).glob("*.json"))  # every lock let go
