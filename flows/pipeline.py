"""The draftsmith pipeline as one Prefect flow:

    generate -> merge -> extract -> train -> export -> deploy -> benchmark

The engine plans the run (draftsmith/plan.py: keys, what is cached, reused, pruned or
recomputed); this flow is a loop over that plan. Each step runs its stage's task here
(tasks/stages.py) or, for a GPU stage in distributed mode, as a child flow run on the gpu work
pool (flows/dispatch.py), and the plan records what it wrote. The run's last artifact is its
summary (draftsmith/summary.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

# Engine logs ("draftsmith.*") go to the Prefect run log too; must be set before Prefect loads.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftsmith")

from prefect import flow, get_run_logger  # noqa: E402
from prefect.states import State  # noqa: E402
from pydantic import WithJsonSchema  # noqa: E402

from draftsmith import runlock, summary  # noqa: E402
from draftsmith import stages as stage_table  # noqa: E402
from draftsmith.artifacts import StagePlan, load_descriptor  # noqa: E402
from draftsmith.config import (  # noqa: E402
    ConfigError,
    DatasetUpdate,
    DeployConfig,
    PipelineConfig,
    form_config,
)
from draftsmith.data.source_fingerprints import data_descriptors, data_version  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.plan import RunPlan, Step  # noqa: E402
from draftsmith.serve import process as child_processes  # noqa: E402
from draftsmith.serve import servers  # noqa: E402
from draftsmith.stages import Inputs, Stage  # noqa: E402
from flows import data_updates, dispatch  # noqa: E402
from tasks.stages import lock_holder, log_lines, publish, resolve_target, task_for  # noqa: E402

# Defaults () are empty lists in the form (tuples: a flow's defaults are never mutated).
# The form's stage picker lists the stage table's names (a multi-select); the flow itself
# accepts any name the table knows, aliases included, and refuses others naming the valid ones.
StageSelection = Annotated[list[str], WithJsonSchema({
    "type": "array", "uniqueItems": True,
    "items": {"type": "string", "enum": stage_table.names()}})]
Engine = DeployConfig.model_fields["engine"].annotation


def run_stage_task(config: PipelineConfig, stage: Stage, plan: StagePlan,
                   inputs: Inputs, joined_run: str | None = None) -> State:
    """Run one stage's task in this process; the same call in local mode and inside a GPU
    stage flow, so caching is the same in both. A live output (a server) is never taken from
    the cache, and neither is one whose directory has gone. joined_run: the stage's parts
    ran on several GPU hosts (that run id): the task joins their output."""
    refresh = stage.live(config) or not plan.is_complete()
    return task_for(stage).with_options(refresh_cache=refresh)(plan, config, inputs,
                                                               joined_run, return_state=True)


def execute(run: RunPlan, step: Step, run_name: str | None) -> None:
    """Run a step here, or as a child run on the gpu pool (one per GPU host when the stage
    is spread over several, then joined here); record what it wrote."""
    logger = get_run_logger()
    if dispatch.is_spread(run.config, step.stage) and not step.plan.is_complete():
        joined_run = dispatch.run_parts(run.config, step, run_name)
        state = run_stage_task(run.config, step.stage, step.plan, step.inputs, joined_run)
        run.record(step.name, state.name, state.result())
        logger.info("stage %s: %s on %d GPU hosts (%s)", step.name, state.name,
                    step.stage.parts(run.config), run.outputs[step.name].path)
        return
    if dispatch.is_remote(run.config, step.stage) and (
            step.stage.live(run.config) or not step.plan.is_complete()):
        states = dispatch.run_remote(run.config, step, run_name)
        for name in step.group:
            run.record(name, states[name], load_descriptor(run.plan_for(name)))
            logger.info("stage %s: %s on the gpu pool (%s)", name, states[name],
                        run.outputs[name].path)
        return
    state = run_stage_task(run.config, step.stage, step.plan, step.inputs)
    run.record(step.name, state.name, state.result())
    logger.info("stage %s: %s (%s)", step.name, state.name, run.outputs[step.name].path)
    if state.name == "Cached":  # its task did not run: its figures, as the run that wrote it
        log_lines(step.stage.reports(run.outputs[step.name]))


def selected_stages(names: Sequence[str] | None) -> list[str] | None:
    """The stage table's names for a selection (aliases accepted); an unknown name is refused
    with the valid ones."""
    try:
        return [stage_table.get(name).name for name in names] if names else None
    except ConfigError as err:
        raise ConfigError(f"stages: {err}") from None


def name_run(config: PipelineConfig, data: list) -> str:
    """Name this flow run after the pipeline and its data version (`tiny, data 3f2a9c1b`), or
    the drafter made elsewhere it deploys (`tiny, drafter eagle3-drafter`), so runs tell apart
    in the run list; child runs are named after it."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    made = (f"drafter {Path(config.deploy.drafter).name}" if config.deploy.drafter
            else f"data {data_version(data)}")
    name = f"{config.pipeline_name}, {made}"
    if flow_run.id:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    return name


