"""Two GPU hosts on this CPU, through the real thing: the session's Prefect server
(tests/conftest.py `prefect_api`), `draftsmith prefect setup` with two GPU host blocks, one
process worker per host (each polls only its host's work queue), the pipeline flow dispatching
one child run per host, and real torchrun processes joined by the c10d rendezvous (gloo).

Host b's worker runs in its own mount namespace with a tmpfs over `blind/`: a run root there
is a directory host b does not share, as on a machine that never mounted the shared storage.
It also carries tests/kill_hook on its PYTHONPATH: while the kill file exists, its training
rank dies (SIGKILL) as its Nth optimiser step begins, once.

One pipeline run spreads extract (a range of the shards per host) and train (one node per
host, host b's killed after the checkpoint of step 4) and is checked against one host's
extraction and a one-host, two-process training of the same inputs. A second run on the blind
run root is refused before any training starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.config import parse_config
from tests.conftest import REPO, TRAIN_INPUT_SECTIONS, TRAIN_INPUT_SOURCES
from tests.test_sglang_launch import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

BIN = Path(sys.executable).parent
HOSTS = ["host-a", "host-b"]
KILL_AT_STEP = 5  # checkpoints every 2 steps: the retry resumes from step 4


def config(target_dir: Path, run_root: Path, rdzv_port: int) -> dict:
    """The training tests' inputs and their two-process training (tests/conftest.py
    train_inputs, one_host_two_processes), on two hosts of one process each."""
    from tests.test_train_loop import torchrun_cfg

    train = torchrun_cfg().model_dump(mode="json", exclude_defaults=True)
    train.update(nproc_per_node=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{rdzv_port}",
                 rdzv_timeout_s=600)
    return {
        "name": "multi-host", "run_root": str(run_root),
        "target": {"model": str(target_dir)},
        "data": {"sources": TRAIN_INPUT_SOURCES}, **TRAIN_INPUT_SECTIONS, "train": train,
        "orchestration": {"mode": "distributed", "gpu_hosts": HOSTS, "gpu_host": HOSTS[0],
                          "poll_interval_s": 1, "stage_timeout_s": 1500,
                          "shared_storage_wait_s": 5},
    }


class Workers:
    """One process worker per GPU host, each in its own process group."""

    def __init__(self, root: Path, api_url: str):
        self.root, self.processes = root, {}
        self.env = {**os.environ, "PREFECT_API_URL": api_url,
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
                    "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [
                        str(REPO), os.environ.get("PYTHONPATH")]))}
        self.env.pop("PREFECT_API_KEY", None)

    def start(self, host: str, wrap: list[str] | None = None,
              env: dict[str, str] | None = None) -> None:
        argv = [str(BIN / "prefect"), "worker", "start", "--pool", "gpu", "--work-queue", host,
                "--type", "process", "--name", host]
        log = open(self.root / f"worker-{host}.log", "w")  # noqa: SIM115 (closed with it)
        self.processes[host] = subprocess.Popen(
            [*(wrap or []), *argv], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.root, start_new_session=True,
            env={**self.env, "PREFECT_HOME": str(self.root / f"prefect-home-{host}"),
                 **(env or {})})

    def log(self, host: str) -> str:
        return (self.root / f"worker-{host}.log").read_text()

    def stop(self, grace_s: float = 20) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):  # it, or stragglers of its group
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def cluster(prefect_api, tmp_path_factory, random_target_dir):
    """setup with two GPU host blocks, and their workers: host a plain, host b blind to
    `blind/` and carrying the kill hook."""
    from prefect.settings import PREFECT_API_URL

    from deployments.setup import SetupOptions, setup

    root = tmp_path_factory.mktemp("multi-host")
    blind = root / "blind"
    blind.mkdir()
    raw = config(random_target_dir, root / "runs" / "multi-host", free_port())
    ids = setup(parse_config(raw), SetupOptions(
        hosts=HOSTS, addresses={host: "127.0.0.1" for host in HOSTS}, gpu_count=1,
        # No automations on the session's shared server: Prefect < 3.8.6 on SQLite can hang
        # creating one (PrefectHQ/prefect#23055); test_prefect_server tests them on its own.
        shared_path=str(root), zombie_after_s=None, rerun_on_new_data=False))
    workers = Workers(root, PREFECT_API_URL.value())
    workers.start(HOSTS[0])
    # A mount namespace of its own (unshare: a user namespace too, so no root is needed): the
    # tmpfs over blind/ is seen by this worker and what it starts, by nothing else.
    workers.start(HOSTS[1], wrap=["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                                  'mount -t tmpfs tmpfs "$0" && exec "$@"', str(blind)],
                  env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "kill_hook"),
                                                      workers.env["PYTHONPATH"]]),
                       "DRAFTSMITH_TEST_KILL_FILE": str(root / "kill-at-step")})
    try:
        yield {"root": root, "blind": blind, "raw": raw, "deployments": ids,
               "workers": workers}
    finally:
        workers.stop()


def flow_runs(**flow_run_filter) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(**flow_run_filter))


def part_task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[flow_run_id])))
    return [r for r in runs if r.name.split("-part")[0] in ("extract", "train")
            and "-part" in r.name]


def children(stage: str, parent_id) -> list:
    """The child runs of one stage's parts, by host."""
    from prefect.client.schemas.filters import FlowRunFilterParentFlowRunId

    runs = flow_runs(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]))
    return sorted((r for r in runs if r.name.startswith(f"{stage} ")),
                  key=lambda r: r.parameters["part"]["index"])


