"""Prefect tasks: one thin wrapper per stage. Each adds retries, a cache key, logs and artifacts
around the engine function and nothing else.

Caching: the cache key is the stage's plan (a hash of its config and its inputs' fingerprints,
see draftsmith.artifacts) plus where it writes. The flow passes `refresh_cache=True` when the
stage's directory is not complete on disk, so a cached descriptor whose files have gone is
recomputed instead of being returned dangling.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from draftsmith import preflight
from draftsmith import progress as engine_progress
from draftsmith.artifacts import Descriptor, StagePlan, hash_json, read_descriptor
from draftsmith.config import (
    BenchmarkConfig,
    DataConfig,
    DeployConfig,
    ExtractConfig,
    FixKeysConfig,
    GenerateConfig,
    MergeConfig,
    TargetConfig,
    TrainConfig,
)


def plan_cache_key(_context, parameters) -> str:
    plan: StagePlan = parameters["plan"]
    return f"draftsmith-{plan.stage}-{plan.key}-{hash_json(plan.path)[:8]}"


def retry_unless_hopeless(_task, _task_run, state) -> bool:
    """A full disk or a missing GPU fails the same way on every attempt: fail at once with the
    preflight's message instead of retrying it twice."""
    from draftsmith.extract.preflight import DiskSpaceError

    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - no readable result: retry as usual
        return True
    return not isinstance(error, DiskSpaceError | preflight.PreflightError)


STAGE_TASK = dict(cache_key_fn=plan_cache_key, persist_result=True, retries=2,
                  retry_delay_seconds=[5, 30], retry_condition_fn=retry_unless_hopeless)


@contextmanager
def progress_artifact(stage: str) -> Iterator[None]:
    """Mirror the engine's progress reports into one Prefect progress artifact."""
    artifact_id = create_progress_artifact(0.0, description=f"{stage} progress")

    def listener(p: engine_progress.Progress) -> None:
        if p.total:  # the description carries the counts, rate and ETA of the log line
            update_progress_artifact(artifact_id, min(100.0, 100.0 * p.done / p.total),
                                     description=p.message())

    engine_progress.add_listener(listener)
    try:
        yield
    finally:
        engine_progress.remove_listener(listener)
    update_progress_artifact(artifact_id, 100.0)


def _already_done(plan: StagePlan) -> Descriptor | None:
    """A retry or a rerun after Prefect's cache was cleared finds the finished directory."""
    if plan.is_complete():
        get_run_logger().info("%s: complete output found at %s, reusing it", plan.stage, plan.path)
        return read_descriptor(plan)
    return None


@task(name="resolve-target", retries=1)
def resolve_target(cfg: TargetConfig) -> Descriptor:
    from draftsmith.target import resolve_target as resolve

    return resolve(cfg)


def _api_key(cfg: GenerateConfig) -> str | None:
    """The Secret block's value, read here and handed to the engine as a value: it is not a
    task parameter, so Prefect never stores or shows it."""
    if cfg.endpoint is None or cfg.endpoint.api_key_secret is None:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(cfg.endpoint.api_key_secret).get()


def report_generate(descriptor: Descriptor) -> None:
    """Per-source guard counts and the generation summary, as table artifacts and log lines."""
    import json

    logger = get_run_logger()
    sources = json.loads((descriptor.dir / "stats.json").read_text())
    rows = [{"source": s["source"], "read": s["read"], "kept": s["kept"],
             "dropped": sum(s["dropped"].values()),
             "drop reasons": "; ".join(f"{r} ({n})" for r, n in s["dropped"].items()) or "-",
             "notes": "; ".join(f"{r} ({n})" for r, n in s.get("notes", {}).items()) or "-"}
            for s in sources]
    create_table_artifact(rows, key="draftsmith-generate-sources",
                          description="generate: records read, kept and dropped per source")
    for row in rows:
        logger.info("generate source %s", row)
    summary_file = descriptor.dir / "generation.json"
    if not summary_file.is_file():  # written by a draftsmith before the HTTP backend
        return
    summary = json.loads(summary_file.read_text())
    flat = {k: v for k, v in summary.items() if k != "per_partition"}
    create_table_artifact([{"figure": k, "value": str(v)} for k, v in flat.items()],
                          key="draftsmith-generate-summary",
                          description="generate: requests, tokens, throughput, cost")
    logger.info("generate summary %s", flat)


def report_merge(descriptor: Descriptor) -> None:
    import json

    from draftsmith.data.merge import COVERAGE_FILE

    logger = get_run_logger()
    stats = json.loads((descriptor.dir / "stats.json").read_text())
    rows = [{"source": s, **c} for s, c in stats.items()]
    create_table_artifact(rows, key="draftsmith-merge-sources",
                          description="merge: records, tokens, masked tokens, mean length, "
                          "duplicates and truncations per source")
    for row in rows:
        logger.info("merge source %s", row)
    if not (descriptor.dir / COVERAGE_FILE).is_file():  # an older merge output
        return
    coverage = json.loads((descriptor.dir / COVERAGE_FILE).read_text())
    create_table_artifact([{"figure": k, "value": str(v)} for k, v in coverage.items()],
                          key="draftsmith-merge-vocab",
                          description="merge: draft vocab coverage of loss-masked tokens")
    logger.info("merge draft vocab %s", coverage)


