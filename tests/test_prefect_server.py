"""Distributed mode against the real thing: `prefect server start` on a loopback port with its
own PREFECT_HOME and SQLite database, `draftsmith prefect setup`, one process worker per pool,
and the pipeline deployment started as the UI starts it (the REST API, the form's defaults).

The GPU worker sees one stand-in GPU (tests/fake_nvidia_smi.sh) that a service holds until the
first preflight has looked at it: generate's first attempt fails naming the holder, Prefect
retries it, and it succeeds.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from draftsmith.stages import names
from tests.conftest import REPO
from tests.test_sglang_launch import free_port

pytestmark = pytest.mark.e2e
STAGES = tuple(names())

BIN = Path(sys.executable).parent
GPU_STAGES = ["generate", "extract", "train", "deploy", "benchmark"]
API_KEY = "sk-draftsmith-test-0123456789"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class RetryingClient(httpx.Client):
    """Retries what the server answers 503 (SQLite busy under load), as Prefect's own client
    and the UI do."""

    def send(self, request, **kwargs):
        for _ in range(20):
            response = super().send(request, **kwargs)
            if response.status_code not in (429, 503):
                return response
            response.close()
            time.sleep(1)
        return response


class Server:
    """A Prefect server, its workers and the environment that points at them."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(root / "prefect-home"),
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("PREFECT_API_KEY", None)
        self.processes: dict[str, subprocess.Popen] = {}
        self.api = RetryingClient(base_url=self.url, timeout=60)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        self.processes[name] = subprocess.Popen(
            argv, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.root, start_new_session=True)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.processes["server"].poll() is not None:
                raise RuntimeError("prefect server exited:\n" + self.log("server")[-3000:])
            try:
                if self.api.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError("prefect server not healthy:\n" + self.log("server")[-3000:])

    def stop(self) -> None:
        self.api.close()
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for name, process in self.processes.items():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            with contextlib.suppress(ProcessLookupError):  # stragglers of its group
                os.killpg(process.pid, signal.SIGKILL)
            assert process.returncode is not None, name

    # The REST API the UI uses.
    def deployment(self, name: str) -> dict:
        response = self.api.get(f"/deployments/name/{name}")
        response.raise_for_status()
        return response.json()

    def flow_runs(self, **flow_run_filter) -> list[dict]:
        response = self.api.post("/flow_runs/filter", json={"flow_runs": flow_run_filter,
                                                            "sort": "START_TIME_ASC"})
        response.raise_for_status()
        return response.json()

    def task_runs(self, flow_run_id: str) -> list[dict]:
        response = self.api.post("/task_runs/filter",
                                 json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
        response.raise_for_status()
        return response.json()

    def wait_run(self, flow_run_id: str, timeout_s: float = 240) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.api.get(f"/flow_runs/{flow_run_id}").json()
            if run["state_type"] in TERMINAL:
                return run
            time.sleep(1)
        raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout_s}s; workers:\n"
                           + self.log("worker-cpu")[-2000:] + self.log("worker-gpu")[-2000:])


