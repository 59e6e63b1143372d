"""Distributed mode against the real thing: `prefect server start` (with its UI) on a loopback
port with its own PREFECT_HOME and SQLite database, `draftsmith prefect setup`, one process
worker per pool, and the pipeline deployment started as the UI starts it (the REST API, the
form's defaults). What a user sees is checked where they see it: the artifacts (keyed per
pipeline, with charts, shown by the UI in headless Chromium), the run summary, run names, new
data that sticks across runs, per-source generation, runs queued under the deployment's
concurrency limit, where generate runs for each backend (a `transformers serve` the user started
as its loopback endpoint), and the data watcher starting a run when a data file changes.

The GPU worker sees one stand-in GPU (tests/fake_nvidia_smi.sh) that a service holds until the
first preflight has looked at it: generate's first attempt fails naming the holder, Prefect
retries it, and it succeeds.
"""

from __future__ import annotations

import contextlib
import json
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

from deployments.setup import LEASES_ON_DISK, lease_storage_warning
from draftsmith.config import load_config
from draftsmith.data.source_fingerprints import data_descriptors, data_version
from draftsmith.stages import STAGES as STAGE_TABLE
from draftsmith.stages import names
from tests import browser
from tests.conftest import REPO
from tests.test_sglang_launch import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]  # first_run waits up to 900 s
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
        self.ui = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.ui}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(root / "prefect-home"),
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "true",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            # A run queued behind the deployment's concurrency limit tries again after this.
            "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            # No scheduled runs: the data watcher's interval schedule is active, and its looks
            # are the test's to time (the pipeline's cron schedule is paused anyway).
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "PYTHONUNBUFFERED": "1",
            # Leases of concurrency slots survive a restart of the server (docs/faults.md).
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": LEASES_ON_DISK,
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

    def stop(self, grace_s: float = 20) -> None:
        """The workers, then the server, as a user stops them: SIGTERM to each process group,
        SIGKILL to what still runs grace_s later. The workers share one grace period: in the
        full suite both outlive it (seen at 3 runs of 3; alone they exit in a second). What
        each process did is written to stop.log in the server's root."""
        self.api.close()
        workers = {name: p for name, p in self.processes.items() if name != "server"}
        with open(self.root / "stop.log", "w") as log:
            for group in (workers, {"server": self.processes["server"]}):
                started = time.monotonic()
                for process in group.values():
                    if process.poll() is None:
                        os.killpg(process.pid, signal.SIGTERM)
                for name, process in group.items():
                    try:
                        process.wait(timeout=max(0.0, started + grace_s - time.monotonic()))
                        log.write(f"{name}: exited {process.returncode} after "
                                  f"{time.monotonic() - started:.1f} s\n")
                    except subprocess.TimeoutExpired:
                        log.write(f"{name}: killed, still running after {grace_s} s\n")
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
                    with contextlib.suppress(ProcessLookupError):  # stragglers of its group
                        os.killpg(process.pid, signal.SIGKILL)

    @contextlib.contextmanager
    def pool_paused(self, pool: str):
        """The pool's workers take none of its runs until the block ends."""
        self.api.patch(f"/work_pools/{pool}", json={"is_paused": True}).raise_for_status()
        try:
            yield
        finally:
            self.api.patch(f"/work_pools/{pool}", json={"is_paused": False}).raise_for_status()

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

    def artifacts(self, key: str, **artifact_filter) -> list[dict]:
        """Every version of an artifact key, oldest first."""
        response = self.api.post("/artifacts/filter", json={
            "artifacts": {"key": {"any_": [key]}, **artifact_filter}, "sort": "CREATED_DESC"})
        response.raise_for_status()
        return response.json()[::-1]

    def wait_run(self, flow_run_id: str, timeout_s: float = 900) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.api.get(f"/flow_runs/{flow_run_id}").json()
            if run["state_type"] in TERMINAL:
                return run
            time.sleep(1)
        raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout_s}s; workers:\n"
                           + self.log("worker-cpu")[-2000:] + self.log("worker-gpu")[-2000:])


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def stage_states(server: Server, pipeline_run: dict,
                 timeout_s: float = 180) -> dict[str, tuple[str, dict]]:
    """Each stage's final task state, with the flow run it ran in (the pipeline's or a
    child's). Task runs and their states reach the server as events, which it may record well
    after the flow run's final state on a busy machine: read again until every stage's task
    run is there in a final state (or the timeout, and the caller's assertion says what is
    missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        children = server.flow_runs(parent_flow_run_id={"any_": [pipeline_run["id"]]})
        out, pending = {}, False
        for run in [pipeline_run, *children]:
            for task_run in server.task_runs(run["id"]):
                stage = task_run["name"].rsplit("-", 1)[0].replace("-", "_")
                if stage not in STAGES:  # resolve-target, or the task that links a child run
                    continue
                if task_run["state"] is None or task_run["state"]["type"] not in FINAL:
                    pending = True
                    continue
                out[stage] = (task_run["state"]["name"], run, task_run)
        if (not pending and len(out) == len(STAGES)) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_target_cache):
    """The server and its workers run builtin:tiny from the run's cache (its environment)."""
    root = tmp_path_factory.mktemp("prefect-server")
    server = Server(root)
    try:
        server.start("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                "--port", str(server.port)])
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def write_tiny_config(root: Path) -> Path:
    """examples/tiny.yaml, tinier: few records, one short epoch, two benchmark prompts."""
    raw = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    for source in raw["data"]["sources"]:  # their first 12 records
        copy = root / os.path.basename(source["path"])
        lines = (REPO / "examples" / source["path"]).read_text().splitlines(keepends=True)
        copy.write_text("".join(lines[:12]))
        source["path"] = str(copy)
    raw["run_root"] = str(root / "runs")
    raw["merge"]["validation_fraction"] = 0.25  # a held-out prompt for the benchmark
    raw["generate"]["max_new_tokens"] = 16
    raw["train"].update(epochs=1, batch_tokens=1024)
    raw["benchmark"].update(num_prompts=1, max_new_tokens=8, warmup_prompts=0)
    # The pipeline reads each GPU stage's child run every second (default 2 s; the two-host
    # tests do the same): about a second less per child run, of which the module has ~20.
    raw["orchestration"] = {"poll_interval_s": 1}
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("orch"))


