"""Every stage of the pipeline, described once.

    generate -> merge -> extract -> train -> export -> deploy -> benchmark

Each entry says what a stage is: its config section, what it reads, whether it needs a GPU,
the engine function that runs it, what enters its cache key beyond the section's `keyed`
settings, what it checks before it starts, how its result reads in a summary and in
reports (formatted by the stage's own report module, draftsmith/<package>/report.py), and how
it spreads over several GPU hosts (`Spread`, draftsmith/hosts.py). The run plan
(draftsmith/plan.py), the Prefect flow and tasks (flows/, tasks/), the GPU stage flows and
their deployments, and the CLI all read this table. Adding a stage is one entry here plus the
module that does the work and its report module.

Engine modules are imported when a stage runs, not when this table is read: `draftsmith --help`
and `draftsmith plan` stay fast. The report modules are read with the table, so they import
nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from draftsmith import hosts
from draftsmith.artifacts import Descriptor, StagePlan
from draftsmith.bench import report as benchmark_report
from draftsmith.config import ConfigError, DrafterConfig, PipelineConfig, key_settings, slug
from draftsmith.data import report as merge_report
from draftsmith.diskspace import writing_into
from draftsmith.export import report as export_report
from draftsmith.extract import report as extract_report
from draftsmith.figures import (
    BenchmarkFigures,
    DeployFigures,
    ExportFigures,
    ExtractFigures,
    Figures,
    GenerateFigures,
    MergeFigures,
    TargetFigures,
    TrainFigures,
)
from draftsmith.fingerprints import drafter_fingerprint, file_fingerprint
from draftsmith.generate import report as generate_report
from draftsmith.hosts import HostPart
from draftsmith.reports import Report
from draftsmith.serve import report as deploy_report
from draftsmith.stage_cost import measuring
from draftsmith.train import report as train_report

Inputs = dict[str, Descriptor]  # what a stage reads, by name ("target": the resolved target)
RunStage = Callable[[PipelineConfig, Inputs, StagePlan, "str | None"], Descriptor]

# Inputs that are not stage outputs: the resolved target model, and the data source files
# (content fingerprints; generate's key covers them, so new data re-runs from generate on).
TARGET, DATA = "target", "data"


def artifact_key(config: PipelineConfig, key: str) -> str:
    """A report's artifact key, scoped to its pipeline (`draftsmith-tiny-train`): each
    pipeline's history accumulates under its own keys, and unrelated runs leave it alone."""
    return slug(f"draftsmith-{config.pipeline_name}-{key}")


def _never(_config: PipelineConfig) -> bool:
    return False


def _always(_config: PipelineConfig) -> bool:
    return True


def _no_extras(_config: PipelineConfig) -> dict[str, Any]:
    return {}


def _no_preflight(_config: PipelineConfig, _inputs: Inputs, _plan: StagePlan) -> None:
    return None


def _no_reports(_descriptor: Descriptor) -> list[Report]:
    return []


def _no_secret(_config: PipelineConfig) -> str | None:
    return None


@dataclass(frozen=True)
class Spread:
    """How a GPU stage runs over several GPU hosts (draftsmith/hosts.py), one part per host,
    each in its own flow run on that host: first `prepare` (where the pipeline runs, before
    any part), then `run_part` on every host, then `join` (where the pipeline runs) writes
    the stage's output. `coupled`: the parts are one job (training's nodes), so they start
    and fail together; otherwise each part is a range of the work that finishes on its own,
    and a range that finished is not run again."""

    kind: Literal["node", "range"]
    parts: Callable[[PipelineConfig], int]  # hosts the stage takes with this config
    prepare: Callable[[PipelineConfig, Inputs, StagePlan], None]
    run_part: Callable[[PipelineConfig, Inputs, StagePlan, HostPart], dict[str, Any]]
    join: Callable[[PipelineConfig, Inputs, StagePlan, str], Descriptor]  # run id -> output

    @property
    def coupled(self) -> bool:
        return self.kind == "node"

    def run(self, config: PipelineConfig, inputs: Inputs, plan: StagePlan,
            part: HostPart) -> dict[str, Any]:
        """One host's part; a range that finishes is marked done."""
        with writing_into(plan.dir, f"{plan.stage}'s output in"):
            report = self.run_part(config, inputs, plan, part)
        if not self.coupled:
            hosts.mark_done(plan, part, report)
        return report

    def finish(self, config: PipelineConfig, inputs: Inputs, plan: StagePlan,
               run_id: str) -> Descriptor:
        """The join, then the parts' bookkeeping goes. A join that finds work missing forgets
        which ranges finished: a rerun starts every range, and each redoes only what is
        missing."""
        try:
            descriptor = self.join(config, inputs, plan, run_id)
        except BaseException:
            hosts.forget_parts(plan)
            raise
        hosts.forget_parts(plan)
        return descriptor


