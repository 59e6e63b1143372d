"""`draftsmith prefect setup`: everything distributed mode needs, against the configured Prefect
API (PREFECT_API_URL). Idempotent: running it again updates what exists.

- work pools `cpu` and `gpu` (process workers);
- blocks: the GPU host (GPU count, NCCL environment, paths), the inference endpoint and its API
  key as a Secret block when asked;
- a global concurrency limit per GPU host, one slot per GPU;
- the pipeline deployment on `cpu`: its form names the config file (and the overrides that
  select distributed mode), one run at a time (later runs queue), an optional cron schedule,
  and a trigger that re-runs it on `draftsmith.dataset.updated`;
- the compare deployment on `cpu` (`draftsmith-compare/cpu`): the pipeline's form plus a list
  of variants, one comparison table (flows/compare.py);
- optionally the data watcher on `cpu`, which emits that event when a data file changes;
- one deployment per GPU stage flow on `gpu`, whose job variables pin CUDA_VISIBLE_DEVICES and
  the NCCL environment;
- an automation that marks a flow run Crashed when its heartbeats stop (zombie detection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.config import PipelineConfig
from flows.data_updates import DATASET_EVENT, dataset_event

log = logging.getLogger("draftsmith.setup")

PIPELINE_DEPLOYMENT = "cpu"
# Engine and child-process logs ("draftsmith.*") in every flow run's Prefect log; Prefect reads
# it when it starts, before any draftsmith module could set it.
LOG_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "draftsmith"}


@dataclass
class SetupOptions:
    cpu_pool: str = "cpu"
    gpu_pool: str = "gpu"
    gpu_host: str = "gpu-host"
    # Several GPU hosts: one block, work queue, GPU limit and set of GPU deployments each
    # (draftsmith-<stage>/<host>); the first one first. Empty: the one host gpu_host.
    hosts: list[str] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)  # host -> how the others reach it
    gpu_count: int = 1
    visible_devices: str | None = None
    nccl_env: dict[str, str] = field(default_factory=dict)
    scratch_path: str = "/tmp"
    shared_path: str | None = None
    cron: str | None = None
    cron_active: bool = False
    timezone: str = "UTC"
    endpoint_block: str | None = None
    endpoint_url: str | None = None
    endpoint_model: str | None = None
    api_key_env: str | None = None
    # Flow runs send a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (180 by
    # default); a run silent this long is marked Crashed. None: no automation.
    zombie_after_s: int | None = 600
    # The trigger that re-runs the pipeline on `draftsmith.dataset.updated` (an automation).
    rerun_on_new_data: bool = True
    # The data watcher (flows/watch_data.py): a deployment on the cpu pool that looks at the
    # data files this often and emits that event for each that changed. None: no watcher.
    watch_every_s: int | None = None


def _ensure_pool(client, name: str, description: str) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        pool = client.read_work_pool(name)
        if pool.type != "process":
            raise ValueError(f"work pool {name!r} exists with type {pool.type!r}; draftsmith "
                             "needs a process pool there: delete it or choose another name")
        return
    except ObjectNotFound:
        pass
    client.create_work_pool(WorkPoolCreate(
        name=name, type="process", description=description,
        base_job_template=ProcessWorker.get_default_base_job_template()))
    log.info("work pool %s created (process)", name)


def _ensure_limit(client, name: str, slots: int) -> None:
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
    )
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
        client.update_global_concurrency_limit(
            name, GlobalConcurrencyLimitUpdate(limit=slots, active=True))
    except ObjectNotFound:
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=name, limit=slots, active=True))
    log.info("global concurrency limit %s: %d slot(s)", name, slots)


# Prefect servers before 3.8.6 on SQLite can hang for good while an automation is created: the
# commit blocks the event loop on a lock that a coroutine of that same loop holds
# (PrefectHQ/prefect#23055). setup creates one or two.
AUTOMATION_DEADLOCK_FIXED = "3.8.6"


def automation_deadlock_warning(server_version: str, automations: int) -> str | None:
    """The warning for a server version that can hang on creating automations, or None."""
    from packaging.version import InvalidVersion, Version

    try:
        old = Version(server_version) < Version(AUTOMATION_DEADLOCK_FIXED)
    except InvalidVersion:
        return None
    if not old or not automations:
        return None
    return (f"the Prefect server runs {server_version}: on SQLite, servers before "
            f"{AUTOMATION_DEADLOCK_FIXED} can hang while setup creates its {automations} "
            "automation(s) (PrefectHQ/prefect#23055). Run the server from an environment with "
            f"prefect>={AUTOMATION_DEADLOCK_FIXED} or on PostgreSQL; or pass "
            "--no-rerun-on-new-data and --zombie-after-s 0 to create none")


LEASES_ON_DISK = "prefect.server.concurrency.lease_storage.filesystem"


def lease_storage_warning(server_settings: dict) -> str | None:
    """The warning for a server that keeps concurrency leases in memory, or None. Its restart
    forgets the leases of the slots that running runs hold (a GPU stage's, a pipeline run's):
    they are never given back, and every later run waits for them."""
    storage = server_settings.get("server", {}).get("concurrency", {}).get("lease_storage")
    if not storage or not storage.endswith(".memory"):
        return None
    return ("the Prefect server keeps concurrency leases in memory: if it restarts while a "
            "GPU stage runs, that stage's GPU slots stay taken for good and later GPU stages "
            "wait for ever. Start it with PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE="
            f"{LEASES_ON_DISK} (or a Redis lease storage) (docs/faults.md)")


def server_settings(client) -> dict:
    """The server's own settings (its /admin/settings), {} when it does not show them."""
    try:
        response = client.request("GET", "/admin/settings")
        response.raise_for_status()
        return response.json()
    except Exception:  # noqa: BLE001 - an older or locked-down server: no warning then
        return {}