def start_workers(server: Server, config_file: Path) -> str:
    """`draftsmith prefect setup`, then one process worker per pool; the GPU worker sees one
    stand-in GPU. Returns setup's output."""
    setup = subprocess.run(
        [str(BIN / "draftsmith"), "prefect", "setup", str(config_file), "--gpus", "1",
         "--nccl", "NCCL_DEBUG=WARN", "--cron", "0 3 * * *", "--watch-data", "3600",
         "--endpoint-url", "http://127.0.0.1:9/v1", "--endpoint-model", "tiny",
         "--api-key-env", "DRAFTSMITH_TEST_KEY"],
        env={**server.env, "DRAFTSMITH_TEST_KEY": API_KEY}, capture_output=True, text=True,
        timeout=180)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert API_KEY not in setup.stdout + setup.stderr
    assert "prefect deployment schedule resume draftsmith-pipeline/cpu" in " ".join(
        setup.stderr.split())  # how to start the paused cron schedule
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


@pytest.fixture(scope="module")
def workers(server, config_file):
    return start_workers(server, config_file)


def start_from_ui(server: Server, **parameters) -> tuple[dict, str]:
    """What the UI's Run button does: a flow run of the deployment with the form's values,
    which are the deployment's default parameters (and what the user changed)."""
    deployment = server.deployment("draftsmith-pipeline/cpu")
    response = server.api.post(f"/deployments/{deployment['id']}/create_flow_run",
                               json={"parameters": {**deployment["parameters"], **parameters}})
    response.raise_for_status()
    return deployment, response.json()["id"]


@pytest.fixture(scope="module")
def first_run(server, workers):
    deployment, run_id = start_from_ui(server)
    return deployment, server.wait_run(run_id)