@dataclass(frozen=True)
class Stage:
    name: str
    what: str  # one line: what the stage does
    module: str  # where its work is done
    run: RunStage  # (config, inputs, plan, secret) -> descriptor of what it wrote
    inputs: tuple[str, ...]
    section: str | None  # the config section whose `keyed` settings form its key
    figures: type[Figures]
    describe: Callable[[Descriptor], str]  # one cell of the run summary
    gpu: Callable[[PipelineConfig], bool] = _never
    key_extras: Callable[[PipelineConfig], dict[str, Any]] = _no_extras
    preflight: Callable[[PipelineConfig, Inputs, StagePlan], None] = _no_preflight
    reports: Callable[[Descriptor], list[Report]] = _no_reports
    progress: bool = False  # long work: a progress bar / Prefect progress artifact
    retries: int = 2
    # A live output (a running server) is never taken from the cache, and the stage after it
    # runs in the same process, since the server lives there.
    live: Callable[[PipelineConfig], bool] = _never
    # (input stage, retention setting): delete that input's output once this stage finished.
    retention: tuple[str, str] | None = None
    # The name of a Prefect Secret block whose value the stage needs (resolved by the task).
    secret: Callable[[PipelineConfig], str | None] = _no_secret
    aliases: tuple[str, ...] = ()  # other names users know the stage by
    # A result the run must not pass silently (a lossless engine that was not): the message.
    problem: Callable[[Descriptor], str | None] = lambda _d: None
    spread: Spread | None = None  # how it runs over several GPU hosts, when it can
    # Inputs it can do without: a drafter made elsewhere (deploy.drafter) is deployed and
    # benchmarked with no merge or train output of this run.
    optional_inputs: tuple[str, ...] = ()

    def execute(self, config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                secret: str | None = None) -> Descriptor:
        """Run the stage's engine function, measuring what it costs (its manifest keeps it:
        draftsmith/stage_cost.py). A write that finds the disk full and names no file of its
        own (a report, a chart) raises DiskFullError naming the stage's directory; the big
        writers name their file and its size themselves (draftsmith/diskspace.py)."""
        with writing_into(plan.dir, f"{self.name}'s output in"), measuring():
            return self.run(config, inputs, plan, secret)

    def parts(self, config: PipelineConfig) -> int:
        """The GPU hosts this stage takes with this config (1: it runs as one stage)."""
        return self.spread.parts(config) if self.spread is not None else 1

    @property
    def can_use_gpu(self) -> bool:
        """Whether the stage may run on a GPU for some config (it gets a GPU flow)."""
        return self.gpu is not _never

    @property
    def label(self) -> str:
        """The name users type and read (underscores as dashes)."""
        return self.name.replace("_", "-")

    def stage_inputs(self) -> tuple[str, ...]:
        """The stage outputs (and the target) the engine function reads."""
        return tuple(name for name in self.inputs if name != DATA)

    def inputs_from(self, outputs: Inputs) -> Inputs:
        """What it reads of `outputs`: every input it needs (a KeyError names one that is
        missing), and those of its optional inputs that are there."""
        return {name: outputs[name] for name in self.stage_inputs()
                if name in outputs or name not in self.optional_inputs}


# --------------------------------------------------------------------------- generate


