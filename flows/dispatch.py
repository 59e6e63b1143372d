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
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
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
    flow_run = run_deployment(name, parameters=parameters,
                              flow_run_name=f"{labels} for {parent}" if parent else None,
                              timeout=config.orchestration.stage_timeout_s,
                              poll_interval=config.orchestration.poll_interval_s)
    state = flow_run.state
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
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    states: dict[str, str] = {}
    for run in sorted(task_runs, key=lambda r: r.created or 0):
        for stage in group:
            if run.name.startswith(f"{stage.label}-") and run.state:
                states[stage.name] = run.state.name
    missing = [s.name for s in group if s.name not in states]
    if missing:
        raise StageDispatchError(f"child run {flow_run.name} ({flow_run.id}) completed without "
                                 f"running the task of {missing}")
    return states


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
        runs[part.index] = run_deployment(
            name, timeout=0, parameters={
                "config": config.model_dump(mode="json"), "inputs": inputs,
                "plan": step.plan.model_dump(mode="json"), "host": part.host,
                "part": part.model_dump(mode="json")},
            flow_run_name=f"{stage.label} {part.label} for {parent}" if parent else None)
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
                state = client.read_flow_run(run.id).state
                if state is None or not state.is_final():
                    continue
                del pending[index]
                if state.is_completed() or parts[index] in cancelled:
                    continue
                failed.append((parts[index], f"child run {run.name} ({run.id}) ended "
                               f"{state.name}: {state.message}"))
                if stage.spread is not None and stage.spread.coupled and cancelled_at is None:
                    cancelled_at = time.monotonic()
                    for other, other_run in pending.items():
                        cancelled.append(parts[other])
                        client.set_flow_run_state(other_run.id, Cancelling(
                            message=f"{stage.name}: {parts[index].where()} failed"), force=True)
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