def test_setup_creates_pools_blocks_limit_and_deployments(server, workers, first_run,
                                                          config_file):
    pools = {p["name"]: p["type"] for p in server.api.post("/work_pools/filter", json={}).json()}
    assert pools["cpu"] == "process" and pools["gpu"] == "process"
    limit = server.api.get("/v2/concurrency_limits/gpus-gpu-host").json()
    assert limit["limit"] == 1
    deployment, _ = first_run
    assert deployment["work_pool_name"] == "cpu"
    assert deployment["global_concurrency_limit"]["limit"] == 1  # runs queue, never overlap
    # The form's defaults: the config file, and the overrides that select distributed mode.
    assert deployment["parameters"] == {
        "config": str(config_file),
        "overrides": ["orchestration.mode=distributed", "orchestration.gpu_host=gpu-host",
                      "orchestration.endpoint_block=inference-endpoint"]}
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]
    comparison = server.deployment("draftsmith-compare/cpu")  # comparing configs from the UI
    assert comparison["work_pool_name"] == "cpu"
    assert comparison["parameters"] == deployment["parameters"]
    assert list(comparison["parameter_openapi_schema"]["properties"]) == [
        "config", "variants", "overrides", "stages", "full_config"]
    assert [s["active"] for s in deployment["schedules"]] == [False]  # paused until resumed
    watcher = server.deployment("draftsmith-watch-data/cpu")
    assert watcher["work_pool_name"] == "cpu" and watcher["parameters"] == deployment[
        "parameters"]
    assert [(s["schedule"]["interval"], s["active"]) for s in watcher["schedules"]] == [
        (3600.0, True)]
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


def test_the_form_is_short_typed_and_described(server, workers):
    """The run form: a few typed fields a user understands, the stages as a multi-select of
    the table's names, the whole config behind one advanced field."""
    schema = server.deployment("draftsmith-pipeline/cpu")["parameter_openapi_schema"]
    fields = schema["properties"]
    assert list(fields) == ["config", "stages", "dataset", "epochs", "ttt_steps", "engine",
                            "overrides", "full_config"]
    stages_field = fields["stages"]  # a multi-select, empty: all
    assert stages_field["type"] == "array" and stages_field["items"]["enum"] == list(STAGES)
    assert stages_field["default"] == [] and fields["config"]["type"] == "string"
    assert fields["engine"]["anyOf"][0]["enum"][:2] == ["embedded", "sglang"]
    assert fields["full_config"]["anyOf"][0]["type"] == "object"  # one JSON field
    for name, field in fields.items():
        assert field.get("description"), name
        assert ".md" not in field["description"] and "REFERENCE" not in field["description"]
    assert "Advanced" in fields["full_config"]["description"]


def test_a_bad_stage_name_is_refused_with_the_valid_ones(server, workers):
    deployment = server.deployment("draftsmith-pipeline/cpu")
    response = server.api.post(f"/deployments/{deployment['id']}/create_flow_run", json={
        "parameters": {**deployment["parameters"], "stages": ["trian"]}})
    assert response.status_code in (409, 422), response.text
    assert "'trian' is not one of" in response.text
    assert all(name in response.text for name in STAGES)


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


def run_name(config_file: Path) -> str:
    config = load_config(config_file)
    return f"tiny, data {data_version(data_descriptors(config))}"


def test_runs_are_named_after_the_config_and_data_children_after_their_parent(
        server, first_run, config_file):
    _, run = first_run
    run = server.api.get(f"/flow_runs/{run['id']}").json()
    assert run["name"] == run_name(config_file)
    states = stage_states(server, run)
    for stage in GPU_STAGES:
        assert states[stage][1]["name"] == f"{stage} for {run['name']}"


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


def latest(server: Server, key: str, **artifact_filter) -> dict:
    versions = server.artifacts(key, **artifact_filter)
    assert versions, f"no artifact {key}"
    return versions[-1]


def test_metrics_are_keyed_artifacts_of_the_pipeline(server, first_run):
    """Each report is an artifact keyed draftsmith-<pipeline>-<report>, so the Artifacts page
    lists it and its versions accumulate per pipeline; values are rounded; the training table
    has its logged steps as well as validation, tau and acceptance first."""
    _, run = first_run
    runs = {run["id"], *(c["id"] for c in server.flow_runs(
        parent_flow_run_id={"any_": [run["id"]]}))}
    mine = {"flow_run_id": {"any_": sorted(runs)}}
    keys = ["generate-sources", "generate-summary", "merge-sources", "merge-vocab", "train",
            "train-summary", "benchmark", "benchmark-configs", "run", "generate-progress",
            "extract-progress", "train-progress", "benchmark-progress"]
    for key in keys:
        latest(server, f"draftsmith-tiny-{key}", **mine)
    train = latest(server, "draftsmith-tiny-train", **mine)["data"]
    rows = train if isinstance(train, list) else json.loads(train)
    assert {r["split"] for r in rows} == {"train", "validation"}
    assert list(rows[0])[:5] == ["split", "epoch", "step", "tau", "acceptance_replayed"]
    for row in rows:
        for value in row.values():
            if isinstance(value, float):
                assert value == round(value, 4)
    configs = latest(server, "draftsmith-tiny-benchmark-configs", **mine)["data"]
    configs = configs if isinstance(configs, list) else json.loads(configs)
    assert list(configs[0])[:2] == ["config", "acceptance_length"]
    progress = latest(server, "draftsmith-tiny-train-progress", **mine)
    assert progress["type"] == "progress" and progress["data"] == 100.0
    for report in ("train-summary", "benchmark"):
        text = latest(server, f"draftsmith-tiny-{report}", **mine)["data"]
        assert "](data:image/png;base64," in text  # the chart travels in the artifact


