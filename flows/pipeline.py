"""The draftsmith pipeline as one Prefect flow:

    generate -> merge -> extract -> train -> export -> deploy -> benchmark

The engine plans the run (draftsmith/plan.py: keys, what is cached, reused, pruned or
recomputed); this flow is a loop over that plan. Each step runs its stage's task here
(tasks/stages.py) or, for a GPU stage in distributed mode, as a child flow run on the gpu work
pool (flows/dispatch.py), and the plan records what it wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

# Engine logs ("draftsmith.*") go to the Prefect run log too; must be set before Prefect loads.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftsmith")

from prefect import flow, get_run_logger  # noqa: E402
from prefect.states import State  # noqa: E402

from draftsmith.artifacts import StagePlan, load_descriptor  # noqa: E402
from draftsmith.config import DatasetUpdate, PipelineConfig, with_source  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.plan import RunPlan, Step  # noqa: E402
from draftsmith.serve import process as child_processes  # noqa: E402
from draftsmith.serve import servers  # noqa: E402
from draftsmith.stages import Inputs, Stage  # noqa: E402
from flows import dispatch  # noqa: E402
from tasks.stages import resolve_target, task_for  # noqa: E402


def run_stage_task(config: PipelineConfig, stage: Stage, plan: StagePlan,
                   inputs: Inputs) -> State:
    """Run one stage's task in this process; the same call in local mode and inside a GPU
    stage flow, so caching is the same in both. A live output (a server) is never taken from
    the cache, and neither is one whose directory has gone."""
    refresh = stage.live(config) or not plan.is_complete()
    return task_for(stage).with_options(refresh_cache=refresh)(plan, config, inputs,
                                                               return_state=True)


def execute(run: RunPlan, step: Step) -> None:
    """Run a step here, or as a child run on the gpu pool; record what it wrote."""
    logger = get_run_logger()
    if dispatch.is_remote(run.config, step.stage) and (
            step.stage.live(run.config) or not step.plan.is_complete()):
        states = dispatch.run_remote(run.config, step)
        for name in step.group:
            run.record(name, states[name], load_descriptor(run.plan_for(name)))
            logger.info("stage %s: %s on the gpu pool (%s)", name, states[name],
                        run.outputs[name].path)
        return
    state = run_stage_task(run.config, step.stage, step.plan, step.inputs)
    run.record(step.name, state.name, state.result())
    logger.info("stage %s: %s (%s)", step.name, state.name, run.outputs[step.name].path)


@flow(name="draftsmith-pipeline")
def pipeline(config: PipelineConfig, stages: list[str] | None = None,
             dataset: DatasetUpdate | None = None) -> dict[str, dict]:
    """Run the selected stages (all by default). Returns, per stage, its descriptor and the
    final state name: Completed, Cached, Reused (not selected, read from disk) or Pruned (deleted
    by retention after use; recomputed when a stage that reads it has to run).

    `dataset` reads one data source from a new file (what a draftsmith.dataset.updated event
    carries). With orchestration.mode=distributed the GPU stages run as child flow runs on the
    gpu work pool."""
    if dataset is not None:
        config = with_source(config, dataset.source, dataset.path)
    configure_logging(log_file=Path(config.run_root) / "draftsmith.log", console=False)
    if dataset is not None:
        get_run_logger().info("new data: source %s reads %s", dataset.source, dataset.path)
    config = dispatch.with_endpoint_block(config)
    run = RunPlan(config, resolve_target(config.target), stages)
    try:
        for step in run.steps():
            execute(run, step)
    except BaseException:
        # Failed or cancelled (Prefect raises TerminationSignal on SIGTERM): no child of this
        # run may outlive it, kept servers included.
        if stopped := child_processes.stop_started():
            get_run_logger().warning("stopped %d child process(es) this run started", stopped)
        raise
    finally:
        if not config.deploy.keep_serving and (stopped := servers.stop_all()):
            get_run_logger().info("stopped %d server(s) this run started "
                                  "(deploy.keep_serving is false)", stopped)
    return run.results
