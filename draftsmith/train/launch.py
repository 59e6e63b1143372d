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
from draftsmith.hosts import HostPart
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


def torchrun_argv(cfg: TrainConfig, job: Path, node: HostPart | None = None) -> list[str]:
    """One host's torchrun. Alone: a standalone rendezvous. As `node` of cfg.nnodes hosts:
    the c10d rendezvous at cfg.rdzv_endpoint, whose store the first host serves (is_host; the
    others only connect). c10d numbers the nodes itself (it ignores --node-rank), so no
    node's rank is assumed: rank 0 writes to the shared run root wherever it runs."""
    where = ["--standalone"]
    if node is not None:
        timeout = int(cfg.rdzv_timeout_s)
        where = [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id={node.run_id}",
                 f"--rdzv-conf=is_host={'true' if node.index == 0 else 'false'},"
                 f"join_timeout={timeout},read_timeout={timeout}"]
        if node.address:  # where the others find this host's ranks (rank 0's store)
            where.append(f"--local-addr={node.address}")
    return [sys.executable, "-m", "torch.distributed.run", *where,
            f"--nproc_per_node={cfg.nproc_per_node}", "-m", "draftsmith.train.worker", str(job)]


def write_job(job: Path, cfg: TrainConfig, hidden: Descriptor, merged: Descriptor,
              target: Descriptor, out: Path, online=None, drafter_settings=None) -> None:
    """What every rank reads (`draftsmith.train.worker`): the settings and input descriptors."""
    atomic_write_json(job, {"train": cfg.model_dump(), "hidden": hidden.model_dump(mode="json"),
                            "merged": merged.model_dump(mode="json"),
                            "target": target.model_dump(mode="json"), "out": str(out),
                            "online": None if online is None else {
                                "extract": online.extract.model_dump(),
                                "target": online.target.model_dump()},
                            "drafter": None if drafter_settings is None
                            else drafter_settings.model_dump()})


def run_torchrun(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
                 out: Path, poll_s: float = 0.5,
                 on_start: Callable[[ManagedProcess], None] | None = None,
                 online=None, drafter_settings=None) -> dict:
    """Run the training job under torchrun and return rank 0's result. on_start receives the
    running process (its group id is its pid), e.g. to register it for cancellation.
    drafter_settings: the `drafter` section (DrafterConfig), default plain EAGLE-3."""
    check_devices(cfg)
    job = out / JOB_FILE
    result_path = out / RESULT_FILE
    result_path.unlink(missing_ok=True)
    for stale in out.glob(INPUT_ERROR_FILE.format(rank="*")):
        stale.unlink()
    write_job(job, cfg, hidden, merged, target, out, online, drafter_settings)
    env = {"OMP_NUM_THREADS": "1"} if not cfg.device.startswith("cuda") else {}
    process = ManagedProcess(torchrun_argv(cfg, job), out / LOG_FILE, env=env, name="torchrun")
    code = wait_for(process, on_start, poll_s)
    result = finished_result(result_path)
    if result is None:
        raise launch_failure(out, out / LOG_FILE, code, process)
    if code != 0:  # every rank had finished and the result was on disk: keep it
        log.warning("train: torchrun exited with code %s after all %d ranks had finished the "
                    "run (%s records them); the result is kept, nothing is trained again. "
                    "See %s", code, result["world"], RESULT_FILE, out / LOG_FILE)
    result["torchrun_exit_code"] = code
    result_path.unlink()
    job.unlink()
    return result


def wait_for(process: ManagedProcess, on_start: Callable[[ManagedProcess], None] | None = None,
             poll_s: float = 0.5) -> int:
    """Start torchrun, wait for it to exit and return its exit code. Cancellation
    (KeyboardInterrupt, a task cancel) kills its whole process group too."""
    try:
        process.start()
        if on_start:
            on_start(process)
        while process.exit_code() is None:
            time.sleep(poll_s)
    except BaseException:
        process.stop(grace_s=10)
        raise
    code = process.exit_code()
    process.stop(grace_s=10)  # stragglers of the group, and the reader thread
    return code


def launch_failure(out: Path, log_path: Path, code: int | None, process: ManagedProcess,
                   where: str = "", hint: str = "") -> TrainLaunchError:
    """Why a job left no finished result: a rank's refused input (the same on every attempt)
    or a crash (another attempt resumes from the last checkpoint)."""
    input_errors = sorted(out.glob(INPUT_ERROR_FILE.format(rank="*")))
    if input_errors:
        error = json.loads(input_errors[0].read_text())
        return TrainInputError(f"train{where}: {error['type']}: {error['message']} (torchrun "
                               f"exited with code {code}; log {log_path})")
    cause = worker_error(log_path)
    return TrainCrashError(f"train{where}: torchrun exited with code {code}"
                           + (f"; a worker failed with {cause}" if cause else "")
                           + hint + f"; the last lines of {log_path}:\n"
                           + process.recent_output())


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