def stage_states(server: Server, pipeline_run: dict,
                 timeout_s: float = 30) -> dict[str, tuple[str, dict]]:
    """Each stage's task state, with the flow run it ran in (the pipeline's or a child's).
    Task run states reach the server as events, which it may record a moment after the flow
    run's final state: a task run without a state yet is read again."""
    deadline = time.monotonic() + timeout_s
    while True:
        children = server.flow_runs(parent_flow_run_id={"any_": [pipeline_run["id"]]})
        out, pending = {}, False
        for run in [pipeline_run, *children]:
            for task_run in server.task_runs(run["id"]):
                stage = task_run["name"].rsplit("-", 1)[0].replace("-", "_")
                if stage not in STAGES:  # resolve-target, or the task that links a child run
                    continue
                if task_run["state"] is None:
                    pending = True
                    continue
                out[stage] = (task_run["state"]["name"], run, task_run)
        if not pending or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefect-server")
    server = Server(root)
    try:
        server.start("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                "--port", str(server.port)])
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """examples/tiny.yaml, tinier: few records, one short epoch, two benchmark prompts."""
    root = tmp_path_factory.mktemp("orch")
    raw = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    for source in raw["data"]["sources"]:
        copy = root / os.path.basename(source["path"])
        shutil.copy(REPO / "examples" / source["path"], copy)
        source["path"] = str(copy)
        source["limit"] = 12
    raw["run_root"] = str(root / "runs")
    raw["merge"]["validation_fraction"] = 0.25  # a held-out prompt for the benchmark
    raw["generate"]["max_new_tokens"] = 16
    raw["train"].update(epochs=1, batch_tokens=1024)
    raw["benchmark"].update(num_prompts=1, max_new_tokens=8, warmup_prompts=0)
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def workers(server, config_file):
    setup = subprocess.run(
        [str(BIN / "draftsmith"), "prefect", "setup", str(config_file), "--gpus", "1",
         "--nccl", "NCCL_DEBUG=WARN", "--cron", "0 3 * * *",
         "--endpoint-url", "http://127.0.0.1:9/v1", "--endpoint-model", "tiny",
         "--api-key-env", "DRAFTSMITH_TEST_KEY"],
        env={**server.env, "DRAFTSMITH_TEST_KEY": API_KEY}, capture_output=True, text=True,
        timeout=180)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert API_KEY not in setup.stdout + setup.stderr
    fake = server.root / "bin"
    fake.mkdir()
    shutil.copy(REPO / "tests" / "fake_nvidia_smi.sh", fake / "nvidia-smi")
    for pool in ("cpu", "gpu"):
        env = {}
        if pool == "gpu":
            env = {"PATH": f"{fake}:{os.environ['PATH']}",
                   "FAKE_GPU_RELEASED": str(server.root / "gpu-released")}
        server.start(f"worker-{pool}", [str(BIN / "prefect"), "worker", "start", "--pool", pool,
                                        "--type", "process", "--name", f"{pool}-worker"], env)
    return setup.stdout


def start_from_ui(server: Server) -> tuple[dict, str]:
    """What the UI's Run button does: a flow run of the deployment with the form's values,
    which are the deployment's default parameters."""
    deployment = server.deployment("draftsmith-pipeline/cpu")
    response = server.api.post(f"/deployments/{deployment['id']}/create_flow_run",
                               json={"parameters": deployment["parameters"]})
    response.raise_for_status()
    return deployment, response.json()["id"]


@pytest.fixture(scope="module")
def first_run(server, workers):
    deployment, run_id = start_from_ui(server)
    return deployment, server.wait_run(run_id)


def test_setup_creates_pools_blocks_limit_and_deployments(server, workers, first_run):
    pools = {p["name"]: p["type"] for p in server.api.post("/work_pools/filter", json={}).json()}
    assert pools["cpu"] == "process" and pools["gpu"] == "process"
    limit = server.api.get("/v2/concurrency_limits/gpus-gpu-host").json()
    assert limit["limit"] == 1
    deployment, _ = first_run
    assert deployment["work_pool_name"] == "cpu"
    # The form: typed parameters from the pydantic config, defaults from the config file.
    schema = deployment["parameter_openapi_schema"]
    assert "config" in schema["properties"]
    assert deployment["parameters"]["config"]["orchestration"]["mode"] == "distributed"
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]
    for stage in GPU_STAGES:
        gpu = server.deployment(f"draftsmith-{stage}/gpu")
        assert gpu["work_pool_name"] == "gpu"
        assert gpu["job_variables"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
        assert gpu["job_variables"]["env"]["NCCL_DEBUG"] == "WARN"
    documents = server.api.post("/block_documents/filter", json={}).json()
    blocks = {b["name"]: b for b in documents}
    assert blocks["gpu-host"]["data"]["gpu_count"] == 1
    endpoint = blocks["inference-endpoint"]["data"]
    assert endpoint["base_url"] == "http://127.0.0.1:9/v1"
    assert endpoint["api_key_secret"] == "inference-endpoint-api-key"
    assert "inference-endpoint-api-key" in blocks
    assert API_KEY not in str(documents)  # a Secret: never shown
    automations = server.api.post("/automations/filter", json={}).json()
    trigger = [a for a in automations if a["name"].startswith("draftsmith: new data")]
    assert trigger and trigger[0]["trigger"]["expect"] == ["draftsmith.dataset.updated"]
    zombie = [a for a in automations if "heartbeats stopped" in a["name"]]
    assert zombie and zombie[0]["actions"][0]["state"] == "CRASHED"


def test_a_run_started_from_the_ui_completes_with_gpu_stages_on_the_gpu_worker(server,
                                                                            first_run):
    _, run = first_run
    assert run["state_type"] == "COMPLETED", run["state"]
    states = stage_states(server, run)
    assert {s: states[s][0] for s in states} == {
        "generate": "Completed", "merge": "Completed", "extract": "Completed",
        "train": "Completed", "export": "Completed", "deploy": "Completed",
        "benchmark": "Completed"}
    gpu_log, cpu_log = server.log("worker-gpu"), server.log("worker-cpu")
    for stage in GPU_STAGES:
        child = states[stage][1]
        assert child["id"] != run["id"] and child["work_pool_name"] == "gpu", stage
        assert f"submitting flow run '{child['id']}'" in gpu_log
        assert child["id"] not in cpu_log
    for stage in ("merge", "export"):
        assert states[stage][1]["id"] == run["id"]  # CPU stages stay in the pipeline's run
    assert f"submitting flow run '{run['id']}'" in cpu_log


def test_a_stage_that_failed_once_was_retried_and_succeeded(server, first_run):
    _, run = first_run
    _, _, task_run = stage_states(server, run)["generate"]
    assert task_run["run_count"] == 2 and task_run["state"]["type"] == "COMPLETED"
    history = server.api.get("/task_run_states/", params={"task_run_id": task_run["id"]}).json()
    names = [s["name"] for s in history]
    assert "AwaitingRetry" in names and names[-1] == "Completed"
    # The failure the UI shows in the task's log names the process that held the GPU.
    logs = server.api.post("/logs/filter", json={
        "logs": {"task_run_id": {"any_": [task_run["id"]]}}}).json()
    assert any("GPU 0: pid 4242 nv-hostengine" in entry["message"] for entry in logs)


def test_a_second_run_is_all_cached(server, first_run):
    _, run_id = start_from_ui(server)
    run = server.wait_run(run_id)
    assert run["state_type"] == "COMPLETED", run["state"]
    states = stage_states(server, run)
    assert {s: states[s][0] for s in states} == {s: "Cached" for s in STAGES}
    # Finished GPU stages need no GPU: no child run, no GPU slot taken.
    assert server.flow_runs(parent_flow_run_id={"any_": [run["id"]]}) == []


def test_a_new_data_event_starts_a_run_with_that_dataset(server, first_run, config_file):
    raw = yaml.safe_load(config_file.read_text())
    source = raw["data"]["sources"][1]
    # Same content under a new name: the run reads it, and content-addressed caching keeps
    # every stage cached (tests/test_pipeline_e2e.py covers new content).
    update = config_file.parent / "openai-update.jsonl"
    shutil.copy(source["path"], update)
    before = {r["id"] for r in server.flow_runs(
        deployment_id={"any_": [first_run[0]["id"]]})}
    notify = subprocess.run(
        [str(BIN / "draftsmith"), "prefect", "notify-new-data", str(update), "--source",
         source["name"]], env=server.env, capture_output=True, text=True, timeout=120)
    assert notify.returncode == 0, notify.stderr
    deadline = time.monotonic() + 60
    new = []
    while not new and time.monotonic() < deadline:
        new = [r for r in server.flow_runs(deployment_id={"any_": [first_run[0]["id"]]})
               if r["id"] not in before]
        time.sleep(1)
    assert new, "no run started by the draftsmith.dataset.updated event"
    run = server.wait_run(new[0]["id"])
    assert run["parameters"]["dataset"] == {"source": source["name"], "path": str(update)}
    assert run["state_type"] == "COMPLETED", run["state"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_cancelling_a_run_stops_the_server_it_started(server, first_run, config_file):
    """A served deploy on the gpu pool whose server never gets ready; cancelling the run from
    the UI stops the server's whole process group."""
    from draftsmith.config import load_config
    from draftsmith.plan import finished_outputs
    from draftsmith.target import resolve_target

    config = load_config(config_file)
    outputs = finished_outputs(config, resolve_target(config.target), "export")
    raw = config.model_dump(mode="json")
    raw["orchestration"]["mode"] = "distributed"
    raw["deploy"].update(engine="sglang", port=free_port(), startup_timeout_s=600,
                         sglang_command=[sys.executable, "-c", "import time; time.sleep(600)"])
    deployment = server.deployment("draftsmith-deploy/gpu")
    response = server.api.post(f"/deployments/{deployment['id']}/create_flow_run", json={
        "parameters": {"config": raw, "inputs": {
            name: outputs[name].model_dump(mode="json") for name in ("export", "merge",
                                                                      "target")}}})
    response.raise_for_status()
    run_id = response.json()["id"]
    pid, deadline = None, time.monotonic() + 90
    while pid is None and time.monotonic() < deadline:
        # The child's own log lines reach the run's log (what the UI shows).
        logs = server.api.post("/logs/filter", json={
            "logs": {"flow_run_id": {"any_": [run_id]}}}).json()
        started = [m for e in logs if (m := re.search(r"sglang: started pid (\d+)",
                                                       e["message"]))]
        pid = int(started[0].group(1)) if started else None
        time.sleep(1)
    assert pid is not None and alive(pid), server.log("worker-gpu")[-3000:]
    try:
        cancel_and_check(server, run_id, pid)
    finally:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def cancel_and_check(server: Server, run_id: str, pid: int) -> None:
    server.api.post(f"/flow_runs/{run_id}/set_state", json={
        "state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}).raise_for_status()
    run = server.wait_run(run_id, timeout_s=90)
    assert run["state_type"] == "CANCELLED"
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pid), f"the server (pid {pid}) outlived its cancelled run"
