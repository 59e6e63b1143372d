"""Where a stage runs. Local mode: in the pipeline's process. Distributed mode: GPU stages run as
child flow runs of their deployments on the gpu work pool (run_deployment); the parent waits,
checks the child's final state, passes the input descriptors and reads the outputs' descriptors
from their manifests on the shared run_root. Both modes call the same task with the same cache
key (flows/pipeline.py: run_stage_task), so caching is identical."""

from __future__ import annotations

from draftsmith import stages
from draftsmith.config import PipelineConfig, parse_config
from draftsmith.plan import Step
from draftsmith.stages import Stage


class StageDispatchError(RuntimeError):
    pass


def is_remote(config: PipelineConfig, stage: Stage | str) -> bool:
    """A GPU stage in distributed mode (the table says which stages use GPUs, and when)."""
    stage = stages.get(stage) if isinstance(stage, str) else stage
    return config.orchestration.mode == "distributed" and stage.gpu(config)


def flow_name(stage: Stage | str) -> str:
    stage = stages.get(stage) if isinstance(stage, str) else stage
    return f"draftsmith-{stage.label}"


def deployment_name(config: PipelineConfig, stage: Stage | str) -> str:
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
