"""The `draftsmith` command.

The CLI sits on top of every layer. It is the one module under draftsmith/ that may import
the orchestration layer, and only inside the commands that need it: `run` and `demo` execute
the Prefect flow, `prefect ...` reaches deployments/ (so `draftsmith --help`, `validate`, `plan`
and the drafter commands stay fast and Prefect-free; tests/test_import_boundaries.py checks
both).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from draftsmith.config import EXAMPLES_DIR, ConfigError, PipelineConfig, load_config
from draftsmith.plan import select_stages

app = typer.Typer(
    help="Train speculative-decoding drafters (EAGLE-3, EAGLE-3.1, DFlash) for a target LLM "
    "and ship them to vLLM or SGLang.\n\n"
    "Stages: generate -> merge -> extract -> train -> export (fix-keys) -> deploy -> benchmark.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)


def say(style: str, message: object) -> None:
    """Print `message` to stderr in `style`, as written: errors quote values such as
    [chat, code, math], which rich markup would take for tags and drop."""
    console.print(Text(str(message), style=style))


EXAMPLES = EXAMPLES_DIR
SetOption = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a config value, e.g. --set train.epochs=2 (repeatable).")]


def _prepare_environment() -> None:
    # No analytics calls from a machine that may have no network; engine logs in Prefect's log;
    # no download bars from transformers (set here, not imported here: a cached run never
    # needs transformers).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftsmith")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _load(config_path: Path, overrides: list[str] | None) -> PipelineConfig:
    try:
        return load_config(config_path, overrides or [])
    except ConfigError as err:
        say("red", err)
        raise typer.Exit(2) from None


def _local_api() -> None:
    """A Prefect API for a flow run in this process: the temporary server, which boots on the
    other core while Prefect and the flow import (it dies with this process, even under kill
    -9), or Prefect's own."""
    _prepare_environment()
    from flows.local import start_prefects_own, start_temporary_api

    api = start_temporary_api()
    import flows.compare  # noqa: F401 - imports Prefect and the flows while the server boots

    if api is not None:
        api.wait_ready()
    else:
        start_prefects_own()


def _run_flow(config: PipelineConfig, selected: list[str]) -> dict[str, dict]:
    _local_api()
    from draftsmith.errors import InputError
    from flows.pipeline import pipeline

    try:
        return pipeline(full_config=config.model_dump(mode="json"), stages=selected)
    except InputError as err:  # the run log above has the traceback; the fix is in the text
        say("red", err)
        raise typer.Exit(2) from None


def _summary(results: dict[str, dict]) -> tuple[Table, list[str]]:
    """The run's summary table (each stage's state and result, as the stage table describes
    it; draftsmith/summary.py) and the problems that must fail the command."""
    from draftsmith.summary import stage_rows

    table = Table(title="draftsmith run", show_header=True)
    table.add_column("stage")
    table.add_column("state")
    table.add_column("result", overflow="fold")
    table.add_column("cost", overflow="fold")
    rows, problems = stage_rows(results)
    for row in rows:
        table.add_row(row.stage, row.state, Text(row.result), row.cost)  # error text as written
    return table, problems


def _finish(results: dict[str, dict]) -> None:
    table, problems = _summary(results)
    Console().print(table)
    for problem in problems:
        say("red", problem)
    if problems:
        raise typer.Exit(1)


@app.command()
def demo(
    run_root: Annotated[Path, typer.Option(help="Where the demo writes its stages.")] = Path(
        "runs/demo"),
    set_: SetOption = None,
) -> None:
    """Run the whole pipeline on the tiny CPU target and print a summary.

    The target is built locally on first use and cached; a second run finds every stage cached.
    """
    overrides = [f"run_root={run_root.resolve()}", "name=demo", *(set_ or [])]
    config = _load(EXAMPLES / "tiny.yaml", overrides)
    _finish(_run_flow(config, []))


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Pipeline YAML, e.g. examples/tiny.yaml.")],
    only: Annotated[str | None, typer.Option(help="Run this one stage.")] = None,
    from_: Annotated[str | None, typer.Option("--from", help="Start at this stage.")] = None,
    to: Annotated[str | None, typer.Option(help="Stop after this stage.")] = None,
    set_: SetOption = None,
) -> None:
    """Run the pipeline, or part of it, from a config file.

    Stages before the selection must already be complete for this config; their outputs are
    read from disk.
    """
    pipeline_config = _load(config, set_)
    selected = _select(only, from_, to)
    _finish(_run_flow(pipeline_config, selected))