def test_the_run_ends_with_its_summary(server, first_run):
    _, run = first_run
    summary = latest(server, "draftsmith-tiny-run", flow_run_id={"any_": [run["id"]]})
    text = summary["data"]
    assert summary["type"] == "markdown"
    for heading in ("records", "tau", "measured acceptance", "speedup", "lossless",
                    "| stage | state | result |"):
        assert heading in text
    for stage in STAGE_TABLE:
        assert f"| {stage.label} | Completed |" in text
    assert text.startswith(f"# {run_name_of(server, run)}")


def run_name_of(server: Server, run: dict) -> str:
    return server.api.get(f"/flow_runs/{run['id']}").json()["name"]


def test_the_ui_shows_the_training_and_benchmark_charts(server, first_run, tmp_path):
    """Headless Chromium opens each chart's artifact page in the Prefect UI: the image element
    is there and loaded (naturalWidth > 0), not just the artifact."""
    problem = browser.missing()
    assert problem is None, problem
    _, run = first_run
    runs = {run["id"], *(c["id"] for c in server.flow_runs(
        parent_flow_run_id={"any_": [run["id"]]}))}
    shots = Path(os.environ.get("DRAFTSMITH_SCREENSHOTS", tmp_path))
    chrome = browser.Browser()
    try:
        for key, alt in (("train-summary", "training loss and accuracy per step"),
                         ("benchmark", "benchmark tokens/s and acceptance per config")):
            artifact = latest(server, f"draftsmith-tiny-{key}",
                              flow_run_id={"any_": sorted(runs)})
            images = chrome.images(f"{server.ui}/artifacts/artifact/{artifact['id']}",
                                   f'img[alt="{alt}"]')
            chrome.screenshot(shots / f"{key}.png")
            assert images, f"{key}: no chart image on the artifact page"
            assert all(i["complete"] and i["width"] > 400 and i["height"] > 200
                       for i in images), images
    finally:
        chrome.close()


def test_a_second_run_is_all_cached(server, first_run):
    _, run_id = start_from_ui(server)
    run = server.wait_run(run_id)
    assert run["state_type"] == "COMPLETED", run["state"]
    states = stage_states(server, run)
    assert {s: states[s][0] for s in states} == {s: "Cached" for s in STAGES}
    # Finished GPU stages need no GPU: no child run, no GPU slot taken.
    assert server.flow_runs(parent_flow_run_id={"any_": [run["id"]]}) == []


@pytest.fixture(scope="module")
def new_data_run(server, first_run, config_file):
    """A draftsmith.dataset.updated event with new content for one source: two more records."""
    raw = yaml.safe_load(config_file.read_text())
    source = raw["data"]["sources"][1]
    update = config_file.parent / "openai-update.jsonl"
    lines = Path(source["path"]).read_text().splitlines()  # the records the run read
    lines += [json.dumps({"id": f"new-{i}", "messages": [{"role": "user", "content": (
        f"Complete this function from new{i}.py:\ndef grow{i}(values):")}]}) for i in range(2)]
    update.write_text("\n".join(lines) + "\n")
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
    return source, update, server.wait_run(new[0]["id"])


def test_a_new_data_event_starts_a_run_that_answers_only_the_new_prompts(server, new_data_run):
    source, update, run = new_data_run
    assert run["parameters"]["dataset"] == {"source": source["name"], "path": str(update)}
    assert run["state_type"] == "COMPLETED", run["state"]
    states = stage_states(server, run)
    assert {s: states[s][0] for s in states} == {s: "Completed" for s in STAGES}
    # Generation is keyed per source: the unchanged source asked nothing, the updated one
    # only for its two new prompts.
    child = states["generate"][1]
    table = latest(server, "draftsmith-tiny-generate-sources",
                   flow_run_id={"any_": [child["id"]]})["data"]
    rows = {r["source"]: r for r in (table if isinstance(table, list) else json.loads(table))}
    assert (rows["stdlib-sharegpt"]["answered now"],
            rows["stdlib-sharegpt"]["answers reused"]) == (0, 12)
    assert (rows["stdlib-openai"]["answered now"],
            rows["stdlib-openai"]["answers reused"]) == (2, 12)
    assert rows["stdlib-openai"]["kept"] == 14