def _run_generate(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                  secret: str | None = None) -> Descriptor:
    from draftsmith.generate.stage import run_generate

    return run_generate(config.generate, config.data, config.target, inputs[TARGET], plan,
                        api_key=secret)


def _generate_key(config: PipelineConfig) -> dict[str, Any]:
    # Source content enters through the data input's fingerprints, not through the paths.
    return {"target_dtype": config.target.dtype,
            "sources": [key_settings(s) for s in config.data.sources]}


def _generate_preflight(config: PipelineConfig, _inputs: Inputs, plan: StagePlan) -> None:
    from draftsmith import preflight

    preflight.check_stage(plan, config.target.device, preflight.generate_bytes(
        config.generate, [s.path for s in config.data.sources if s.path]))


def _ranges(config: PipelineConfig) -> int:
    """Extract and generate split into one range per GPU host, in distributed mode."""
    if config.orchestration.mode != "distributed":
        return 1
    return len(config.orchestration.hosts())


def names_this_host(url: str) -> bool:
    """Whether an http(s) URL names the machine it is resolved on: localhost, a loopback or
    an unspecified address (127.0.0.1, ::1, 0.0.0.0). Such a URL means the GPU host only when
    the stage runs there."""
    import ipaddress
    from urllib.parse import urlsplit

    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def generate_pool(config: PipelineConfig) -> tuple[str, str]:
    """Where generate runs in distributed mode ("gpu" or "cpu") and why: where its engine
    is. It starts one (transformers in process, `vllm serve`) or talks to one on the GPU
    host (openai with a loopback base_url, which resolves where the stage runs); an endpoint
    elsewhere is answered from the pipeline's pool. generate.pool overrides it."""
    cfg = config.generate
    if cfg.pool != "auto":
        return cfg.pool, f"generate.pool={cfg.pool}"
    if cfg.backend == "transformers":
        return "gpu", "backend transformers: the target answers in process"
    if cfg.backend == "vllm":
        return "gpu", "backend vllm: the stage starts `vllm serve` of the target"
    url = cfg.endpoint.base_url if cfg.endpoint is not None else None
    if url is not None and names_this_host(url):
        return "gpu", (f"backend openai at {url}: a loopback URL, the server on the GPU host "
                       "(generate.pool=cpu if it is elsewhere)")
    where = url or "an endpoint from orchestration.endpoint_block"
    return "cpu", (f"backend openai at {where}: a server elsewhere (generate.pool=gpu if it "
                   "runs on the GPU host)")


def _generate_on_gpu(config: PipelineConfig) -> bool:
    return generate_pool(config)[0] == "gpu"


def _generate_ranges(config: PipelineConfig) -> int:
    # Only the in-process backend answers on the GPU hosts; prompts the target writes itself
    # are written on one host, in one journal.
    if config.generate.backend != "transformers" or any(
            s.synthesize is not None for s in config.data.sources):
        return 1
    return _ranges(config)


def _generate_range(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                    part: HostPart) -> dict[str, Any]:
    from draftsmith.generate.stage import run_generate_range

    return run_generate_range(config.generate, config.data, config.target, inputs[TARGET], plan,
                              part)


def _generate_join(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                   run_id: str) -> Descriptor:
    from draftsmith.generate.stage import run_generate

    return run_generate(config.generate, config.data, config.target, inputs[TARGET], plan,
                        joined_run=run_id)


def _nothing_to_prepare(_config: PipelineConfig, _inputs: Inputs, _plan: StagePlan) -> None:
    return None


def _endpoint_secret(config: PipelineConfig) -> str | None:
    endpoint = config.generate.endpoint
    return endpoint.api_key_secret if endpoint is not None else None


# --------------------------------------------------------------------------- merge


def _run_merge(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
               _secret: str | None = None) -> Descriptor:
    from draftsmith.data.merge import run_merge
    from draftsmith.data.overlap import benchmark_prompt_set

    benchmark = benchmark_prompt_set(config.benchmark.prompts_builtin,
                                     config.benchmark.prompts_file)
    eval_sets = None
    if config.benchmark.suite:
        from draftsmith.data.evalsets import suite_sets

        eval_sets = suite_sets(config.benchmark.suite)
    return run_merge(config.merge, inputs["generate"], inputs[TARGET], plan, benchmark,
                     eval_sets)


