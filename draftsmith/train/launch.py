"""The train stage under torchrun: the parent writes a job file, starts torchrun in its own
process group (output streamed to train.log and the run log), waits, and kills the whole group
on failure, timeout or cancellation. Rank 0 writes the result the parent reads back.
`train.parallel: ddp` (gradients all-reduced) or `fsdp` (the drafter sharded,
`draftsmith/train/fsdp.py`; always under torchrun, one process included)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from draftsmith.artifacts import Descriptor, atomic_write_json
from draftsmith.config import TrainConfig
from draftsmith.errors import InputError, WorkerCrashError
from draftsmith.serve.process import ManagedProcess

log = logging.getLogger(__name__)

JOB_FILE = "torchrun_job.json"
RESULT_FILE = "torchrun_result.json"
INPUT_ERROR_FILE = "torchrun_input_error.rank{rank}.json"  # a rank's InputError, for the parent
LOG_FILE = "train.log"


class TrainLaunchError(RuntimeError):
    """The training job did not finish; one of the two kinds below says whether to retry."""


class TrainCrashError(WorkerCrashError, TrainLaunchError):
    """A rank died or failed for a reason that is not the input's (killed, out of memory, a
    lost peer): another attempt resumes from the last checkpoint."""


class TrainInputError(InputError, TrainLaunchError):
    """The job cannot run as configured (devices, a drafter to fine-tune, a resume state):
    every attempt fails the same way."""


def torchrun_argv(cfg: TrainConfig, job: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={cfg.nproc_per_node}", "-m", "draftsmith.train.worker", str(job)]


def run_torchrun(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
                 out: Path, poll_s: float = 0.5,
                 on_start: Callable[[ManagedProcess], None] | None = None,
                 online=None) -> dict:
    """Run the training job under torchrun and return rank 0's result. on_start receives the
    running process (its group id is its pid), e.g. to register it for cancellation."""
    check_devices(cfg)
    job = out / JOB_FILE
    result_path = out / RESULT_FILE
    result_path.unlink(missing_ok=True)
    for stale in out.glob(INPUT_ERROR_FILE.format(rank="*")):
        stale.unlink()
    atomic_write_json(job, {"train": cfg.model_dump(), "hidden": hidden.model_dump(mode="json"),
                            "merged": merged.model_dump(mode="json"),
                            "target": target.model_dump(mode="json"), "out": str(out),
                            "online": None if online is None else {
                                "extract": online.extract.model_dump(),
                                "target": online.target.model_dump()}})
    env = {"OMP_NUM_THREADS": "1"} if not cfg.device.startswith("cuda") else {}
    process = ManagedProcess(torchrun_argv(cfg, job), out / LOG_FILE, env=env, name="torchrun")
    try:
        process.start()
        if on_start:
            on_start(process)
        while process.exit_code() is None:
            time.sleep(poll_s)
    except BaseException:  # cancellation (KeyboardInterrupt, task cancel) kills the group too
        process.stop(grace_s=10)
        raise
    code = process.exit_code()
    process.stop(grace_s=10)  # stragglers of the group, and the reader thread
    result = finished_result(result_path)
    if result is None:
        input_errors = sorted(out.glob(INPUT_ERROR_FILE.format(rank="*")))
        if input_errors:  # a rank refused its input: the same on every attempt
            error = json.loads(input_errors[0].read_text())
            raise TrainInputError(f"train: {error['type']}: {error['message']} (torchrun exited "
                                  f"with code {code}; log {out / LOG_FILE})")
        cause = worker_error(out / LOG_FILE)
        raise TrainCrashError(f"torchrun exited with code {code}"
                              + (f"; a worker failed with {cause}" if cause else "")
                              + f"; the last lines of {out / LOG_FILE}:\n"
                              + process.recent_output())
    if code != 0:  # every rank had finished and the result was on disk: keep it
        log.warning("train: torchrun exited with code %s after all %d ranks had finished the "
                    "run (%s records them); the result is kept, nothing is trained again. "
                    "See %s", code, result["world"], RESULT_FILE, out / LOG_FILE)
    result["torchrun_exit_code"] = code
    result_path.unlink()
    job.unlink()
    return result


def finished_result(path: Path) -> dict | None:
    """Rank 0's result, only if it records that every rank finished (draftsmith/train/worker.py
    writes it, atomically, after a collective that every rank joins once its share of the run
    is done): None when there is none or it records fewer ranks."""
    try:
        result = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    world = result.get("world")
    if not isinstance(world, int) or result.get("ranks_finished") != list(range(world)):
        return None
    return result


def check_devices(cfg: TrainConfig) -> None:
    """Before starting anything: the GPUs the processes will take exist. (Counting them does
    not create a CUDA context in this process.)"""
    if not cfg.device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise TrainInputError(f"train.device={cfg.device}: torch {torch.__version__} sees no "
                               "CUDA device here; set train.device=cpu (gloo) or run the train "
                               "stage on the GPU host")
    visible = torch.cuda.device_count()
    if cfg.nproc_per_node > visible:
        raise TrainInputError(
            f"train.nproc_per_node={cfg.nproc_per_node} but {visible} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): one "
            "process per GPU; lower train.nproc_per_node or make more GPUs visible")


def worker_error(log_file: Path) -> str | None:
    """The first exception a worker raised, from the log (torchrun's own summary, printed
    last, names only exit codes)."""
    if not log_file.is_file():
        return None
    for line in log_file.read_text(errors="replace").splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())  # torchrun's per-rank prefix
        match = re.match(r"^([\w.]*(?:Error|Exception)): (.+)", line)
        if match and "ChildFailedError" not in match.group(1):
            return f"{match.group(1)}: {match.group(2)}"
    return None
