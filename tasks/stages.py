"""Prefect tasks: one per stage of the table (draftsmith/stages.py). Each adds retries, a cache
key, a progress artifact, reports and logs around the stage's engine function, and nothing else.

Caching: the cache key is the stage's plan (a hash of its settings and its inputs'
fingerprints, draftsmith/plan.py) plus where it writes. The flow passes `refresh_cache=True`
when the stage's directory is not complete on disk, so a cached descriptor whose files have gone
is recomputed instead of being returned dangling.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect import Task, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from draftsmith import progress as engine_progress
from draftsmith import runlock
from draftsmith.artifacts import Descriptor, StagePlan, hash_json, read_descriptor
from draftsmith.config import PipelineConfig, TargetConfig
from draftsmith.errors import worth_retrying
from draftsmith.hosts import HostPart, check_shared
from draftsmith.reports import Report
from draftsmith.stages import Inputs, Stage, artifact_key
from tasks.api_outage import LatestOnly, api_call


def plan_cache_key(_context, parameters) -> str:
    plan: StagePlan = parameters["plan"]
    return f"draftsmith-{plan.stage}-{plan.key}-{hash_json(plan.path)[:8]}"


def retry_unless_hopeless(_task, _task_run, state) -> bool:
    """An input error (a bad record or value, a missing file, a full disk, no GPU) fails the
    same way on every attempt: fail at once with its message. Everything else may pass on a
    retry (an endpoint down, a crashed worker, GPUs still held) and is retried."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - no readable result: retry as usual
        return True
    return not isinstance(error, BaseException) or worth_retrying(error)


@contextmanager
def progress_artifact(stage: str, key: str | None = None) -> Iterator[None]:
    """Mirror the engine's progress reports into one Prefect progress artifact. The updates go
    out from a thread of their own: a stage never waits on the Prefect API, and one that is
    away misses updates, not work (tasks/api_outage.py)."""
    artifact: list = []  # its id, once the API has created it

    def send(update: tuple[float, str | None]) -> None:
        if not artifact:
            artifact.append(create_progress_artifact(update[0], key=key,
                                                     description=f"{stage} progress"))
        update_progress_artifact(artifact[0], update[0], description=update[1])

    sender = LatestOnly(send, f"{stage} progress")
    sender.put((0.0, f"{stage} progress"))

    def listener(p: engine_progress.Progress) -> None:
        if p.total:  # the description carries the counts, rate and ETA of the log line
            sender.put((min(100.0, 100.0 * p.done / p.total), p.message()))

    engine_progress.add_listener(listener)
    try:
        yield
    except BaseException:
        sender.close()
        raise
    finally:
        engine_progress.remove_listener(listener)
    sender.close(last=(100.0, None))


def publish(reports: list[Report], config: PipelineConfig) -> None:
    """Reports as Prefect artifacts, keyed within the pipeline (draftsmith-<name>-<key>), and
    their lines in the run log."""
    outage_s = config.orchestration.api_outage_s
    for report in reports:
        key = artifact_key(config, report.key) if report.key else None
        if report.kind == "table":
            api_call(lambda r=report, k=key: create_table_artifact(
                r.rows, key=k, description=r.description), f"artifact {key}", outage_s)
        elif report.kind == "markdown":
            api_call(lambda r=report, k=key: create_markdown_artifact(
                r.text, key=k, description=r.description), f"artifact {key}", outage_s)
    log_lines(reports)


def log_lines(reports: list[Report]) -> None:
    """The reports' lines in the run log (all a cached stage shows again: its artifacts are
    those of the run that wrote it)."""
    logger = get_run_logger()
    for report in reports:
        for line in report.log_lines:
            logger.info("%s", line)


def secret_value(name: str | None) -> str | None:
    """A Prefect Secret block's value, read here and handed to the engine as a value: it is not
    a task parameter, so Prefect never stores or shows it."""
    if name is None:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(name).get()


def run_stage(stage: Stage, plan: StagePlan, config: PipelineConfig, inputs: Inputs,
              joined_run: str | None = None) -> Descriptor:
    """The body of every stage task. joined_run: the stage ran as parts on several GPU hosts
    (that run id); here its output is joined from theirs."""
    if (descriptor := finished(stage, plan, config)) is None:
        # One process computes a stage at a time: another one (a stage flow started beside the
        # pipeline's) is waited for, and its output then reused.
        with runlock.hold(config.run_root, runlock.stage_lock_name(stage.name, plan.key),
                          lock_holder(stage.name), config.orchestration.run_root_wait_s,
                          f"stage {stage.name} ({plan.dir})"):
            descriptor = finished(stage, plan, config) or compute(stage, plan, config, inputs,
                                                                  joined_run)
    publish(stage.reports(descriptor), config)
    return descriptor


