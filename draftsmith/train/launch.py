"""The train stage under torchrun: the parent writes a job file, starts torchrun in its own
process group (output streamed to train.log and the run log), waits, and kills the whole group
on failure, timeout or cancellation. Rank 0 writes the result the parent reads back."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from draftsmith.artifacts import Descriptor, atomic_write_json
from draftsmith.config import TrainConfig
from draftsmith.serve.process import ManagedProcess

log = logging.getLogger(__name__)

JOB_FILE = "torchrun_job.json"
RESULT_FILE = "torchrun_result.json"
LOG_FILE = "train.log"


class TrainLaunchError(RuntimeError):
    pass


def torchrun_argv(cfg: TrainConfig, job: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={cfg.nproc_per_node}", "-m", "draftsmith.train.worker", str(job)]


def run_torchrun(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
                 out: Path, poll_s: float = 0.5) -> dict:
    if cfg.parallel == "fsdp":
        raise TrainLaunchError("train.parallel=fsdp is not built yet; use ddp (the drafter, "
                               "optimiser state included, fits one GPU up to ~8B-shaped targets)")
    job = out / JOB_FILE
    result_path = out / RESULT_FILE
    result_path.unlink(missing_ok=True)
    atomic_write_json(job, {"train": cfg.model_dump(), "hidden": hidden.model_dump(mode="json"),
                            "merged": merged.model_dump(mode="json"),
                            "target": target.model_dump(mode="json"), "out": str(out)})
    env = {"OMP_NUM_THREADS": "1"} if not cfg.device.startswith("cuda") else {}
    process = ManagedProcess(torchrun_argv(cfg, job), out / LOG_FILE, env=env, name="torchrun")
    try:
        process.start()
        while process.exit_code() is None:
            time.sleep(poll_s)
    except BaseException:  # cancellation (KeyboardInterrupt, task cancel) kills the group too
        process.stop(grace_s=10)
        raise
    code = process.exit_code()
    process.stop(grace_s=10)  # stragglers of the group, and the reader thread
    if code != 0 or not result_path.is_file():
        raise TrainLaunchError(f"torchrun exited with code {code}; the last lines of "
                               f"{out / LOG_FILE}:\n{process.recent_output()}")
    result = json.loads(result_path.read_text())
    result_path.unlink()
    job.unlink()
    return result
