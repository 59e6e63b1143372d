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

from draftsmith.artifacts import Descriptor, load_descriptor  # noqa: E402
from draftsmith.config import STAGES, PipelineConfig  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.plan import stage_plan  # noqa: E402
from draftsmith.serve import servers  # noqa: E402
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


def preflight_extract_disk(config: PipelineConfig, out: dict[str, Descriptor], plan) -> None:
    """Stop before extraction when the hidden-state store will not fit on its disk."""
    from draftsmith.extract.preflight import check_extract_disk
    from draftsmith.extract.stage import aux_layer_ids_for

    check_extract_disk(config.extract, out["merge"], out["target"], plan.dir,
                       aux_layer_ids_for(config.extract, out["target"]))


@flow(name="draftsmith-pipeline")
def pipeline(config: PipelineConfig, stages: list[str] | None = None) -> dict[str, dict]:
    """Run the selected stages (all by default). Returns, per stage, its descriptor and the
    final state name: Completed, Cached, or Reused (not selected, read from disk)."""
    configure_logging(log_file=Path(config.run_root) / "draftsmith.log", console=False)
    logger = get_run_logger()
    selected = set(stages or STAGES)
    target = stage_tasks.resolve_target(config.target)
    results: dict[str, dict] = {}

    out: dict[str, Descriptor] = {"target": target}

    def run(stage: str, *args) -> Descriptor:
        plan = stage_plan(config, stage, out)
        if stage not in selected:
            descriptor = load_descriptor(plan)
            results[stage] = {"state": "Reused", "descriptor": descriptor.model_dump()}
            return descriptor
        if stage == "extract" and not plan.is_complete():
            preflight_extract_disk(config, out, plan)
        # A live server is not cacheable: a served deploy always runs (and reuses a server
        # that is still up).
        live = stage == "deploy" and config.deploy.engine == "sglang"
        task = TASKS[stage].with_options(refresh_cache=live or not plan.is_complete())
        state: State = task(plan, *args, return_state=True)
        descriptor = state.result()
        results[stage] = {"state": state.name, "descriptor": descriptor.model_dump()}
        logger.info("stage %s: %s (%s)", stage, state.name, descriptor.path)
        return descriptor

    # The arguments of each stage's task after its plan (what it reads: draftsmith/plan.py).
    task_args = {
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
    last = max(STAGES.index(s) for s in selected)
    try:
        for stage in STAGES[: last + 1]:
            out[stage] = run(stage, *task_args[stage]())
    finally:
        if not config.deploy.keep_serving and (stopped := servers.stop_all()):
            logger.info("stopped %d server(s) this run started (deploy.keep_serving is false)",
                        stopped)
    return results