def test_new_data_sticks_a_plain_run_later_finds_it_all_cached(server, new_data_run):
    source, update, event_run = new_data_run
    variable = server.api.get("/variables/name/draftsmith-tiny-data").json()
    assert variable["value"] == {source["name"]: str(update)}
    _, run_id = start_from_ui(server)  # the form's defaults: no dataset given
    run = server.wait_run(run_id)
    assert run["state_type"] == "COMPLETED", run["state"]
    states = stage_states(server, run)
    assert {s: states[s][0] for s in states} == {s: "Cached" for s in STAGES}
    assert run_name_of(server, run) == run_name_of(server, event_run)  # the same data version


def test_runs_arriving_together_queue_under_the_concurrency_limit(server, new_data_run):
    # Both runs wait before the worker sees either, whatever the machine's load: created while
    # the pool is paused, they reach the worker in one poll. (Created one after the other on a
    # busy machine, the first could finish before the worker took the second.)
    with server.pool_paused(server.deployment("draftsmith-pipeline/cpu")["work_pool_name"]):
        ids = [start_from_ui(server)[1] for _ in range(2)]
    runs = sorted((server.wait_run(i) for i in ids), key=lambda r: r["start_time"])
    assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state"] for r in runs]
    assert runs[1]["start_time"] >= runs[0]["end_time"]  # one at a time
    waited = [[s["name"] for s in server.api.get(
        "/flow_run_states/", params={"flow_run_id": r["id"]}).json()] for r in runs]
    assert any("AwaitingConcurrencySlot" in names for names in waited), waited


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


# --------------------------------------------------------------------------- placement


