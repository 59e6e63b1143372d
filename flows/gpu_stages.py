"""One flow per stage that can use GPUs (the stage table says which), deployed to the gpu work
pool (deployments/setup.py). The pipeline flow dispatches them with run_deployment in
distributed mode and passes the descriptors of what they read. Each takes the GPU host's
concurrency slots for the GPUs it uses (strict: a missing limit is an error, never a silent
free-for-all), so two runs never share a GPU."""

from __future__ import annotations

import os
from pathlib import Path

# Engine logs ("draftsmith.*") go to the Prefect run log too; must be set before Prefect loads.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftsmith")

from prefect import Flow, flow, get_run_logger  # noqa: E402

from blocks.gpu_host import GpuHost, concurrency_limit_name  # noqa: E402
from draftsmith import stages  # noqa: E402
from draftsmith.artifacts import Descriptor, StagePlan  # noqa: E402
from draftsmith.config import PipelineConfig  # noqa: E402
from draftsmith.hosts import HostPart  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.plan import stage_plan  # noqa: E402
from draftsmith.serve import process as child_processes  # noqa: E402
from draftsmith.serve import servers  # noqa: E402
from draftsmith.stages import Stage  # noqa: E402
from flows.dispatch import flow_name  # noqa: E402
from flows.gpu_slots import gpu_slots  # noqa: E402
from flows.pipeline import run_stage_task  # noqa: E402
from tasks.api_outage import wait_for_api  # noqa: E402
from tasks.stages import part_task_for  # noqa: E402


def gpus_in_use(host: GpuHost) -> int:
    """GPUs this flow run may touch: its CUDA_VISIBLE_DEVICES (the pool's job variables), else
    all of the host's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return host.gpu_count
    return max(1, len([g for g in visible.split(",") if g.strip() and g.strip() != "-1"]))


def run_gpu_stages(names: list[str], config: PipelineConfig, inputs: dict[str, Descriptor],
                   plan: StagePlan | None = None, host_block: str | None = None,
                   part: HostPart | None = None) -> dict[str, dict]:
    """Run `names` in order in this flow run; `plan`: the parent's plan of the first (the
    others are planned here, on the outputs before them). host_block: the GPU host this run
    is pinned to (default the first of the config's). part: this host's part of a stage
    spread over several hosts (the stage's part task runs instead of its task)."""
    # The log file is the host's own: draftsmith.log on a shared run root has one writer.
    configure_logging(log_file=Path(config.run_root) / (
        "draftsmith.log" if part is None else f"draftsmith.{part.host}.log"), console=False)
    logger = get_run_logger()
    block = host_block or (part.host if part else config.orchestration.hosts()[0])
    host = GpuHost.load(block)
    for key, value in host.nccl_env.items():  # the job variables set them; a manual run too
        os.environ.setdefault(key, value)
    slots = gpus_in_use(host)
    limit = concurrency_limit_name(block)
    out = dict(inputs)
    results: dict[str, dict] = {}
    logger.info("%s%s: waiting for %d GPU slot(s) of %s", "+".join(names),
                f" {part.label}" if part else "", slots, limit)
    outage_s = config.orchestration.api_outage_s
    try:
        with gpu_slots(limit, slots, config.run_root, outage_s):
            if part is not None:
                stage = stages.get(names[0])
                assert plan is not None, "a part runs on the plan the pipeline made"
                report = part_task_for(stage)(plan, config,
                                              stage.inputs_from(out), part)
                # Prefect records how this run ended, and frees the slots, through its API.
                wait_for_api(f"{stage.name} {part.label}: finished", outage_s)
                return {stage.name: {"state": "Completed", "part": report}}
            for index, name in enumerate(names):
                stage = stages.get(name)
                planned = plan if index == 0 and plan is not None else \
                    stage_plan(config, name, out)
                state = run_stage_task(config, stage, planned,
                                       stage.inputs_from(out))
                out[name] = state.result()
                results[name] = {"state": state.name, "descriptor": out[name].model_dump()}
                logger.info("stage %s: %s (%s)", name, state.name, out[name].path)
            wait_for_api(f"{'+'.join(names)}: finished", outage_s)
    except BaseException:
        if stopped := child_processes.stop_started():
            logger.warning("stopped %d child process(es) this run started", stopped)
        raise
    finally:
        # A kept server outlives this run (the next deploy reuses it while it is ready).
        if not config.deploy.keep_serving:
            servers.stop_all()
    return results


def stage_flow(stage: Stage) -> Flow:
    """The GPU flow of one stage. `with_next` runs the stage after it in the same flow run (it
    measures this stage's live server, which lives in this process)."""
    index = stages.names().index(stage.name)

    def body(config: PipelineConfig, inputs: dict[str, Descriptor],
             plan: StagePlan | None = None, with_next: bool = False,
             host: str | None = None, part: HostPart | None = None) -> dict[str, dict]:
        names = stages.names()[index: index + 2] if with_next else [stage.name]
        return run_gpu_stages(names, config, inputs, plan, host, part)

    body.__name__ = body.__qualname__ = f"{stage.name}_flow"
    body.__module__ = __name__
    body.__doc__ = f"{stage.name} on the GPU host: {stage.what}."
    return flow(body, name=flow_name(stage))


# One module-level flow per GPU stage, so that a deployment's entrypoint
# (flows.gpu_stages.<stage>_flow) imports it.
STAGE_FLOWS: dict[str, Flow] = {}
for _stage in stages.STAGES:
    if _stage.can_use_gpu:
        STAGE_FLOWS[_stage.name] = globals()[f"{_stage.name}_flow"] = stage_flow(_stage)
