"""The draftsmith pipeline as one Prefect flow:

    generate -> merge -> extract -> train -> fix-keys -> deploy -> benchmark

Each stage is a task (tasks/stages.py) that returns a small descriptor of what it wrote; the
flow plans each stage's output directory from its config and inputs, runs the selected stages
and reads the finished outputs of the others from disk.
"""

from __future__ import annotations

import os
from pathlib import Path

# Engine logs ("draftsmith.*") go to the Prefect run log too; must be set before Prefect loads.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftsmith")

from prefect import flow, get_run_logger  # noqa: E402
from prefect.states import State  # noqa: E402

from draftsmith import retention  # noqa: E402
from draftsmith.artifacts import Descriptor, StagePlan, load_descriptor  # noqa: E402
from draftsmith.config import STAGES, DatasetUpdate, PipelineConfig, with_source  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.plan import STAGE_INPUTS, stage_plan  # noqa: E402
from draftsmith.serve import process as child_processes  # noqa: E402
from draftsmith.serve import servers  # noqa: E402
from flows import dispatch  # noqa: E402
from tasks import stages as stage_tasks  # noqa: E402

TASKS = {
    "generate": stage_tasks.generate,
    "merge": stage_tasks.merge,
    "extract": stage_tasks.extract,
    "train": stage_tasks.train,
    "fix_keys": stage_tasks.fix_keys,
    "deploy": stage_tasks.deploy,
    "benchmark": stage_tasks.benchmark,
}


def stage_args(config: PipelineConfig, out: dict[str, Descriptor]):
    """The arguments of each stage's task after its plan (what it reads: draftsmith/plan.py)."""
    return {
        "generate": lambda: (config.generate, config.data, config.target, out["target"]),
        "merge": lambda: (config.merge, out["generate"], out["target"]),
        "extract": lambda: (config.extract, config.target, out["merge"], out["target"]),
        "train": lambda: (config.train, out["extract"], out["merge"], out["target"]),
        "fix_keys": lambda: (config.fix_keys, config.target, out["train"], out["target"]),
        "deploy": lambda: (config.deploy, config.target, out["fix_keys"], out["merge"],
                           out["target"]),
        "benchmark": lambda: (config.benchmark, config.target, out["deploy"], out["merge"],
                              out["target"], config.deploy),
    }


def run_stage_task(config: PipelineConfig, stage: str, plan: StagePlan,
                   out: dict[str, Descriptor]) -> State:
    """Run one stage's task in this process; the same call in local mode and inside a GPU
    stage flow, so caching is the same in both."""
    # A live server is not cacheable: a served deploy always runs (and reuses a server that is
    # still up).
    live = stage == "deploy" and config.deploy.engine == "sglang"
    task = TASKS[stage].with_options(refresh_cache=live or not plan.is_complete())
    return task(plan, *stage_args(config, out)[stage](), return_state=True)


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
    logger = get_run_logger()
    if dataset is not None:
        logger.info("new data: source %s reads %s", dataset.source, dataset.path)
    config = dispatch.with_endpoint_block(config)
    selected = set(stages or STAGES)
    last = max(STAGES.index(s) for s in selected)
    target = stage_tasks.resolve_target(config.target)
    results: dict[str, dict] = {}
    pruned: set[str] = set()

    out: dict[str, Descriptor] = {"target": target}

    def execute(stage: str, plan: StagePlan) -> Descriptor:
        if stage in results and results[stage]["state"] != "Pruned":
            return out[stage]  # ran in the child run of the stage before it (deploy+benchmark)
        # A GPU stage whose output is complete needs no GPU: its task answers here from the
        # cache (or, without a shared result store, from the manifest), with no child run.
        live = stage == "deploy" and config.deploy.engine == "sglang"
        if dispatch.is_remote(config, stage) and (live or not plan.is_complete()):
            group = dispatch.remote_group(config, stage, selected)
            states = dispatch.run_remote(config, group, out)
            for name in group:
                plan = stage_plan(config, name, out)
                out[name] = load_descriptor(plan)
                results[name] = {"state": states[name], "descriptor": out[name].model_dump()}
                logger.info("stage %s: %s on the gpu pool (%s)", name, states[name],
                            out[name].path)
            return out[stage]
        state: State = run_stage_task(config, stage, plan, out)
        descriptor = state.result()
        results[stage] = {"state": state.name, "descriptor": descriptor.model_dump()}
        logger.info("stage %s: %s (%s)", stage, state.name, descriptor.path)
        return descriptor

    def run(stage: str) -> Descriptor:
        plan = stage_plan(config, stage, out)
        recorded = retention.pruned_descriptor(plan)
        if recorded is not None and STAGES.index(stage) < last:
            pruned.add(stage)
            results[stage] = {"state": "Pruned", "descriptor": recorded.model_dump()}
            return recorded
        if stage not in selected:
            descriptor = load_descriptor(plan)
            results[stage] = {"state": "Reused", "descriptor": descriptor.model_dump()}
            return descriptor
        if not plan.is_complete():
            for name in STAGE_INPUTS[stage]:
                if name in pruned:  # its files were deleted after use: this stage needs them
                    logger.info("stage %s reads %s, deleted by retention; recomputing it",
                                stage, name)
                    pruned.discard(name)
                    out[name] = execute(name, stage_plan(config, name, out))
            plan = stage_plan(config, stage, out)
        return execute(stage, plan)

    try:
        for stage in STAGES[: last + 1]:
            out[stage] = run(stage)
            if stage in results and results[stage]["state"] not in ("Pruned", "Reused"):
                apply_retention(config, stage, out)
    except BaseException:
        # Failed or cancelled (Prefect raises TerminationSignal on SIGTERM): no child of this
        # run may outlive it, kept servers included.
        if stopped := child_processes.stop_started():
            logger.warning("stopped %d child process(es) this run started", stopped)
        raise
    finally:
        if not config.deploy.keep_serving and (stopped := servers.stop_all()):
            logger.info("stopped %d server(s) this run started (deploy.keep_serving is false)",
                        stopped)
    return results


def apply_retention(config: PipelineConfig, finished: str, out: dict[str, Descriptor]) -> None:
    """Delete what the retention settings say the stage that just finished made obsolete."""
    if finished == "merge" and config.retention.delete_generations_after_merge:
        retention.prune(stage_plan(config, "generate", out),
                        "(retention.delete_generations_after_merge: merge has finished)")
    if finished == "train" and config.retention.delete_hidden_states_after_train:
        retention.prune(stage_plan(config, "extract", out),
                        "(retention.delete_hidden_states_after_train: training has finished)")