def generate_task(server: Server, pipeline_run: dict, timeout_s: float = 180) -> tuple[dict, dict]:
    """The generate task run of a pipeline run (started with stages=[generate]) once final,
    and the flow run it ran in: the pipeline's own, or a child on the gpu pool."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [pipeline_run, *server.flow_runs(
            parent_flow_run_id={"any_": [pipeline_run["id"]]})]
        for run in runs:
            for task_run in server.task_runs(run["id"]):
                state = task_run["state"]
                if task_run["name"].startswith("generate-") and state and \
                        state["type"] in FINAL:
                    return task_run, run
        assert time.monotonic() < deadline, f"no final generate task in {pipeline_run['id']}"
        time.sleep(0.5)


def run_logs(server: Server, flow_run_id: str) -> str:
    logs = server.api.post("/logs/filter", json={
        "logs": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    return "\n".join(entry["message"] for entry in logs)


@pytest.fixture(scope="module")
def user_endpoint(server, first_run):
    """An OpenAI-compatible server a user started on the GPU host: `transformers serve` of the
    tiny target on loopback. Returns its base URL and model name."""
    from draftsmith.serve.readiness import port_open
    from draftsmith.target import tiny_target_path

    port, model = free_port(), str(tiny_target_path())
    server.start("user-endpoint", [str(BIN / "transformers"), "serve", model, "--host",
                                   "127.0.0.1", "--port", str(port), "--device", "cpu"],
                 {"HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while not port_open("127.0.0.1", port):
        assert server.processes["user-endpoint"].poll() is None, server.log("user-endpoint")
        assert time.monotonic() < deadline, server.log("user-endpoint")[-3000:]
        time.sleep(0.5)
    return f"http://127.0.0.1:{port}/v1", model


def test_generate_runs_where_its_engine_is(server, first_run, user_endpoint):
    """Each backend, started from the UI with stages=[generate]: transformers (the first run)
    and vllm start an engine, so they run in a child run on the gpu pool; openai at a loopback
    URL talks to a server on the GPU host, so it does too. (An endpoint elsewhere, and
    generate.pool, leave it in the pipeline's run on the cpu pool, where merge and export run:
    tests/test_dispatch.py.)"""
    deployment = server.deployment("draftsmith-pipeline/cpu")
    url, model = user_endpoint
    # The user's server, not setup's endpoint block (which would replace it).
    openai = ["orchestration.endpoint_block=null", "generate.backend=openai",
              f"generate.endpoint.base_url={url}", f"generate.endpoint.model={model}"]
    vllm = ["generate.backend=vllm", f"generate.vllm.port={free_port()}",
            "generate.vllm.extra_args=[--enforce-eager]",
            "generate.vllm.env={VLLM_CPU_KVCACHE_SPACE: '1', VLLM_ENABLE_V1_MULTIPROCESSING: '0'}"]
    where = {"transformers": stage_states(server, first_run[1])["generate"][1]}
    logs = {}
    for name, overrides in {"vllm": vllm, "openai at 127.0.0.1": openai}.items():
        _, run_id = start_from_ui(server, stages=["generate"],
                                  overrides=[*deployment["parameters"]["overrides"], *overrides])
        run = server.wait_run(run_id)
        assert run["state_type"] == "COMPLETED", (name, run["state"])
        task_run, where[name] = generate_task(server, run)
        assert task_run["state"]["name"] == "Completed", name
        logs[name] = run_logs(server, where[name]["id"])
    gpu_log, cpu_log = server.log("worker-gpu"), server.log("worker-cpu")
    for name, run in where.items():  # a child run the gpu worker ran, the cpu worker did not
        assert run["work_pool_name"] == "gpu" and run["parent_task_run_id"], name
        assert f"submitting flow run '{run['id']}'" in gpu_log and run["id"] not in cpu_log, name
    assert "generate: starting vLLM for the target at" in logs["vllm"]  # on the GPU host
    assert f"requests to {url}" in logs["openai at 127.0.0.1"]


# --------------------------------------------------------------------------- the watcher


def test_the_data_watcher_starts_a_run_when_a_data_file_changes(server, new_data_run,
                                                                config_file):
    """The watcher deployment (setup --watch-data), run as its schedule runs it: its first
    look records the files; a later look that finds new content in a source's file emits the
    new-data event, and the pipeline's trigger starts a run with that file. The new content
    here is what every earlier run trained on (the file was changed before the first look and
    put back), so that run finds every stage cached."""
    watcher = server.deployment("draftsmith-watch-data/cpu")
    pipeline_id = server.deployment("draftsmith-pipeline/cpu")["id"]
    source = yaml.safe_load(config_file.read_text())["data"]["sources"][0]
    path = Path(source["path"])
    trained = path.read_bytes()

    def look() -> dict:
        response = server.api.post(f"/deployments/{watcher['id']}/create_flow_run", json={})
        response.raise_for_status()
        run = server.wait_run(response.json()["id"])
        assert run["state_type"] == "COMPLETED", run["state"]
        return run

    before = {r["id"] for r in server.flow_runs(deployment_id={"any_": [pipeline_id]})}
    try:
        path.write_bytes(trained + b'{"id": "w1", "conversations": [{"from": "human", '
                                   b'"value": "Complete this function: def w1():"}]}\n')
        look()  # the first look: recorded, no event
        path.write_bytes(trained)
        changed = look()
    finally:
        path.write_bytes(trained)
    deadline, new = time.monotonic() + 90, []
    while not new and time.monotonic() < deadline:
        new = [r for r in server.flow_runs(deployment_id={"any_": [pipeline_id]})
               if r["id"] not in before]
        time.sleep(1)
    assert new, "no pipeline run started by the watcher's event:\n" + run_logs(
        server, changed["id"])
    run = server.wait_run(new[0]["id"])
    assert run["parameters"]["dataset"] == {"source": source["name"], "path": str(path)}
    assert run["state_type"] == "COMPLETED", run["state"]
    states = stage_states(server, run)
    assert {s: states[s][0] for s in states} == {s: "Cached" for s in STAGES}
    assert len([r for r in server.flow_runs(deployment_id={"any_": [pipeline_id]})
                if r["id"] not in before]) == 1  # the first look started nothing
    assert f"data source {source['name']}: {path} changed" in run_logs(server, changed["id"])
    seen = server.api.get("/variables/name/draftsmith-tiny-watched").json()["value"]
    assert seen[source["name"]]["path"] == str(path)


# --------------------------------------------------------------------------- faults (issue 47)
# The world around a run: its Prefect server restarts while a GPU stage works, and the process
# a GPU worker started for a stage is killed -9 (as the OOM killer does) in the middle of it.

# Longer than Prefect's client rides out by itself (five retries 2 to 32 s apart: 62-75 s), so
# that draftsmith's own patience is what carries the run through.
OUTAGE_S = 90


def ui_overrides(server: Server, *extra: str) -> list[str]:
    """The form's overrides (distributed mode, as setup made them) and more."""
    return [*server.deployment("draftsmith-pipeline/cpu")["parameters"]["overrides"], *extra]


