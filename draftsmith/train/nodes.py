"""The train stage across hosts (train.nnodes > 1): one torchrun per GPU host, joined by
torchrun's c10d rendezvous into one job of nnodes x nproc_per_node ranks.

The stage runs in three steps, each where it belongs:
- `prepare_nodes` (the pipeline, before any node starts): the stage directory on the shared
  run root, kept when a killed attempt left a checkpoint, with no stale result or errors;
- `run_node` (each GPU host, its own flow run): its torchrun, which waits in the rendezvous
  until every node has joined. Ranks read and write the shared stage directory exactly as on
  one host: rank 0 writes metrics, checkpoints and the result, wherever c10d placed it;
- `join_nodes` (the pipeline, once every node finished): the chart and the manifest, from
  rank 0's result, as `run_train` finishes a one-host run.

A node that dies fails its own torchrun, and the others' (their collectives lose a peer):
every node's part fails as a crash, which the task retries; the nodes meet again in a new
rendezvous and resume from the last checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from draftsmith.artifacts import Descriptor, StagePlan
from draftsmith.config import DrafterConfig, TrainConfig
from draftsmith.hosts import HostPart
from draftsmith.serve.process import ManagedProcess
from draftsmith.train.launch import (
    INPUT_ERROR_FILE,
    RESULT_FILE,
    TrainCrashError,
    check_devices,
    finished_result,
    launch_failure,
    torchrun_argv,
    wait_for,
    write_job,
)
from draftsmith.train.trainer import OnlineInputs, finish_train, prepare_output, use_compile_cache

log = logging.getLogger(__name__)


def job_file(node: int) -> str:
    return f"torchrun_job.node{node}.json"


def log_file(node: int) -> str:
    return f"train.node{node}.log"


def prepare_nodes(plan: StagePlan) -> Path:
    """Before any node starts: the stage directory (a checkpoint to resume from is kept), and
    nothing left of an earlier attempt's result, errors or jobs."""
    out = prepare_output(plan)
    for stale in [out / RESULT_FILE, *out.glob(INPUT_ERROR_FILE.format(rank="*")),
                  *out.glob(job_file("*"))]:
        stale.unlink(missing_ok=True)
    return out


def run_node(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
             plan: StagePlan, node: HostPart, online: OnlineInputs | None = None,
             drafter_settings: DrafterConfig | None = None, poll_s: float = 0.5,
             on_start: Callable[[ManagedProcess], None] | None = None) -> dict:
    """This host's torchrun, as node `node.index` of cfg.nnodes; returns when the whole job
    has finished (every rank leaves together). Raises TrainInputError when a rank refused its
    input (no retry helps) and TrainCrashError otherwise (another attempt resumes)."""
    check_devices(cfg)
    out = plan.dir
    use_compile_cache(cfg, plan)
    job = out / job_file(node.index)
    write_job(job, cfg, hidden, merged, target, out, online, drafter_settings)
    env = {"OMP_NUM_THREADS": "1"} if not cfg.device.startswith("cuda") else {}
    log.info("train: %s, %d process(es) here, rendezvous %s (id %s)", node.where(),
             cfg.nproc_per_node, cfg.rdzv_endpoint, node.run_id)
    process = ManagedProcess(torchrun_argv(cfg, job, node), out / log_file(node.index),
                             env=env, name=f"torchrun node {node.index}")
    started = time.monotonic()
    code = wait_for(process, on_start, poll_s)  # cancellation (of the pipeline) kills it too
    if code != 0:
        # The stage directory is shared: rank 0's result may have been written on another node.
        if finished_result(out / RESULT_FILE) is None:
            raise launch_failure(
                out, out / log_file(node.index), code, process, where=f" {node.where()}",
                hint="; a node of the job failed or was lost (each node's log is "
                     f"train.node<i>.log in {out}); a retry resumes from the last checkpoint")
        log.warning("train %s: torchrun exited with code %s after every rank had finished "
                    "the run (%s records them); the result is kept, nothing is trained again",
                    node.where(), code, RESULT_FILE)
    return {"node": node.index, "host": node.host, "seconds": round(time.monotonic() - started, 1)}


def join_nodes(cfg: TrainConfig, plan: StagePlan,
               drafter_settings: DrafterConfig | None = None) -> Descriptor:
    """Every node finished: the stage's output from rank 0's result."""
    out = plan.dir
    result_path = out / RESULT_FILE
    result = finished_result(result_path)
    if result is None:
        raise TrainCrashError(f"train: every node finished but {result_path} is missing or "
                              "does not record every rank (rank 0 writes it last); run the "
                              "stage again: it resumes from the last checkpoint")
    result_path.unlink()
    for job in out.glob(job_file("*")):
        job.unlink()
    return finish_train(cfg, plan, result, drafter_settings)