def run_pipeline(raw: dict, stages: list[str]):
    """The pipeline flow here, against the session's server; its final state."""
    from flows.pipeline import pipeline

    return pipeline(full_config=raw, stages=stages, return_state=True)


def flow_run(state):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id)


@pytest.fixture(scope="module")
def spread_run(cluster, random_target):
    """generate and merge here, then the pipeline with extract and train on the two hosts,
    host b's node killed once mid-training."""
    from draftsmith.plan import run_in_process

    raw = cluster["raw"]
    run_in_process(parse_config(raw), random_target, ["generate", "merge"])
    (cluster["root"] / "kill-at-step").write_text(str(KILL_AT_STEP))
    started = time.monotonic()
    state = run_pipeline(raw, ["extract", "train"])
    seconds = time.monotonic() - started
    assert state.is_completed(), state.message
    return {"results": state.result(), "parent": flow_run(state), "seconds": seconds}


def test_setup_gives_each_host_a_block_a_queue_a_gpu_limit_and_deployments(cluster):
    from prefect.client.orchestration import get_client

    from blocks.gpu_host import GpuHost

    with get_client(sync_client=True) as client:
        for host in HOSTS:
            assert GpuHost.load(host).gpu_count == 1
            assert GpuHost.load(host).address == "127.0.0.1"
            assert client.read_global_concurrency_limit_by_name(f"gpus-{host}").limit == 1
            for stage in ("generate", "extract", "train", "deploy", "benchmark"):
                deployment = client.read_deployment_by_name(f"draftsmith-{stage}/{host}")
                assert deployment.work_pool_name == "gpu"
                assert deployment.work_queue_name == host  # only that host's worker polls it
                assert deployment.parameters == {"host": host}
    pipeline = cluster["deployments"]
    assert "draftsmith-pipeline/cpu" in pipeline
    # rerun_on_new_data=False: no trigger automation (nor any other) on this server
    with get_client(sync_client=True) as client:
        assert client.read_automations() == []


def test_each_part_ran_on_its_own_host(cluster, spread_run):
    results, parent = spread_run["results"], spread_run["parent"]
    assert results["extract"]["state"] == "Completed"
    assert results["train"]["state"] == "Completed"
    logs = {host: cluster["workers"].log(host) for host in HOSTS}
    for stage in ("extract", "train"):
        runs = children(stage, parent.id)
        assert [r.parameters["part"]["host"] for r in runs] == HOSTS
        for run, host in zip(runs, HOSTS, strict=True):
            assert run.state.is_completed(), (run.name, run.state)
            assert run.work_queue_name == host
            assert f"submitting flow run '{run.id}'" in logs[host]
            other = HOSTS[1 - HOSTS.index(host)]
            assert str(run.id) not in logs[other]


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under a stage directory but its manifest (which names the directory)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*")
            if p.is_file() and p.name != "manifest.json"}


def test_a_two_host_extraction_is_byte_identical_to_one_hosts(spread_run, train_inputs):
    """Each host wrote its range of the shards, the join wrote the index: the same bytes,
    file for file, as one host extracting the same data (tests/conftest.py train_inputs)."""
    results = spread_run["results"]
    # The same data first: the merged records one host extracted from.
    assert files_of(Path(results["merge"]["descriptor"]["path"])) == files_of(
        train_inputs["merged"].dir)
    spread, alone = Path(results["extract"]["descriptor"]["path"]), train_inputs["hidden"].dir
    two_hosts, one_host = files_of(spread), files_of(alone)
    assert sorted(two_hosts) == sorted(one_host)
    assert len([f for f in two_hosts if f.endswith(".safetensors")]) == 3
    assert "store.json" in two_hosts and any(f.startswith(".receipts/") for f in two_hosts)
    for name in one_host:
        assert two_hosts[name] == one_host[name], name
    assert results["extract"]["descriptor"]["fingerprint"] == train_inputs["hidden"].fingerprint
    ranges = [r.parameters["part"] for r in children("extract", spread_run["parent"].id)]
    assert [(p["index"], p["count"], p["kind"]) for p in ranges] == [(0, 2, "range"),
                                                                      (1, 2, "range")]