def ensure_zombie_detection(after_s: int) -> None:
    """An automation that marks a flow run Crashed when its heartbeats stop (its worker or
    machine died), so the run, and the parent waiting on it, end in a state the user sees.
    Prefect Cloud does this itself; a self-hosted server needs the automation."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    name = "draftsmith: crash flow runs whose heartbeats stopped"
    with contextlib.suppress(ValueError):  # not there yet
        Automation.read(name=name).delete()
    Automation(
        name=name,
        description="A flow run that sent no heartbeat and did not finish within "
                    f"{after_s}s is marked Crashed (its worker or machine died).",
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                    "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                    "prefect.flow-run.Crashed"},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive, threshold=1, within=timedelta(seconds=after_s)),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED, name="Crashed",
            message=f"no heartbeat for {after_s}s: the worker running it (or its machine) died")],
    ).create()
    log.info("automation: %s (%ds)", name, after_s)


def save_blocks(options: SetupOptions, run_root: str) -> None:
    from prefect.blocks.system import Secret

    from blocks.endpoint import InferenceEndpoint
    from blocks.gpu_host import GpuHost

    GpuHost.register_type_and_schema()
    InferenceEndpoint.register_type_and_schema()
    for name in options.hosts or [options.gpu_host]:
        GpuHost(gpu_count=options.gpu_count, visible_devices=options.visible_devices,
                nccl_env=options.nccl_env, scratch_path=options.scratch_path,
                shared_path=options.shared_path or str(Path(run_root).parent),
                address=options.addresses.get(name)).save(name, overwrite=True)
    if options.endpoint_url:
        secret_name = None
        if options.api_key_env:
            value = os.environ.get(options.api_key_env)
            if not value:
                raise ValueError(f"--api-key-env {options.api_key_env}: that environment "
                                 "variable is empty; export the API key in it first")
            secret_name = f"{options.endpoint_block}-api-key"
            Secret(value=value).save(secret_name, overwrite=True)
        InferenceEndpoint(base_url=options.endpoint_url,
                          model=options.endpoint_model or "default",
                          api_key_secret=secret_name).save(options.endpoint_block,
                                                           overwrite=True)


def pipeline_parameters(config_path: Path, overrides: list[str],
                        options: SetupOptions) -> dict:
    """The pipeline deployment's default parameters (the UI form's defaults): the config file,
    and the overrides that select distributed mode on this GPU host before the user's own."""
    orchestration = ["orchestration.mode=distributed",
                     f"orchestration.gpu_host={(options.hosts or [options.gpu_host])[0]}"]
    if options.hosts:
        orchestration.append(f"orchestration.gpu_hosts=[{','.join(options.hosts)}]")
    if options.endpoint_url:
        orchestration.append(f"orchestration.endpoint_block={options.endpoint_block}")
    return {"config": str(Path(config_path).resolve()), "overrides": orchestration + overrides}


