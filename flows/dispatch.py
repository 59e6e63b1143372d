"""Where a stage runs. Local mode: in the pipeline's process. Distributed mode: GPU stages run as
child flow runs of their deployments on the gpu work pool (run_deployment); the parent waits,
checks the child's final state, passes the input descriptors and reads the outputs' descriptors
from their manifests on the shared run_root. Both modes call the same task with the same cache
key (flows/pipeline.py: run_stage_task), so caching is identical."""

from __future__ import annotations

from draftsmith.artifacts import Descriptor
from draftsmith.config import PipelineConfig, parse_config
from draftsmith.plan import STAGE_INPUTS


class StageDispatchError(RuntimeError):
    pass


def gpu_stages(config: PipelineConfig) -> set[str]:
    """Stages that run the target or the drafter on accelerators. generate does only when it
    answers with the target in process; against an HTTP endpoint it runs anywhere."""
    stages = {"extract", "train", "deploy", "benchmark"}
    if config.generate.backend == "transformers":
        stages.add("generate")
    return stages


def is_remote(config: PipelineConfig, stage: str) -> bool:
    return config.orchestration.mode == "distributed" and stage in gpu_stages(config)


def remote_group(config: PipelineConfig, stage: str, selected: set[str]) -> list[str]:
    """Stages one child run executes. A served deploy lives in the process that started it, so
    the benchmark that measures it runs in the same child run."""
    if stage == "deploy" and config.deploy.engine == "sglang" and "benchmark" in selected:
        return ["deploy", "benchmark"]
    return [stage]


def flow_name(stage: str) -> str:
    return f"draftsmith-{stage.replace('_', '-')}"


def deployment_name(config: PipelineConfig, stage: str) -> str:
    return f"{flow_name(stage)}/{config.orchestration.gpu_deployment}"


def run_remote(config: PipelineConfig, stages: list[str],
               out: dict[str, Descriptor]) -> dict[str, str]:
    """Run `stages` as one child flow run on the gpu pool; returns each stage task's final state
    name (Completed, Cached). Raises naming the child run unless it completed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    needed = sorted({name for s in stages for name in STAGE_INPUTS[s]} - set(stages))
    parameters = {"config": config.model_dump(mode="json"),
                  "inputs": {name: out[name].model_dump(mode="json") for name in needed}}
    if len(stages) > 1:
        parameters["then_benchmark"] = True
    name = deployment_name(config, stages[0])
    flow_run = run_deployment(name, parameters=parameters,
                              timeout=config.orchestration.stage_timeout_s,
                              poll_interval=config.orchestration.poll_interval_s)
    state = flow_run.state
    if state is None or not state.is_final():
        raise StageDispatchError(
            f"{stages[0]}: child run {flow_run.name} ({flow_run.id}) of {name} is still "
            f"{state.name if state else 'unknown'} after orchestration.stage_timeout_s="
            f"{config.orchestration.stage_timeout_s}; is a worker polling the gpu pool? (a worker "
            "that died leaves it Running until zombie detection marks it Crashed)")
    if not state.is_completed():
        raise StageDispatchError(
            f"{stages[0]}: child run {flow_run.name} ({flow_run.id}) of {name} ended "
            f"{state.name}: {state.message}; its logs are in the Prefect UI")
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    states: dict[str, str] = {}
    for run in sorted(task_runs, key=lambda r: r.created or 0):
        for stage in stages:
            if run.name.startswith(f"{stage.replace('_', '-')}-") and run.state:
                states[stage] = run.state.name
    missing = [s for s in stages if s not in states]
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