@app.command()
def compare(
    config: Annotated[Path, typer.Argument(help="The base pipeline YAML.")],
    variant: Annotated[list[str], typer.Option(
        "--variant", help="A variant: 'NAME: key=value key=value' over the base config "
        "(repeatable), e.g. --variant 'e2: train.epochs=2'; a NAME alone runs the base.")],
    to: Annotated[str | None, typer.Option(help=(
        "Stop each variant after this stage, e.g. --to train to compare training alone "
        "(its seconds, GPU peak and disk) without deploying."))] = None,
    set_: SetOption = None,
) -> None:
    """Run several variants of one config, one after the other on its run root, and print one
    table of their figures (also a Prefect table artifact and <run_root>/compare/NAME.json).

    Stages a variant leaves unchanged are Cached from an earlier one. Decide on the evaluation
    suite's dev parts (--set benchmark.splits=[dev]); report the chosen variant's test parts.
    """
    from draftsmith.compare import check_variants, parse_variant, shown_columns

    pipeline_config = _load(config, set_)
    selected = _select(None, None, to)
    try:
        variants = [parse_variant(v) for v in variant]
        check_variants(variants)
    except ConfigError as err:
        say("red", err)
        raise typer.Exit(2) from None
    _local_api()
    from flows.compare import VariantForm
    from flows.compare import compare as compare_flow

    rows = compare_flow(full_config=pipeline_config.model_dump(mode="json"), variants=[
        VariantForm(name=v.name, overrides=list(v.overrides)) for v in variants],
        stages=selected)
    table = Table(title=f"draftsmith compare: {pipeline_config.pipeline_name}", show_header=True)
    columns = shown_columns(rows)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(Text("-" if row.get(c) is None else str(row[c])) for c in columns))
    Console().print(table)


def _select(only: str | None, from_: str | None, to: str | None) -> list[str]:
    """The stages picked; none picked is [], every stage the config runs (deploy and
    benchmark only, for a drafter made elsewhere), not a list of all seven."""
    if not (only or from_ or to):
        return []
    try:
        return select_stages(only, from_, to)
    except ConfigError as err:
        say("red", err)
        raise typer.Exit(2) from None


@app.command("plan")
def plan_command(
    config: Annotated[Path, typer.Argument(help="Pipeline YAML, e.g. examples/tiny.yaml.")],
    only: Annotated[str | None, typer.Option(help="Plan this one stage.")] = None,
    from_: Annotated[str | None, typer.Option("--from", help="Start at this stage.")] = None,
    to: Annotated[str | None, typer.Option(help="Stop after this stage.")] = None,
    set_: SetOption = None,
) -> None:
    """Print what `draftsmith run` would do now: each stage, its cache key, and whether it is
    cached or runs, and why. Runs nothing (the target is resolved, and the data files hashed)."""
    from draftsmith.plan import RunPlan
    from draftsmith.target import resolve_target

    pipeline_config = _load(config, set_)
    selected = _select(only, from_, to)
    for warning in pipeline_config.warnings():
        say("yellow", f"warning: {warning}")
    try:
        target = resolve_target(pipeline_config.target)
        rows = RunPlan(pipeline_config, target, selected).preview()
    except (ConfigError, FileNotFoundError) as err:
        say("red", err)
        raise typer.Exit(2) from None
    table = Table(title=f"draftsmith plan: {config}", show_header=True)
    for column in ("stage", "key", "status", "why"):
        table.add_column(column, overflow="fold")
    colours = {"cached": "green", "reused": "green", "pruned": "cyan", "to run": "yellow",
               "missing": "red"}
    for row in rows:
        colour = colours.get(row.status, "white")
        table.add_row(row.stage, row.key or "-", f"[{colour}]{row.status}[/{colour}]",
                      Text(row.reason))
    Console(width=160).print(table)