def _merge_key(config: PipelineConfig) -> dict[str, Any]:
    # The overlap proof is against the benchmark's own prompts: their content is in the key.
    from draftsmith.data.overlap import benchmark_fingerprint

    material: dict[str, Any] = {}
    held_out = benchmark_fingerprint(config.benchmark.prompts_builtin,
                                     config.benchmark.prompts_file)
    if held_out:
        material["benchmark_prompts"] = held_out
    if config.benchmark.suite:  # decontaminated against these sets' content
        from draftsmith.data.evalsets import suite_fingerprints

        material["eval_sets"] = suite_fingerprints(config.benchmark.suite)
    return material


# --------------------------------------------------------------------------- extract


def _online(config: PipelineConfig) -> bool:
    return config.train.mode == "online"


def _run_extract(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                 _secret: str | None = None) -> Descriptor:
    from draftsmith.extract.stage import record_online_capture, run_extract

    if _online(config):  # skipped: the trainer runs the target itself
        return record_online_capture(config.extract, inputs["merge"], inputs[TARGET], plan)
    return run_extract(config.extract, config.target, inputs["merge"], inputs[TARGET], plan)


def _extract_key(config: PipelineConfig) -> dict[str, Any]:
    # Online, the output is the capture settings, not a store: another key (and the train key,
    # which reads this output, follows it).
    return {**_target_dtype(config), **({"train_mode": "online"} if _online(config) else {})}


def _extract_preflight(config: PipelineConfig, inputs: Inputs, plan: StagePlan) -> None:
    """On the machine that writes the store (a GPU worker in distributed mode), before any
    GPU is taken or shard written; with either mode, the train.mode suggestion."""
    from draftsmith import preflight
    from draftsmith.extract.preflight import check_extract_disk, suggest_train_mode
    from draftsmith.extract.stage import aux_layer_ids_for

    aux_ids = aux_layer_ids_for(config.extract, inputs[TARGET])
    suggest_train_mode(config.extract, config.train, inputs["merge"], inputs[TARGET], plan.dir,
                       aux_ids)
    if _online(config):
        return
    preflight.check_stage(plan, config.target.device)
    check_extract_disk(config.extract, inputs["merge"], inputs[TARGET], plan.dir, aux_ids)


def _extract_ranges(config: PipelineConfig) -> int:
    # The server backends run one capture server per stage: they stay on one host.
    if _online(config) or config.extract.backend != "transformers":
        return 1
    return _ranges(config)


def _extract_prepare(_config: PipelineConfig, _inputs: Inputs, plan: StagePlan) -> None:
    from draftsmith.extract.stage import prepare_output

    prepare_output(plan)  # no range runs yet: every partial file is a crashed attempt's


def _extract_range(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                   part: HostPart) -> dict[str, Any]:
    from draftsmith.extract.stage import run_extract_range

    return run_extract_range(config.extract, config.target, inputs["merge"], inputs[TARGET],
                             plan, part)


def _extract_join(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                  _run_id: str) -> Descriptor:
    from draftsmith.extract.stage import join_extract

    return join_extract(config.extract, inputs["merge"], inputs[TARGET], plan)


# --------------------------------------------------------------------------- train


def _run_train(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
               _secret: str | None = None) -> Descriptor:
    from draftsmith.train.trainer import OnlineInputs, run_train

    online = OnlineInputs(config.extract, config.target) if _online(config) else None
    return run_train(config.train, inputs["extract"], inputs["merge"], inputs[TARGET], plan,
                     online, config.drafter)