@task(name="generate", **STAGE_TASK)
def generate(plan: StagePlan, cfg: GenerateConfig, data: DataConfig, target_cfg: TargetConfig,
             target: Descriptor) -> Descriptor:
    from draftsmith.generate.stage import run_generate

    if not (descriptor := _already_done(plan)):
        preflight.check_stage(plan, target_cfg.device, preflight.generate_bytes(
            cfg, [s.path for s in data.sources if s.path]))
        with progress_artifact("generate"):
            descriptor = run_generate(cfg, data, target_cfg, target, plan,
                                      api_key=_api_key(cfg))
    report_generate(descriptor)
    return descriptor


@task(name="merge", **STAGE_TASK)
def merge(plan: StagePlan, cfg: MergeConfig, generated: Descriptor,
          target: Descriptor) -> Descriptor:
    from draftsmith.data.merge import run_merge

    if not (descriptor := _already_done(plan)):
        descriptor = run_merge(cfg, generated, target, plan)
    report_merge(descriptor)
    return descriptor


@task(name="extract", **STAGE_TASK)
def extract(plan: StagePlan, cfg: ExtractConfig, target_cfg: TargetConfig, merged: Descriptor,
            target: Descriptor) -> Descriptor:
    from draftsmith.extract.preflight import check_extract_disk
    from draftsmith.extract.stage import aux_layer_ids_for, run_extract

    if done := _already_done(plan):
        return done
    # On the machine that writes the store (a GPU worker in distributed mode), before any
    # GPU is taken or shard written.
    preflight.check_stage(plan, target_cfg.device)
    check_extract_disk(cfg, merged, target, plan.dir, aux_layer_ids_for(cfg, target))
    with progress_artifact("extract"):
        return run_extract(cfg, target_cfg, merged, target, plan)


@task(name="train", **{**STAGE_TASK, "retries": 1})
def train(plan: StagePlan, cfg: TrainConfig, hidden: Descriptor, merged: Descriptor,
          target: Descriptor) -> Descriptor:
    import json

    from draftsmith.train.trainer import METRICS_FILE, run_train

    if done := _already_done(plan):
        return done
    preflight.check_stage(plan, cfg.device, preflight.train_bytes(
        target, merged.figures.get("draft_vocab_size", 0)))
    with progress_artifact("train"):
        descriptor = run_train(cfg, hidden, merged, target, plan)
    rows = [json.loads(line) for line in (descriptor.dir / METRICS_FILE).read_text().splitlines()]
    create_table_artifact([r for r in rows if r["split"] == "validation"],
                          description="train: validation metrics per epoch")
    create_markdown_artifact(
        f"# training\n\nbest validation tau **{descriptor.figures['tau']:.3f}**, acceptance "
        f"replayed over the validation answers (greedy chain decoding) "
        f"**{descriptor.figures.get('acceptance_replayed', float('nan')):.3f}**\n\n"
        f"charts: `{descriptor.dir / 'training.png'}`, `{descriptor.dir / 'training.svg'}`",
        description="train: summary")
    return descriptor


@task(name="fix-keys", **STAGE_TASK)
def fix_keys(plan: StagePlan, cfg: FixKeysConfig, target_cfg: TargetConfig, trained: Descriptor,
             target: Descriptor) -> Descriptor:
    from draftsmith.export.fix_keys import run_fix_keys

    if done := _already_done(plan):
        return done
    return run_fix_keys(cfg, target_cfg, trained, target, plan)


@task(name="deploy", **STAGE_TASK)
def deploy(plan: StagePlan, cfg: DeployConfig, target_cfg: TargetConfig, exported: Descriptor,
           merged: Descriptor, target: Descriptor) -> Descriptor:
    from draftsmith.serve.deploy import run_deploy

    # A served deploy is checked against its live server by the engine, not by the directory.
    if cfg.engine == "embedded" and (done := _already_done(plan)):
        return done
    if cfg.engine == "embedded":  # a served deploy checks its GPUs itself, minding its server
        preflight.check_stage(plan, target_cfg.device)
    return run_deploy(cfg, target_cfg, exported, merged, target, plan)


@task(name="benchmark", **STAGE_TASK)
def benchmark(plan: StagePlan, cfg: BenchmarkConfig, target_cfg: TargetConfig,
              deployment: Descriptor, merged: Descriptor, target: Descriptor,
              deploy_cfg: DeployConfig) -> Descriptor:
    from draftsmith.bench.benchmark import run_benchmark

    if done := _already_done(plan):
        return done
    if deploy_cfg.engine == "embedded":  # a served benchmark's GPUs are its server's
        preflight.check_stage(plan, target_cfg.device)
    with progress_artifact("benchmark"):
        descriptor = run_benchmark(cfg, target_cfg, deployment, merged, target, plan,
                                   deploy_cfg)
    create_markdown_artifact((descriptor.dir / "report.md").read_text(),
                             key="draftsmith-benchmark", description="benchmark report")
    return descriptor