def test_two_nodes_of_one_process_train_what_one_node_of_two_trains(spread_run,
                                                                   one_host_two_processes):
    """Same data, two ranks either way: on two hosts joined by the rendezvous (one of them
    killed and resumed on the way) they reach the weights of one host's two processes
    (tests/conftest.py one_host_two_processes)."""
    result, alone = one_host_two_processes
    trained = Path(spread_run["results"]["train"]["descriptor"]["path"])
    history = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [(h["split"], h["step"]) for h in history] == [
        (h["split"], h["step"]) for h in result["history"]]
    for x, y in zip(result["history"], history, strict=True):
        for key in x:
            if key.startswith(("loss_", "full_acc_", "cond_acc_", "tau", "lr")):
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (x["step"], key)
    wa, wb = load_file(str(alone / "drafter.safetensors")), load_file(
        str(trained / "drafter.safetensors"))
    assert set(wa) == set(wb)
    for name in wa:  # float32; gloo sums the same two gradients either way
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-5, atol=1e-6, msg=name)
    assert spread_run["results"]["train"]["descriptor"]["counts"]["steps"] == result["steps"]


def test_a_node_killed_mid_training_is_retried_and_resumes(cluster, spread_run):
    """Host b's rank died at step 5: both nodes' torchruns failed, each part's task retried,
    and the nodes met again in a new rendezvous, resuming from the checkpoint of step 4."""
    assert not (cluster["root"] / "kill-at-step").exists(), "the kill hook never fired"
    nodes = children("train", spread_run["parent"].id)
    killed = part_task_runs(nodes[1].id)
    assert len(killed) == 1 and killed[0].run_count == 2, killed
    assert killed[0].state.is_completed()
    trained = Path(spread_run["results"]["train"]["descriptor"]["path"])
    log_b = (trained / "train.node1.log").read_text()
    commands = [line for line in log_b.splitlines() if line.startswith("$ ")]
    assert len(commands) == 2  # the first attempt, and the retry
    assert all("--local-addr=127.0.0.1" in c and "is_host=false" in c for c in commands)
    assert "exitcode  : -9" in log_b or "Signals.SIGKILL" in log_b, log_b[-3000:]
    assert "resuming from" in log_b and "at step 4" in log_b
    assert not (trained / "resume").exists()  # finished: resume state removed
    # The metrics file reads as one uninterrupted run.
    steps = [json.loads(line)["step"] for line in
             (trained / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 14


def test_a_run_root_one_host_cannot_see_is_refused_before_training(cluster, spread_run,
                                                                    random_target):
    """The same stages on a run root under blind/: host b sees an empty tmpfs there. Its
    node refuses at once (an input error: not retried), the other node is cancelled, and
    nothing is trained."""
    from draftsmith.artifacts import Descriptor
    from draftsmith.plan import stage_plan

    shared = Path(cluster["raw"]["run_root"])
    blind_root = cluster["blind"] / "runs" / "multi-host"
    for stage in ("generate", "merge", "extract"):  # finished outputs, as the pipeline sees
        shutil.copytree(shared / stage, blind_root / stage)
    raw = {**cluster["raw"], "run_root": str(blind_root),
           "train": {**cluster["raw"]["train"], "rdzv_endpoint": f"127.0.0.1:{free_port()}"}}
    state = run_pipeline(raw, ["train"])
    assert state.is_failed()
    message = " ".join(str(state.result(raise_on_failure=False)).split())
    assert "train: node 1 of 2 (GPU host host-b) failed" in message, message
    assert "SharedStorageError" in message and "other nodes were cancelled" in message, message
    assert "this host does not see" in message and "must be one storage" in message, message
    nodes = children("train", flow_run(state).id)
    tasks = part_task_runs(nodes[1].id)
    assert len(tasks) == 1 and tasks[0].run_count == 1, tasks  # refused once, never retried
    assert nodes[0].state.name in ("Cancelled", "Cancelling"), nodes[0].state
    inputs = {name: Descriptor.model_validate(spread_run["results"][name]["descriptor"])
              for name in ("extract", "merge")}
    train_dir = stage_plan(parse_config(raw), "train", {**inputs, "target": random_target}).dir
    assert train_dir.parent.parent == blind_root
    assert not (train_dir / "metrics.jsonl").exists()  # no step was trained
    assert not (train_dir / "resume").exists()