def _train_key(config: PipelineConfig) -> dict[str, Any]:
    # The drafter kind and its options decide what is trained; the stages after train
    # follow through the trained checkpoint's fingerprint. Only settings off their default
    # enter, so a plain EAGLE-3 run keeps the key it had before the kinds existed.
    material: dict[str, Any] = {}
    default = key_settings(DrafterConfig())
    changed = {k: v for k, v in key_settings(config.drafter).items() if v != default.get(k)}
    if changed:
        material["drafter"] = changed
    if config.train.nnodes > 1:  # more ranks: other rows per step (one host's keys unchanged)
        material["nnodes"] = config.train.nnodes
    if config.train.init_from:  # its content, not its path
        material["init_from_files"] = drafter_fingerprint(config.train.init_from)
    return material


def _train_nodes(config: PipelineConfig) -> int:
    return config.train.nnodes


def _train_prepare(_config: PipelineConfig, _inputs: Inputs, plan: StagePlan) -> None:
    from draftsmith.train.nodes import prepare_nodes

    prepare_nodes(plan)


def _train_node(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                part: HostPart) -> dict[str, Any]:
    from draftsmith.train.nodes import run_node
    from draftsmith.train.trainer import OnlineInputs

    online = OnlineInputs(config.extract, config.target) if _online(config) else None
    return run_node(config.train, inputs["extract"], inputs["merge"], inputs[TARGET], plan,
                    part, online, config.drafter)


def _train_join(config: PipelineConfig, _inputs: Inputs, plan: StagePlan,
                _run_id: str) -> Descriptor:
    from draftsmith.train.nodes import join_nodes

    return join_nodes(config.train, plan, config.drafter)


def _train_preflight(config: PipelineConfig, inputs: Inputs, plan: StagePlan) -> None:
    from draftsmith import preflight

    preflight.check_stage(plan, config.train.device, preflight.train_bytes(
        inputs[TARGET], MergeFigures.of(inputs["merge"]).draft_vocab_size))


# --------------------------------------------------------------------------- export


def _run_export(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                _secret: str | None = None) -> Descriptor:
    from draftsmith.export.stage import run_export

    return run_export(config.export, config.target, inputs["train"], inputs[TARGET], plan)


def _export_key(config: PipelineConfig) -> dict[str, Any]:
    return {"context_length": config.target.context_length,
            "target_family": config.target.family}


# --------------------------------------------------------------------------- deploy


def _run_deploy(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                _secret: str | None = None) -> Descriptor:
    from draftsmith.serve.deploy import run_deploy

    merged = inputs.get("merge")  # none for a drafter made elsewhere (deploy.drafter)
    smoke = None
    if merged is None and config.deploy.engine == "embedded":
        from draftsmith.bench.benchmark import first_conversation

        smoke = first_conversation(config.benchmark)
    return run_deploy(config.deploy, config.target, inputs["export"], merged, inputs[TARGET],
                      plan, smoke)


def _target_dtype(config: PipelineConfig) -> dict[str, Any]:
    return {"target_dtype": config.target.dtype}


def _served(config: PipelineConfig) -> bool:
    return config.deploy.engine != "embedded"


def _embedded_preflight(config: PipelineConfig, _inputs: Inputs, plan: StagePlan) -> None:
    """A served deploy checks its GPUs itself, minding its own server; a served benchmark's
    GPUs are its server's."""
    if not _served(config):
        from draftsmith import preflight

        preflight.check_stage(plan, config.target.device)


# --------------------------------------------------------------------------- benchmark


def _run_benchmark(config: PipelineConfig, inputs: Inputs, plan: StagePlan,
                   _secret: str | None = None) -> Descriptor:
    from draftsmith.bench.benchmark import run_benchmark

    # The trained drafter's validation full_acc sits next to a served engine's acceptance.
    return run_benchmark(config.benchmark, config.target, inputs["deploy"], inputs.get("merge"),
                         inputs[TARGET], plan, config.deploy, trained=inputs.get("train"))


def _benchmark_key(config: PipelineConfig) -> dict[str, Any]:
    material = _target_dtype(config)
    if config.benchmark.prompts_file:  # its content, not where it lies
        material["prompts"] = file_fingerprint("benchmark.prompts_file",
                                               config.benchmark.prompts_file)
    if config.benchmark.prompts_builtin:  # the package's file, by content
        from draftsmith.data.packaged import builtin_fingerprint

        material["prompts"] = builtin_fingerprint(config.benchmark.prompts_builtin)
    if config.benchmark.suite:  # the sets' prompts and parts, by content
        from draftsmith.data.evalsets import suite_fingerprints

        material["eval_sets"] = suite_fingerprints(config.benchmark.suite)
    return material