def finished(stage: Stage, plan: StagePlan, config: PipelineConfig) -> Descriptor | None:
    """The stage's output when its directory is complete: a retry, a rerun after Prefect's
    cache was cleared, or another process that finished it first. A live output (a server) is
    checked against the server by the engine instead."""
    if plan.is_complete() and not stage.live(config):
        get_run_logger().info("%s: complete output found at %s, reusing it", stage.name,
                              plan.dir)
        return read_descriptor(plan)
    return None


def compute(stage: Stage, plan: StagePlan, config: PipelineConfig, inputs: Inputs,
            joined_run: str | None) -> Descriptor:
    if joined_run is not None and stage.spread is not None:
        get_run_logger().info("%s: joining the output of its %d hosts", stage.name,
                              stage.parts(config))
        return stage.spread.finish(config, inputs, plan, joined_run)
    stage.preflight(config, inputs, plan)
    secret = secret_value(stage.secret(config))
    if stage.progress:
        with progress_artifact(stage.name, artifact_key(config, f"{stage.label}-progress")):
            return stage.execute(config, inputs, plan, secret)
    return stage.execute(config, inputs, plan, secret)


def lock_holder(stage: str | None = None, run: str | None = None) -> runlock.Holder:
    """This flow run (named `run`, or as Prefect named it), as a lock names it to a run that
    waits for it."""
    from prefect.runtime import flow_run

    return runlock.Holder(run=run or flow_run.get_name() or "a draftsmith run",
                          flow_run=flow_run.get_id(), url=flow_run.get_flow_run_ui_url(),
                          stage=stage)


def stage_task(stage: Stage) -> Task:
    def body(plan: StagePlan, config: PipelineConfig, inputs: Inputs,
             joined_run: str | None = None) -> Descriptor:
        return run_stage(stage, plan, config, inputs, joined_run)

    body.__name__ = body.__qualname__ = f"{stage.name}_task"
    body.__doc__ = f"{stage.name}: {stage.what} ({stage.module})."
    return task(body, name=stage.label, cache_key_fn=plan_cache_key, persist_result=True,
                retries=stage.retries, retry_delay_seconds=[5, 30],
                retry_condition_fn=retry_unless_hopeless)


def run_part(stage: Stage, plan: StagePlan, config: PipelineConfig, inputs: Inputs,
             part: HostPart) -> dict:
    """The body of every part task: one GPU host's part of a stage spread over several. It
    proves this host sees the run root before anything else, then checks its GPUs and disk
    as the whole stage would."""
    assert stage.spread is not None
    logger = get_run_logger()
    check_shared(plan, part, config.run_root, config.orchestration.shared_storage_wait_s)
    logger.info("%s %s: sees the shared run root (%s)", stage.name, part.where(),
                config.run_root)
    name = runlock.stage_lock_name(stage.name, plan.key, f"{part.kind}{part.index}")
    with runlock.hold(config.run_root, name, lock_holder(stage.name),
                      config.orchestration.run_root_wait_s,
                      f"stage {stage.name} {part.label} ({plan.dir})"):
        stage.preflight(config, inputs, plan)
        if stage.progress:
            key = artifact_key(config, f"{stage.label}-progress-{part.kind}-{part.index}")
            with progress_artifact(f"{stage.name} {part.label}", key):
                report = stage.spread.run(config, inputs, plan, part)
        else:
            report = stage.spread.run(config, inputs, plan, part)
    logger.info("%s %s: done %s", stage.name, part.where(), report)
    return report


def part_task(stage: Stage) -> Task:
    """A part's task: retried as the stage's own is (a crashed node or range again; an input
    error, such as a host that does not see the run root, at once), never cached (the
    pipeline decides which parts run)."""
    def body(plan: StagePlan, config: PipelineConfig, inputs: Inputs, part: HostPart) -> dict:
        return run_part(stage, plan, config, inputs, part)

    body.__name__ = body.__qualname__ = f"{stage.name}_part_task"
    body.__doc__ = f"{stage.name} on one of several GPU hosts: {stage.what} ({stage.module})."
    return task(body, name=f"{stage.label}-part", cache_policy=NO_CACHE, retries=stage.retries,
                retry_delay_seconds=[5, 30], retry_condition_fn=retry_unless_hopeless)


_PART_TASKS: dict[Stage, Task] = {}


def part_task_for(stage: Stage) -> Task:
    if stage not in _PART_TASKS:
        _PART_TASKS[stage] = part_task(stage)
    return _PART_TASKS[stage]


_TASKS: dict[Stage, Task] = {}


def task_for(stage: Stage) -> Task:
    """The stage's task, made once per stage (a stage added to the table gets one too)."""
    if stage not in _TASKS:
        _TASKS[stage] = stage_task(stage)
    return _TASKS[stage]


@task(name="resolve-target", retries=1, retry_condition_fn=retry_unless_hopeless)
def resolve_target(cfg: TargetConfig) -> Descriptor:
    from draftsmith.target import resolve_target as resolve

    return resolve(cfg)