@app.command()
def validate(
    config: Annotated[Path, typer.Argument(help="Pipeline YAML to check.")],
    deep: Annotated[bool, typer.Option(
        "--deep", help="Also load the target's config and tokenizer.")] = False,
    set_: SetOption = None,
) -> None:
    """Check a config and what a run would fail on, without running anything heavy: keys and
    values, data files, aux layer ids against the target, drafting settings, ports."""
    from draftsmith.checks import check_config, format_findings

    pipeline_config = _load(config, set_)
    findings = check_config(pipeline_config, deep=deep)  # config.warnings() among them
    print("\n".join(format_findings(findings)))
    if any(f.level == "error" for f in findings):
        say("red", f"{config}: {sum(f.level == 'error' for f in findings)} problem(s) a run "
                   "would fail on")
        raise typer.Exit(1)
    console.print(f"[green]{config}: valid[/green] (run_root {pipeline_config.run_root}, "
                  f"{len(pipeline_config.data.sources)} data sources)")


@app.command()
def deploy(
    config: Annotated[Path, typer.Argument(
        help="Pipeline YAML with deploy.engine: sglang or vllm.")],
    drafter: Annotated[Path | None, typer.Option(
        help="Drafter directory (SGLang layout for SGLang, speculators for vLLM); default: "
        "deploy.drafter, else this config's export output.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the exact command and environment; start nothing.")] = False,
    set_: SetOption = None,
) -> None:
    """Serve the target with the drafter on SGLang (EAGLE3) or vLLM (eagle3) until Ctrl-C.

    Checks every speculative setting before launch, refuses busy GPUs, and waits for real
    readiness: port, /health, /server_info settings and one generation.
    """

    from draftsmith.figures import ExportFigures, TargetFigures
    from draftsmith.plan import finished_outputs
    from draftsmith.serve.engine_adapter import LaunchError
    from draftsmith.serve.gpus import GpusBusyError, require_free_gpus
    from draftsmith.serve.holders import PortBusyError, require_free_port
    from draftsmith.serve.process import ManagedProcess
    from draftsmith.serve.readiness import ReadinessError, ServerInstallError
    from draftsmith.serve.sglang_launch import build_launch, wait_until_ready
    from draftsmith.target import resolve_target

    pipeline_config = _load(config, set_)
    family, model_path = pipeline_config.target.family, None
    if drafter is None and pipeline_config.deploy.drafter:
        drafter = Path(pipeline_config.deploy.drafter)
    if drafter is None:
        target = _export_errors(lambda: resolve_target(pipeline_config.target))
        outputs = _export_errors(lambda: finished_outputs(pipeline_config, target, "export"))
        drafter = Path(ExportFigures.of(outputs["export"]).drafter_dir)
        family, model_path = TargetFigures.of(target).family, target.path
    family = "llama" if family == "auto" else family
    if pipeline_config.deploy.engine == "vllm":
        _deploy_vllm(pipeline_config, drafter, family, model_path, dry_run)
        return
    try:
        launch = build_launch(pipeline_config.deploy, pipeline_config.target, drafter, family,
                              model_path)
    except (LaunchError, ValueError) as err:
        say("red", err)
        raise typer.Exit(2) from None
    if dry_run:
        _print_launch(launch)
        return
    try:
        require_free_port("deploy", pipeline_config.deploy.host, pipeline_config.deploy.port)
        require_free_gpus(None)
        log_file = Path(pipeline_config.run_root) / "sglang-server.log"
        with ManagedProcess(launch.argv, log_file, launch.env, name="sglang") as process:
            wait_until_ready(launch.url, pipeline_config.deploy, str(drafter), process)
            _serve_until_exit(process, launch.url, log_file)
    except (GpusBusyError, PortBusyError, ReadinessError, ServerInstallError) as err:
        say("red", err)
        raise typer.Exit(1) from None


def _print_launch(launch) -> None:
    """`draftsmith deploy --dry-run`: the command line, and what it is made of."""
    import json

    print(launch.shell())
    print(json.dumps({"argv": launch.argv, "env": launch.env, "url": launch.url}, indent=2))


