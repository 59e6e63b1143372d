"""Where a stage runs. Local mode: in the pipeline's process. Distributed mode: GPU stages run as
child flow runs of their deployments on the gpu work pool (run_deployment); the parent waits,
checks the child's final state, passes the input descriptors and reads the outputs' descriptors
from their manifests on the shared run_root. Both modes call the same task with the same cache
key (flows/pipeline.py: run_stage_task), so caching is identical."""

from __future__ import annotations

from draftsmith import hosts as hosts_engine
from draftsmith import stages
from draftsmith.config import ConfigError, PipelineConfig, parse_config
from draftsmith.hosts import HostPart
from draftsmith.plan import Step
from draftsmith.stages import Stage
from tasks.api_outage import api_call


class StageDispatchError(RuntimeError):
    pass


# How long the other nodes of a failed training job may take to stop once cancelled.
CANCEL_GRACE_S = 300.0


def is_remote(config: PipelineConfig, stage: Stage | str) -> bool:
    """A GPU stage in distributed mode (the table says which stages use GPUs, and when)."""
    stage = stages.get(stage) if isinstance(stage, str) else stage
    return config.orchestration.mode == "distributed" and stage.gpu(config)


def flow_name(stage: Stage | str) -> str:
    stage = stages.get(stage) if isinstance(stage, str) else stage
    return f"draftsmith-{stage.label}"


def deployment_name(config: PipelineConfig, stage: Stage | str, host: str | None = None) -> str:
    """The stage flow's deployment on a GPU host: with several hosts (orchestration.gpu_hosts)
    each has its own, named after its block, on that host's work queue; one host has
    `gpu_deployment`. host: which one (default the first)."""
    if config.orchestration.gpu_hosts:
        return f"{flow_name(stage)}/{host or config.orchestration.gpu_hosts[0]}"
    return f"{flow_name(stage)}/{config.orchestration.gpu_deployment}"


def run_remote(config: PipelineConfig, step: Step, parent: str | None = None) -> dict[str, str]:
    """Run the step's group of stages as one child flow run on the gpu pool, named
    `<stage> for <parent run>`; returns each stage task's final state name (Completed,
    Cached). Raises naming the child run unless it completed."""
    from prefect.deployments import run_deployment

    group = [stages.get(name) for name in step.group]
    reads = {name for s in group for name in s.stage_inputs()} - set(step.group)
    parameters = {"config": config.model_dump(mode="json"),
                  "inputs": {name: step.inputs[name].model_dump(mode="json")
                             for name in sorted(reads) if name in step.inputs},
                  "plan": step.plan.model_dump(mode="json")}
    if len(group) > 1:
        parameters["with_next"] = True
    if config.orchestration.gpu_hosts:
        parameters["host"] = config.orchestration.gpu_hosts[0]
    name = deployment_name(config, step.stage)
    labels = "+".join(s.label for s in group)
    outage_s = config.orchestration.api_outage_s
    # Started again after an API outage, the same key finds the run the first try made.
    flow_run = api_call(lambda: run_deployment(
        name, parameters=parameters, flow_run_name=f"{labels} for {parent}" if parent else None,
        timeout=0, idempotency_key=_idempotency_key(f"{labels}-{step.plan.key}")),
        f"{step.name}: starting its child run of {name}", outage_s)
    state = wait_final(config, flow_run, f"{step.name}: child run {flow_run.name}")
    if state is None or not state.is_final():
        raise StageDispatchError(
            f"{step.name}: child run {flow_run.name} ({flow_run.id}) of {name} is still "
            f"{state.name if state else 'unknown'} after orchestration.stage_timeout_s="
            f"{config.orchestration.stage_timeout_s}; is a worker polling the gpu pool? (a worker "
            "that died leaves it Running until zombie detection marks it Crashed)")
    if not state.is_completed():
        raise StageDispatchError(
            f"{step.name}: child run {flow_run.name} ({flow_run.id}) of {name} ended "
            f"{state.name}: {state.message}; its logs are in the Prefect UI")
    return task_states(config, flow_run, group, f"{step.name}: reading child run "
                       f"{flow_run.name}")


# How long a child run's task states may take to reach the server after the run's own final
# state: they travel as events, sent again after an API outage once the client reconnects.
TASK_STATES_WAIT_S = 120.0