# --------------------------------------------------------------------------- the table


STAGES: list[Stage] = [
    Stage("generate", "reads every data source and answers prompt-only records with the target",
          "draftsmith/generate/stage.py", _run_generate, inputs=(TARGET, DATA),
          section="generate", figures=GenerateFigures, describe=generate_report.describe,
          gpu=_generate_on_gpu, key_extras=_generate_key,
          preflight=_generate_preflight, reports=generate_report.reports, progress=True,
          secret=_endpoint_secret,
          spread=Spread("range", _generate_ranges, _nothing_to_prepare, _generate_range,
                        _generate_join)),
    Stage("merge", "dedups, splits, tokenises with loss masks and builds the draft vocab",
          "draftsmith/data/merge.py", _run_merge, inputs=("generate", TARGET),
          section="merge", figures=MergeFigures, describe=merge_report.describe,
          key_extras=_merge_key, reports=merge_report.reports,
          retention=("generate", "delete_generations_after_merge")),
    Stage("extract", "captures the target's aux and final hidden states into shards",
          "draftsmith/extract/stage.py", _run_extract, inputs=("merge", TARGET),
          section="extract", figures=ExtractFigures, describe=extract_report.describe,
          gpu=lambda c: not _online(c), key_extras=_extract_key, preflight=_extract_preflight,
          progress=True,
          spread=Spread("range", _extract_ranges, _extract_prepare, _extract_range,
                        _extract_join)),
    Stage("train", "trains the drafter of drafter.kind (EAGLE-3 with test-time training, "
          "DFlash on anchored blocks)",
          "draftsmith/train/trainer.py", _run_train, inputs=("extract", "merge", TARGET),
          section="train", figures=TrainFigures, describe=train_report.describe, gpu=_always,
          key_extras=_train_key, preflight=_train_preflight, reports=train_report.reports,
          progress=True, retries=1,
          retention=("extract", "delete_hidden_states_after_train"),
          spread=Spread("node", _train_nodes, _train_prepare, _train_node, _train_join)),
    Stage("export", "writes the drafter in the serving engine's layout and validates it",
          "draftsmith/export/stage.py", _run_export, inputs=("train", TARGET),
          section="export", figures=ExportFigures, describe=export_report.describe,
          key_extras=_export_key, aliases=("fix_keys", "fix-keys")),
    Stage("deploy", "serves the target with the exported drafter and proves it generates",
          "draftsmith/serve/deploy.py", _run_deploy, inputs=("export", "merge", TARGET),
          section="deploy", figures=DeployFigures, describe=deploy_report.describe, gpu=_always,
          key_extras=_target_dtype, preflight=_embedded_preflight, live=_served,
          optional_inputs=("merge",)),
    Stage("benchmark", "measures acceptance and tokens/s with and without speculation",
          "draftsmith/bench/benchmark.py", _run_benchmark,
          inputs=("deploy", "merge", TARGET, "train"),
          section="benchmark", figures=BenchmarkFigures, describe=benchmark_report.describe,
          gpu=_always, key_extras=_benchmark_key, preflight=_embedded_preflight,
          reports=benchmark_report.reports, progress=True, problem=benchmark_report.problem,
          optional_inputs=("merge", "train")),
]


def names() -> list[str]:
    return [s.name for s in STAGES]


def get(name: str) -> Stage:
    """A stage by its name or one of its aliases (fix-keys, fix_keys for export)."""
    wanted = name.replace("-", "_")
    for stage in STAGES:
        if wanted in (stage.name, *(a.replace("-", "_") for a in stage.aliases)):
            return stage
    raise ConfigError(f"unknown stage {name!r}; choose from {', '.join(names())}")


def target_figures(target: Descriptor) -> TargetFigures:
    return TargetFigures.of(target)