def _serve_until_exit(process, url: str, log_file: Path) -> None:
    """Wait on a ready server until Ctrl-C; a server that exits on its own is a failure."""
    import time

    console.print(f"[green]serving at {url}[/green] (log: {log_file}); Ctrl-C stops the server")
    while process.exit_code() is None:
        time.sleep(1)
    console.print(f"[red]the server exited with code {process.exit_code()}[/red]")
    raise typer.Exit(1)


def _deploy_vllm(pipeline_config, drafter: Path, family: str, model_path: str | None,
                 dry_run: bool) -> None:
    """`draftsmith deploy` for deploy.engine=vllm: the same checks, `vllm serve` until Ctrl-C."""

    from draftsmith.serve.engine_adapter import LaunchError
    from draftsmith.serve.holders import PortBusyError, require_free_port
    from draftsmith.serve.readiness import ReadinessError, ServerInstallError
    from draftsmith.serve.vllm_launch import build_launch, start_vllm

    try:
        launch = build_launch(pipeline_config.deploy, pipeline_config.target, drafter, family,
                              model_path)
    except (LaunchError, ValueError) as err:
        say("red", err)
        raise typer.Exit(2) from None
    if dry_run:
        _print_launch(launch)
        return
    log_file = Path(pipeline_config.run_root) / "vllm-server.log"
    try:
        require_free_port("deploy", pipeline_config.deploy.host, pipeline_config.deploy.port)
        process, _ = start_vllm(launch, log_file, "vllm",
                                pipeline_config.deploy.startup_timeout_s)
    except (LaunchError, ReadinessError, ServerInstallError, PortBusyError) as err:
        say("red", err)
        raise typer.Exit(1) from None
    try:
        _serve_until_exit(process, launch.url, log_file)
    finally:
        process.stop()


FamilyOption = Annotated[str, typer.Option(
    help="Target family, for the engine's layer-id rule: llama, qwen, deepseek, gpt-oss.")]


def _export_errors(action):
    from draftsmith.errors import InputError

    try:
        return action()
    except (InputError, FileNotFoundError) as err:
        say("red", err)
        raise typer.Exit(2) from None


@app.command("export")
def export_command(
    checkpoint: Annotated[Path, typer.Argument(help="A drafter directory in any layout.")],
    to: Annotated[str, typer.Option(help="sglang or speculators (vLLM).")],
    out: Annotated[Path, typer.Option(help="Directory to write.")],
    family: FamilyOption = "llama",
    context_length: Annotated[int | None, typer.Option(
        help="The target's context; max_position_embeddings is raised to it.")] = None,
) -> None:
    """Export a drafter to the SGLang or speculators/vLLM layout and validate the files."""
    from draftsmith.export.convert import export_drafter, read_drafter

    def action():
        checkpoint_ = read_drafter(checkpoint, family)
        return export_drafter(checkpoint_.tensors, checkpoint_.config, to, family, out,
                              context_length=context_length)

    config = _export_errors(action)
    console.print(f"[green]{out}: {to} drafter written and validated[/green] "
                  f"({config['architectures'][0]})")


@app.command("import")
def import_command(
    source: Annotated[Path, typer.Argument(help="A drafter trained elsewhere (EAGLE-3 or -3.1 in "
                                                 "the SGLang, EAGLE, SpecForge or speculators "
                                                 "layout; DFlash in the speculators layout).")],
    out: Annotated[Path, typer.Option(help="Where to write the native checkpoint.")],
    family: FamilyOption = "llama",
    num_layers: Annotated[int | None, typer.Option(
        help="Target layers (only SGLang's GPT-OSS rule needs it).")] = None,
) -> None:
    """Convert a drafter from any layout to draftsmith's native checkpoint, validated."""
    from draftsmith.export.convert import import_drafter

    report = _export_errors(lambda: import_drafter(source, out, family, num_layers))
    console.print(f"[green]{source}: {report.layout} layout, {report.tensors} tensors, "
                  f"aux layers {report.config.aux_layer_ids} (outputs) -> native at {out}"
                  "[/green]")
    if report.dropped:
        console.print(f"not kept (the target's own): {report.dropped}")