def task_states(config: PipelineConfig, flow_run, group: list[Stage], what: str
                ) -> dict[str, str]:
    """Each stage task's final state name in a completed child run."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    def read_task_runs() -> list:
        with get_client(sync_client=True) as client:
            return client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))

    deadline = time.monotonic() + TASK_STATES_WAIT_S
    while True:
        task_runs = api_call(read_task_runs, what, config.orchestration.api_outage_s)
        states: dict[str, str] = {}
        for run in sorted(task_runs, key=lambda r: r.created or 0):
            for stage in group:
                if run.name.startswith(f"{stage.label}-") and run.state \
                        and run.state.is_final():
                    states[stage.name] = run.state.name
        missing = [s.name for s in group if s.name not in states]
        if not missing:
            return states
        if time.monotonic() > deadline:
            raise StageDispatchError(
                f"child run {flow_run.name} ({flow_run.id}) completed without a final state "
                f"for the task of {missing} after {TASK_STATES_WAIT_S:.0f} s")
        time.sleep(config.orchestration.poll_interval_s)
    return states


def _idempotency_key(what: str) -> str | None:
    from prefect.runtime import flow_run

    return f"{flow_run.get_id()}-{what}" if flow_run.get_id() else None


def read_state(config: PipelineConfig, flow_run_id, what: str):
    """A child run's state, read through an API outage (up to orchestration.api_outage_s)."""
    from prefect.client.orchestration import get_client

    def read():
        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id).state

    return api_call(read, what, config.orchestration.api_outage_s)


def wait_final(config: PipelineConfig, flow_run, what: str):
    """Poll a child run until its state is final, or orchestration.stage_timeout_s has passed
    (then its last state). While the Prefect API is away the child's work goes on on its
    worker; this waits for the API to come back and reads the state then."""
    import time

    timeout = config.orchestration.stage_timeout_s
    deadline = time.monotonic() + timeout if timeout else None
    while True:
        state = read_state(config, flow_run.id, what)
        if (state is not None and state.is_final()) or (
                deadline is not None and time.monotonic() > deadline):
            return state
        time.sleep(config.orchestration.poll_interval_s)


def is_spread(config: PipelineConfig, stage: Stage) -> bool:
    """A GPU stage in distributed mode that takes more than one GPU host."""
    return is_remote(config, stage) and stage.parts(config) > 1


def run_parts(config: PipelineConfig, step: Step, parent: str | None = None) -> str:
    """Run a stage spread over several GPU hosts: prepare its directory, write the proof
    every host must read back, start one child flow run per host (each on that host's
    deployment, so its worker), and wait for them all. Training's nodes are one job: when one
    fails, the others are cancelled. Ranges are not: the others finish, and a range that
    finished is not started again by a later run. Returns the run id the join reads."""
    from prefect import get_run_logger
    from prefect.deployments import run_deployment

    stage, spread = step.stage, step.stage.spread
    assert spread is not None
    count, hosts = spread.parts(config), config.orchestration.hosts()
    if count > len(hosts):
        raise ConfigError(
            f"{stage.name}: train.nnodes={count} but orchestration.gpu_hosts names "
            f"{len(hosts)} GPU host block(s) ({', '.join(hosts)}): name one block per host "
            f"(draftsmith prefect setup --host NAME for each) or lower train.nnodes")
    logger = get_run_logger()
    addresses = {}
    if spread.coupled:  # training's nodes tell each other where they are
        from blocks.gpu_host import GpuHost

        addresses = {host: GpuHost.load(host).address for host in hosts[:count]}
    spread.prepare(config, step.inputs, step.plan)
    run_id = hosts_engine.write_proof(step.plan)
    parts = [HostPart(index=k, count=count, host=hosts[k], run_id=run_id, kind=spread.kind,
                      address=addresses.get(hosts[k])) for k in range(count)]
    todo = hosts_engine.parts_to_run(step.plan, parts, spread.coupled)
    for part in parts:
        if part not in todo:
            logger.info("%s %s: finished earlier, not run again", stage.name, part.where())
    inputs = {name: step.inputs[name].model_dump(mode="json") for name in stage.stage_inputs()}
    runs = {}
    for part in todo:
        name = deployment_name(config, stage, part.host)
        runs[part.index] = api_call(lambda part=part, name=name: run_deployment(
            name, timeout=0, parameters={
                "config": config.model_dump(mode="json"), "inputs": inputs,
                "plan": step.plan.model_dump(mode="json"), "host": part.host,
                "part": part.model_dump(mode="json")},
            flow_run_name=f"{stage.label} {part.label} for {parent}" if parent else None,
            idempotency_key=_idempotency_key(f"{stage.label}-{part.label}-{step.plan.key}")),
            f"{stage.name} {part.where()}: starting its child run",
            config.orchestration.api_outage_s)
        logger.info("%s %s: child run %s of %s", stage.name, part.where(),
                    runs[part.index].name, name)
    failed, cancelled = wait_parts(config, stage, {p.index: p for p in todo}, runs)
    if failed:
        text = "; ".join(f"{part.where()} failed: {why}" for part, why in failed)
        if cancelled:
            text += ("; then the other nodes were cancelled (" +
                     ", ".join(p.where() for p in cancelled) + "): the job stops with its "
                     "first lost node; run the pipeline again and it resumes from the last "
                     "checkpoint")
        elif not spread.coupled:
            text += ("; the ranges that finished are kept and not run again: run the "
                     "pipeline again to redo only " + ", ".join(p.label for p, _ in failed))
        raise StageDispatchError(f"{stage.name}: {text}")
    return run_id