def setup(config: PipelineConfig, options: SetupOptions | None = None,
          config_path: Path | None = None, overrides: list[str] | None = None
          ) -> dict[str, str]:
    """Create or update pools, blocks, limit and deployments; returns deployment name -> id.
    `config_path` (with `overrides`) is the file the deployment's runs read; without it the
    whole config goes into the form's full_config field."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import EntrypointType
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
    from prefect.schedules import Cron

    from blocks.gpu_host import GpuHost, concurrency_limit_name
    from flows.compare import compare
    from flows.gpu_stages import STAGE_FLOWS
    from flows.pipeline import pipeline

    options = options or SetupOptions()
    if options.watch_every_s and not options.rerun_on_new_data:
        raise ValueError("--watch-data starts runs through the new-data trigger, and "
                         "--no-rerun-on-new-data leaves it out: drop one of the two")
    if options.endpoint_url and not options.endpoint_block:
        options.endpoint_block = "inference-endpoint"
    config = config.model_copy(deep=True)
    config.orchestration.mode = "distributed"
    config.orchestration.gpu_host = (options.hosts or [options.gpu_host])[0]
    config.orchestration.gpu_hosts = list(options.hosts)
    if options.endpoint_url:
        config.orchestration.endpoint_block = options.endpoint_block

    with get_client(sync_client=True) as client:
        warnings = (automation_deadlock_warning(
            client.api_version(), bool(options.zombie_after_s) + options.rerun_on_new_data),
            lease_storage_warning(server_settings(client)))
        for warning in warnings:
            if warning:
                log.warning(warning)
        _ensure_pool(client, options.cpu_pool, "draftsmith: the pipeline flow and CPU stages")
        _ensure_pool(client, options.gpu_pool, "draftsmith: GPU stages, on the GPU host")
        save_blocks(options, config.run_root)
        host_blocks = {name: GpuHost.load(name) for name in options.hosts or [options.gpu_host]}
        for name, host in host_blocks.items():
            _ensure_limit(client, concurrency_limit_name(name), host.gpu_count)
    if options.zombie_after_s:
        ensure_zombie_detection(options.zombie_after_s)

    ids: dict[str, str] = {}
    schedules = []
    if options.cron:
        schedules.append(Cron(options.cron, timezone=options.timezone,
                              active=options.cron_active))
    triggers = [DeploymentEventTrigger(
        name="draftsmith: new data re-runs the pipeline",
        expect={DATASET_EVENT},
        match={"prefect.resource.id": "draftsmith.dataset.*"},
        parameters={"dataset": {"source": "{{ event.payload.source }}",
                                "path": "{{ event.payload.path }}"}},
    )] if options.rerun_on_new_data else []
    if config_path is not None:
        parameters = pipeline_parameters(config_path, list(overrides or []), options)
    else:
        parameters = {"full_config": config.model_dump(mode="json")}
    deployment = pipeline.to_deployment(
        PIPELINE_DEPLOYMENT, work_pool_name=options.cpu_pool, parameters=parameters,
        # One run at a time: a run that arrives while another runs waits for it (new-data
        # events close together, a schedule and a UI run), so no two runs share a stage.
        concurrency_limit=1,
        job_variables={"env": dict(LOG_ENV)},
        schedules=schedules, triggers=triggers, entrypoint_type=EntrypointType.MODULE_PATH,
        description="draftsmith: generate -> merge -> extract -> train -> export -> deploy "
                    "-> benchmark; GPU stages run on the gpu pool",
        tags=["draftsmith"])
    ids[f"{pipeline.name}/{PIPELINE_DEPLOYMENT}"] = str(deployment.apply())
    # Comparing configs from the UI: the same config file (or whole config) and overrides as
    # the pipeline's form, and a list of variants to fill in.
    comparison = compare.to_deployment(
        PIPELINE_DEPLOYMENT, work_pool_name=options.cpu_pool, parameters=parameters,
        job_variables={"env": dict(LOG_ENV)}, entrypoint_type=EntrypointType.MODULE_PATH,
        description="draftsmith: several variants of the pipeline config, run one after the "
                    "other on one run root, and one comparison table artifact",
        tags=["draftsmith"])
    ids[f"{compare.name}/{PIPELINE_DEPLOYMENT}"] = str(comparison.apply())
    if options.watch_every_s:
        ids.update(deploy_watcher(parameters, options))
    for flow_ in STAGE_FLOWS.values():
        if not options.hosts:  # one GPU host: the pool's default queue
            host = host_blocks[options.gpu_host]
            stage_deployment = flow_.to_deployment(
                config.orchestration.gpu_deployment, work_pool_name=options.gpu_pool,
                job_variables={"env": {**LOG_ENV, **host.job_env()}},
                entrypoint_type=EntrypointType.MODULE_PATH, tags=["draftsmith", "gpu"])
            ids[f"{flow_.name}/{config.orchestration.gpu_deployment}"] = str(
                stage_deployment.apply())
            continue
        # Several: each host's deployment goes to its own work queue, which only that host's
        # worker polls (prefect worker start --pool gpu --work-queue HOST).
        for name, host in host_blocks.items():
            stage_deployment = flow_.to_deployment(
                name, work_pool_name=options.gpu_pool, work_queue_name=name,
                parameters={"host": name},
                job_variables={"env": {**LOG_ENV, **host.job_env()}},
                entrypoint_type=EntrypointType.MODULE_PATH, tags=["draftsmith", "gpu", name])
            ids[f"{flow_.name}/{name}"] = str(stage_deployment.apply())
    for name in ids:
        log.info("deployment %s", name)
    return ids


def deploy_watcher(parameters: dict, options: SetupOptions) -> dict[str, str]:
    """The data watcher's deployment on the cpu pool: the pipeline deployment's parameters
    (its config and overrides, or its full config), an active interval schedule, one run at a
    time."""
    from datetime import timedelta

    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Interval

    from flows.watch_data import watch_data

    watcher = watch_data.to_deployment(
        PIPELINE_DEPLOYMENT, work_pool_name=options.cpu_pool, parameters=parameters,
        concurrency_limit=1, job_variables={"env": dict(LOG_ENV)},
        schedules=[Interval(timedelta(seconds=options.watch_every_s), active=True)],
        entrypoint_type=EntrypointType.MODULE_PATH,
        description=f"draftsmith: every {options.watch_every_s} s, a pipeline run for each "
                    "data file whose content changed (draftsmith.dataset.updated)",
        tags=["draftsmith"])
    return {f"{watch_data.name}/{PIPELINE_DEPLOYMENT}": str(watcher.apply())}


def notify_new_data(path: str | Path, source: str | None = None) -> str:
    """Emit the new-data event and wait until the server has it; returns the event id."""
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    event = Event(**dataset_event(path, source))

    async def send() -> None:
        async with get_events_client() as client:
            await client.emit(event)

    asyncio.run(send())
    return str(event.id)