@app.command()
def inspect(
    directory: Annotated[Path, typer.Argument(help="A drafter directory in any layout.")],
    family: FamilyOption = "llama",
    num_layers: Annotated[int | None, typer.Option(help="Target layers (GPT-OSS rule).")] = None,
) -> None:
    """Show a drafter's layout, shapes, vocab sizes, layer ids and validation verdict."""
    from draftsmith.export.convert import describe
    from draftsmith.model.kinds import kind_named

    info = describe(directory, family, num_layers)
    out = Console()
    out.print(f"[bold]{info['path']}[/bold]: layout {info.get('layout', 'unknown')}")
    if not info["valid"]:
        out.print(f"[red]INVALID[/red]\n{info['problems']}")
        raise typer.Exit(1)
    out.print(f"kind: {info['kind']}")
    kind_keys = ("block_size", "mask_token_id", "causal", "num_hidden_layers") \
        if kind_named(info["kind"]).drafting == "block" else ("norms", "sliding_window")
    for key in ("dtype", "vocab_size", "draft_vocab_size", "hidden_size", "target_hidden_size",
                "max_position_embeddings", *kind_keys):
        out.print(f"{key}: {info[key]}")
    out.print(f"aux layers (canonical, outputs of): {info['canonical_aux_layer_ids']}")
    if "sglang_aux_layer_ids" in info:
        out.print(f"  as SGLang reads them for a {family} target: "
                  f"{info['sglang_aux_layer_ids']}")
    out.print(f"  as vLLM/speculators read them: {info['speculators_aux_layer_ids']}")
    table = Table("tensor", "shape")
    for name, shape in info["shapes"].items():
        table.add_row(name, str(shape))
    out.print(table)
    out.print("[green]valid[/green]")


prefect_app = typer.Typer(help="Run draftsmith on a Prefect server: work pools, deployments, "
                          "blocks, triggers.", no_args_is_help=True)
app.add_typer(prefect_app, name="prefect")


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            say("red", f"{flag} {item!r}: expected KEY=VALUE, e.g. "
                       f"{flag} NCCL_SOCKET_IFNAME=eth0")
            raise typer.Exit(2)
        out[key] = value
    return out


def _hosts(items: list[str] | None) -> dict[str, str | None]:
    """--host NAME or NAME=ADDRESS, in order."""
    out: dict[str, str | None] = {}
    for item in items or []:
        name, _, address = item.partition("=")
        if not name or name in out:
            say("red", f"--host {item!r}: expected NAME or NAME=ADDRESS, each name once, "
                       "e.g. --host gpu-a=10.0.0.1 --host gpu-b=10.0.0.2")
            raise typer.Exit(2)
        out[name] = address or None
    return out