def wait_parts(config: PipelineConfig, stage: Stage, parts: dict[int, HostPart], runs: dict
               ) -> tuple[list[tuple[HostPart, str]], list[HostPart]]:
    """Wait until every part's run is final. Returns the failed parts with why, first
    failure first, and the parts cancelled because of it: coupled parts (one training job)
    are cancelled at the first failure, since they would wait in the rendezvous for the node
    that failed."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    deadline = (time.monotonic() + config.orchestration.stage_timeout_s
                if config.orchestration.stage_timeout_s else None)
    failed: list[tuple[HostPart, str]] = []
    cancelled: list[HostPart] = []
    cancelled_at: float | None = None
    pending = dict(runs)
    with get_client(sync_client=True) as client:
        while pending:
            for index, run in list(pending.items()):
                state = read_state(config, run.id, f"{stage.name}: child run {run.name}")
                if state is None or not state.is_final():
                    continue
                del pending[index]
                if state.is_completed() or parts[index] in cancelled:
                    continue
                failed.append((parts[index], f"child run {run.name} ({run.id}) ended "
                               f"{state.name}: {state.message}"))
                if stage.spread is not None and stage.spread.coupled and cancelled_at is None:
                    cancelled_at = time.monotonic()
                    why = Cancelling(message=f"{stage.name}: {parts[index].where()} failed")
                    for other, other_run in pending.items():
                        cancelled.append(parts[other])
                        api_call(lambda run_id=other_run.id, why=why: client.set_flow_run_state(
                            run_id, why, force=True),
                            f"{stage.name}: cancelling {parts[other].where()}",
                            config.orchestration.api_outage_s)
            if pending and cancelled_at is not None and \
                    time.monotonic() > cancelled_at + CANCEL_GRACE_S:
                failed += [(parts[i], f"child run {r.name} ({r.id}) cancelled, not yet stopped "
                            f"after {CANCEL_GRACE_S:.0f} s (is its worker alive?)")
                           for i, r in pending.items()]
                break
            if pending and deadline is not None and time.monotonic() > deadline:
                raise StageDispatchError(
                    f"{stage.name}: child runs {[r.name for r in pending.values()]} still "
                    f"running after orchestration.stage_timeout_s="
                    f"{config.orchestration.stage_timeout_s}; is a worker polling each host's "
                    "queue?")
            if pending:
                time.sleep(config.orchestration.poll_interval_s)
    return failed, cancelled


def with_endpoint_block(config: PipelineConfig) -> PipelineConfig:
    """Fill generate.endpoint from the inference endpoint block the config names, when generate
    answers over HTTP."""
    name = config.orchestration.endpoint_block
    if not name or config.generate.backend != "openai":  # only an HTTP generate reads it
        return config
    from blocks.endpoint import InferenceEndpoint

    raw = config.model_dump(mode="json")
    raw["generate"]["endpoint"] = InferenceEndpoint.load(name).endpoint_config()
    return parse_config(raw, f"orchestration.endpoint_block={name}")