def restart_server(server: Server, down_s: float, while_down=None) -> None:
    """Stop the Prefect server (SIGTERM, as a restart does), keep it away down_s seconds, and
    start it again on the same port and database; while_down() runs once it is gone."""
    process = server.processes["server"]
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)
    gone = time.monotonic()
    if while_down is not None:
        while_down()
    time.sleep(max(0.0, down_s - (time.monotonic() - gone)))
    server.start("server-restarted", [str(BIN / "prefect"), "server", "start", "--host",
                                      "127.0.0.1", "--port", str(server.port)])
    server.processes["server"] = server.processes.pop("server-restarted")
    server.wait_healthy()


def run_log(config_file: Path) -> str:
    """draftsmith.log of the run root: what every flow run's engine logged, the pipeline's
    and the GPU stages' (written there even while the Prefect API is away)."""
    return (Path(yaml.safe_load(config_file.read_text())["run_root"]) / "draftsmith.log"
            ).read_text()


def test_a_gpu_stage_rides_out_the_prefect_server_restarting(server, first_run, config_file,
                                                            tmp_path):
    """Deploy (a served engine, on the gpu pool, with the benchmark in the same child run)
    waits for its server while the Prefect server is away for longer than its clients retry;
    the engine becomes ready and is benchmarked while it is still away. The run ends
    Completed, every stage's state is recorded once the server is back, and nothing before
    deploy runs again."""
    # The server keeps its leases on disk (setup would warn otherwise), so the restart below
    # gives the GPU slot back when the stage ends.
    settings = server.api.get("/admin/settings").json()
    assert settings["server"]["concurrency"]["lease_storage"] == LEASES_ON_DISK
    assert lease_storage_warning(settings) is None
    gate, started = tmp_path / "gate", tmp_path / "launched"
    launcher = tmp_path / "gated_sglang.py"
    fake = str(REPO / "tests" / "fake_sglang_server.py")
    launcher.write_text(  # the stand-in SGLang server, once the test opens the gate
        "import os, sys, time\n"
        f"open({str(started)!r}, 'w').close()\n"
        f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.2)\n"
        f"os.execv(sys.executable, [sys.executable, {fake!r}, *sys.argv[1:]])\n")
    _, run_id = start_from_ui(server, overrides=ui_overrides(
        server, "deploy.engine=sglang", f"deploy.sglang_command=[{sys.executable}, {launcher}]",
        f"deploy.port={free_port()}", "deploy.startup_timeout_s=900",
        "benchmark.baseline=false"))
    deadline = time.monotonic() + 600
    while not started.exists():  # deploy is waiting for its engine, on the gpu worker
        assert time.monotonic() < deadline, server.log("worker-gpu")[-3000:]
        assert server.api.get(f"/flow_runs/{run_id}").json()["state_type"] not in TERMINAL
        time.sleep(0.5)
    restart_server(server, OUTAGE_S, while_down=lambda: (time.sleep(5), gate.touch()))
    run = server.wait_run(run_id)
    assert run["state_type"] == "COMPLETED", (run["state"], server.log("worker-gpu")[-6000:])
    states = stage_states(server, run)
    assert {s: states[s][0] for s in states} == {
        "generate": "Cached", "merge": "Cached", "extract": "Cached", "train": "Cached",
        "export": "Cached", "deploy": "Completed", "benchmark": "Completed"}
    child = states["deploy"][1]
    assert child["state_type"] == "COMPLETED" and child["work_pool_name"] == "gpu"
    log = run_log(config_file)
    # The pipeline waited for its child run through the outage, and said so.
    assert "the Prefect API is unreachable" in log and "the Prefect API is back" in log