@prefect_app.command("setup")
def prefect_setup(
    config: Annotated[Path, typer.Argument(
        help="Pipeline YAML: the deployment's default parameters (the UI form).",
        show_default="examples/tiny.yaml")] = EXAMPLES / "tiny.yaml",
    gpus: Annotated[int, typer.Option(help="GPUs on the GPU host (concurrency slots).")] = 1,
    visible_devices: Annotated[str | None, typer.Option(
        help="CUDA_VISIBLE_DEVICES of GPU stages; default 0..gpus-1.")] = None,
    nccl: Annotated[list[str] | None, typer.Option(
        help="NCCL environment of GPU stages, KEY=VALUE (repeatable).")] = None,
    scratch: Annotated[str, typer.Option(help="Fast local disk on the GPU host.")] = "/tmp",
    shared: Annotated[str | None, typer.Option(
        help="Storage both pools see (run_root lives under it); default run_root's parent."
    )] = None,
    gpu_host: Annotated[str, typer.Option(help="Name of the GPU host block.")] = "gpu-host",
    host: Annotated[list[str] | None, typer.Option(
        help="Several GPU hosts: NAME or NAME=ADDRESS, one per host, first host first "
             "(repeatable). Each gets a GPU host block, a work queue of the gpu pool and its "
             "own GPU deployments; ADDRESS is how the other hosts reach it (torchrun "
             "--local-addr).")
    ] = None,
    cron: Annotated[str | None, typer.Option(
        help="Cron schedule of the pipeline, e.g. '0 3 * * *' (paused unless --cron-active).")
    ] = None,
    cron_active: Annotated[bool, typer.Option(help="Start the schedule active.")] = False,
    endpoint_url: Annotated[str | None, typer.Option(
        help="OpenAI-compatible endpoint for generate: saved as an inference endpoint block."
    )] = None,
    endpoint_model: Annotated[str | None, typer.Option(help="Model name at the endpoint.")] = None,
    api_key_env: Annotated[str | None, typer.Option(
        help="Environment variable holding the endpoint's API key (saved as a Secret block)."
    )] = None,
    rerun_on_new_data: Annotated[bool, typer.Option(
        help="A trigger that re-runs the pipeline on draftsmith.dataset.updated events.")
    ] = True,
    zombie_after_s: Annotated[int, typer.Option(
        help="Mark a flow run Crashed after this many seconds without a heartbeat (an "
             "automation); 0: no automation.")] = 600,
    watch_data: Annotated[int | None, typer.Option(
        help="Watch the data: every this many seconds, look at each data source's file and "
             "start a pipeline run for each whose content changed (the deployment "
             "draftsmith-watch-data/cpu, schedule active).", min=1)] = None,
    set_: SetOption = None,
) -> None:
    """Create the cpu and gpu work pools, blocks, the GPU concurrency limit and the
    deployments (pipeline on cpu, GPU stages on gpu) on the configured Prefect API."""
    _prepare_environment()
    from deployments.setup import SetupOptions, setup

    pipeline_config = _load(config, set_)
    hosts = _hosts(host)
    options = SetupOptions(gpu_host=gpu_host, hosts=list(hosts),
                           addresses={name: address for name, address in hosts.items() if address},
                           gpu_count=gpus,
                           visible_devices=visible_devices,
                           nccl_env=_pairs(nccl, "--nccl"), scratch_path=scratch,
                           shared_path=shared, cron=cron, cron_active=cron_active,
                           endpoint_url=endpoint_url, endpoint_model=endpoint_model,
                           api_key_env=api_key_env, rerun_on_new_data=rerun_on_new_data,
                           zombie_after_s=zombie_after_s or None, watch_every_s=watch_data)
    try:
        ids = setup(pipeline_config, options, config_path=config, overrides=list(set_ or []))
    except ValueError as err:
        say("red", err)
        raise typer.Exit(2) from None
    for name, deployment_id in ids.items():
        print(f"{name}\t{deployment_id}")
    if cron and not cron_active:
        console.print(f"the cron schedule ({cron}) is paused: start it in the UI (the "
                      "deployment's Schedules toggle) or with `prefect deployment schedule ls "
                      "draftsmith-pipeline/cpu` and `prefect deployment schedule resume "
                      "draftsmith-pipeline/cpu SCHEDULE_ID` (or run setup with --cron-active)")
    if host:
        console.print("[green]ready[/green]: start `prefect worker start --pool cpu` anywhere "
                      "and, on each GPU host, `prefect worker start --pool gpu --work-queue "
                      "HOST` with its block's name (" + ", ".join(hosts) + ")")
        return
    console.print("[green]ready[/green]: start `prefect worker start --pool cpu` anywhere and "
                  "`prefect worker start --pool gpu` on the GPU host")


@prefect_app.command("notify-new-data")
def prefect_notify_new_data(
    path: Annotated[Path, typer.Argument(help="The dataset file with new content.")],
    source: Annotated[str | None, typer.Option(
        help="data.sources name it replaces (a new name adds a source); default: file stem.")
    ] = None,
) -> None:
    """Emit draftsmith.dataset.updated: the pipeline deployment's trigger re-runs it with
    this file as the named source, which every later run of the pipeline reads too (kept in
    the Prefect variable draftsmith-<pipeline>-data)."""
    _prepare_environment()
    from deployments.setup import notify_new_data

    try:
        event_id = notify_new_data(path, source)
    except FileNotFoundError as err:
        say("red", err)
        raise typer.Exit(2) from None
    print(event_id)


if __name__ == "__main__":
    app()