def form_overrides(epochs: int | None, ttt_steps: int | None, engine: str | None,
                   overrides: Sequence[str]) -> list[str]:
    """The form's common settings as `a.b=c` overrides, before the free-form ones."""
    out = []
    if epochs is not None:
        out.append(f"train.epochs={epochs}")
    if ttt_steps is not None:
        out.append(f"train.ttt_steps={ttt_steps}")
    if engine is not None:
        out.append(f"deploy.engine={engine}")
    return out + list(overrides or [])


@flow(name="draftsmith-pipeline")
def pipeline(config: str = "tiny", stages: StageSelection = (),
             dataset: DatasetUpdate | None = None, epochs: int | None = None,
             ttt_steps: int | None = None, engine: Engine | None = None,
             overrides: list[str] = (), full_config: dict[str, Any] | None = None
             ) -> dict[str, dict]:
    """Train a speculative-decoding drafter (EAGLE-3, EAGLE-3.1 or DFlash) and ship it to vLLM
    or SGLang: generate, merge, extract, train, export, deploy, benchmark. Stages whose output
    is complete for these settings are Cached.

    Args:
        config: The pipeline YAML to run: a path this worker can read, or the name of a bundled
            example (tiny: the CPU demo).
        stages: Run only these stages (none picked: all). Stages before them must be complete for
            this config; they are read from disk.
        dataset: New data for one source (what the draftsmith.dataset.updated event carries):
            that source reads this file from now on, in this run and every later run of this
            pipeline. A new source name adds a source.
        epochs: Training epochs (train.epochs); empty keeps the config's.
        ttt_steps: Drafting steps trained with test-time training (train.ttt_steps); empty
            keeps the config's.
        engine: The serving engine the drafter is deployed on (deploy.engine); empty keeps the
            config's.
        overrides: More settings as key=value, as with `draftsmith run --set`, e.g.
            train.lr=1e-4 or benchmark.num_prompts=32.
        full_config: Advanced: the whole pipeline config as JSON (every section of a YAML
            config). When set, `config` is not read; overrides still apply.

    Returns, per stage, its descriptor and the final state name: Completed, Cached, Reused (not
    selected, read from disk) or Pruned (deleted by retention after use; recomputed when a
    stage that reads it has to run). With orchestration.mode=distributed the GPU stages run as
    child flow runs on the gpu work pool.
    """
    selected = selected_stages(stages)
    run_config = form_config(config, full_config,
                             form_overrides(epochs, ttt_steps, engine, overrides))
    configure_logging(log_file=Path(run_config.run_root) / "draftsmith.log", console=False)
    run_config = data_updates.apply(run_config, dataset)
    # The sources' content fingerprints, hashed once; a drafter made elsewhere reads none.
    data = [] if run_config.deploy.drafter else data_descriptors(run_config)
    run_name = name_run(run_config, data)
    run_config = dispatch.with_endpoint_block(run_config)
    run = RunPlan(run_config, resolve_target(run_config.target), selected, data=data)
    try:
        # One run writes a run root at a time: another one is waited for (or refused, with
        # orchestration.run_root_wait_s), and a lock left by a killed run is taken over.
        with runlock.hold(run_config.run_root, runlock.RUN_LOCK, lock_holder(run=run_name),
                          run_config.orchestration.run_root_wait_s,
                          f"run root {run_config.run_root}"):
            for step in run.steps():
                execute(run, step, run_name)
    except BaseException:
        # Failed or cancelled (Prefect raises TerminationSignal on SIGTERM): no child of this
        # run may outlive it, kept servers included.
        if stopped := child_processes.stop_started():
            get_run_logger().warning("stopped %d child process(es) this run started", stopped)
        raise
    finally:
        if not run_config.deploy.keep_serving and (stopped := servers.stop_all()):
            get_run_logger().info("stopped %d server(s) this run started "
                                  "(deploy.keep_serving is false)", stopped)
    publish([summary.run_report(run.results, run_name)], run_config)
    return run.results