# Trains on the data the pipeline reads: the config's files with the new-data updates recorded
# in the Prefect variable (argv[4], {source: file}) applied, as flows/data_updates.py does.
UNINTERRUPTED = """
import json, sys
from draftsmith.artifacts import plan_stage
from draftsmith.config import load_config, with_source
from draftsmith.plan import finished_outputs
from draftsmith.target import resolve_target
from draftsmith.train.trainer import run_train

config = load_config(sys.argv[1], json.loads(sys.argv[3]))
for source, path in json.loads(sys.argv[4]).items():
    config = with_source(config, source, path)
outputs = finished_outputs(config, resolve_target(config.target), "extract")
done = run_train(config.train, outputs["extract"], outputs["merge"], outputs["target"],
                 plan_stage(sys.argv[2], "train", {}, [outputs["extract"]]),
                 drafter_settings=config.drafter)
print(outputs["extract"].fingerprint)
print(done.path)
"""


def flow_run_process(flow_run_id: str) -> int | None:
    """The pid of the process a worker started for this flow run (its environment names it)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ:
            return int(proc.name)
    return None


def test_a_gpu_stage_killed_mid_stage_is_crashed_and_the_rerun_resumes_it(
        server, first_run, config_file, tmp_path):
    """The process running train on the gpu worker is killed -9 after its first checkpoint (as
    the OOM killer would). Prefect marks the child run Crashed and the pipeline Failed, with
    no Completed state for the unfinished stage; a rerun from the UI gives back the GPU slot
    the killed process held, resumes training from the checkpoint and ends with the weights of
    a training that was never interrupted. (Both runs select train alone: the stages before it
    are read from disk.)"""
    from safetensors.torch import load_file

    settings = ["train.epochs=6", "train.batch_tokens=256", "train.checkpoint_every=1"]
    overrides = ui_overrides(server, *settings)
    run_root = Path(yaml.safe_load(config_file.read_text())["run_root"])
    before = set((run_root / "train").iterdir())
    _, run_id = start_from_ui(server, overrides=overrides, stages=["train"])
    deadline, victim, child = time.monotonic() + 600, None, None
    while victim is None:
        assert time.monotonic() < deadline, server.log("worker-gpu")[-3000:]
        children = [c for c in server.flow_runs(parent_flow_run_id={"any_": [run_id]})
                    if c["name"].startswith("train for")]
        fresh = [d for d in (run_root / "train").iterdir() if d not in before]
        if children and fresh and (fresh[0] / "resume" / "state.pt").is_file():
            child = children[0]
            victim = flow_run_process(child["id"])
        time.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    failed = server.wait_run(run_id)
    assert failed["state_type"] == "FAILED", failed["state"]
    child = server.api.get(f"/flow_runs/{child['id']}").json()
    assert child["state_type"] == "CRASHED", child["state"]
    assert child["name"] in failed["state"]["message"]
    train_dir = fresh[0]
    assert not (train_dir / "manifest.json").exists()
    assert (train_dir / "resume" / "state.pt").is_file()
    # No Completed state for the unfinished training, in the child run or anywhere.
    assert all(t["state"] is None or t["state"]["type"] != "COMPLETED"
               for t in server.task_runs(child["id"]) if t["name"].startswith("train-"))

    _, rerun_id = start_from_ui(server, overrides=overrides, stages=["train"])
    rerun = server.wait_run(rerun_id)
    assert rerun["state_type"] == "COMPLETED", rerun["state"]
    (again,) = server.flow_runs(parent_flow_run_id={"any_": [rerun_id]})
    assert again["name"].startswith("train for") and again["state_type"] == "COMPLETED"
    assert "released 1 GPU slot(s) of gpus-gpu-host held by flow run " \
        f"{child['id']}, which ended Crashed" in run_log(config_file)
    assert re.search(rf"train: resuming from {re.escape(str(train_dir))}/resume/state.pt at "
                     r"step [1-9]", run_log(config_file))

    # The same training, never interrupted, in a fresh process as a worker's (this test
    # process has run other tests: its torch state is not a worker's).
    updates = server.api.get("/variables/name/draftsmith-tiny-data").json().get("value") or {}
    straight = subprocess.run([sys.executable, "-c", UNINTERRUPTED, str(config_file),
                               str(tmp_path), json.dumps(overrides), json.dumps(updates)],
                              env=server.env, capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    extract_fingerprint, uninterrupted_dir = straight.stdout.strip().splitlines()[-2:]
    manifest = json.loads((train_dir / "manifest.json").read_text())
    assert manifest["key_material"]["inputs"]["extract"] == extract_fingerprint  # the same data
    resumed, uninterrupted = (load_file(str(d / "drafter.safetensors")) for d in (
        train_dir, Path(uninterrupted_dir)))
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        assert resumed[name].equal(uninterrupted[name]), name

