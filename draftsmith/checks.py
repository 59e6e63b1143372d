"""`draftsmith validate`: the cheap checks a run would otherwise fail on hours in.

Beyond the config's own validation (keys, types, constraints), without loading a model or
starting a server: the data files exist and their first records parse; the aux layer ids lie
within the target's layers and each engine can express them; the drafting settings agree with
train.ttt_steps and the engine; the ports the run will bind are free; an API key the endpoint
needs is set; the GPUs a stage asks for exist. `deep=True` also loads the target's config and
tokenizer and renders the first records with its chat template.

Each check gives findings: an error is what the run would fail on, a warning what it would run
through but probably not as meant.
"""

from __future__ import annotations

import errno
import inspect
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from draftsmith.config import BenchmarkConfig, DataSource, PipelineConfig
from draftsmith.errors import InputError
from draftsmith.model.registry import kind_named

FIRST_RECORDS = 20  # records read from each data file (the run's own checks, on a sample)


@dataclass(frozen=True)
class Finding:
    check: str  # what was checked, e.g. "data stdlib-sharegpt", "aux layers", "port"
    level: Literal["ok", "warning", "error"]
    message: str


class Checks:
    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def ok(self, check: str, message: str) -> None:
        self.findings.append(Finding(check, "ok", message))

    def warn(self, check: str, message: str) -> None:
        self.findings.append(Finding(check, "warning", message))

    def error(self, check: str, message: str) -> None:
        self.findings.append(Finding(check, "error", message))


def check_config(config: PipelineConfig, deep: bool = False) -> list[Finding]:
    checks = Checks()
    for source in config.data.sources:
        check_source(checks, source, config.data.max_drop_rate)
    check_benchmark_prompts(checks, config.benchmark)
    target = target_shape(checks, config)
    if target is not None:
        check_layers(checks, config, target)
        check_vocab(checks, config, target)
    check_drafting(checks, config)
    check_ports(checks, config)
    check_endpoint(checks, config)
    check_devices(checks, config)
    check_hosts(checks, config)
    check_placement(checks, config)
    check_run_root(checks, config)
    check_drafters(checks, config)
    if deep:
        check_target_files(checks, config)
    return checks.findings


# --- data ------------------------------------------------------------------------------------


def check_source(checks: Checks, source: DataSource, max_drop_rate: float) -> None:
    from draftsmith.data.formats import load_source, peek_rows

    name = f"data {source.name}"
    if source.synthesize is not None:
        checks.ok(name, f"the target writes {source.synthesize.prompts} prompts (task types "
                        f"{dict(source.synthesize.task_types)}, free share "
                        f"{source.synthesize.free_share}) in the generate stage")
        return
    if source.builtin is not None:
        from draftsmith.data.packaged import check_installed

        try:
            check_installed(source.builtin)
        except InputError as err:
            checks.error(name, str(err))
            return
        checks.ok(name, f"builtin prompt set {source.builtin!r} is installed (read at run time)")
        return
    if source.hub is not None:
        if Path(source.hub).is_dir() or source.hub.startswith(("/", ".")):
            if not Path(source.hub).is_dir():
                checks.error(name, f"data.sources[{source.name}].hub={source.hub}: no such "
                                   "dataset directory")
            else:
                checks.ok(name, f"local dataset directory {source.hub} (records read at run "
                                "time)")
        else:
            checks.ok(name, f"hub dataset {source.hub!r}: not contacted here (access, split "
                            "and revision are checked when generate reads it)")
        return
    path = Path(source.path)
    if not path.is_file():
        checks.error(name, f"data.sources[{source.name}].path={path}: file not found (relative "
                           "paths are read from the config file's directory)")
        return
    try:
        _, stats = load_source(source.name, path, source.format, None, max_drop_rate,
                               rows=peek_rows(path, FIRST_RECORDS))
    except InputError as err:
        checks.error(name, f"the first {FIRST_RECORDS} records: {err}")
        return
    note = f", dropped {stats.dropped}" if stats.dropped else ""
    checks.ok(name, f"{path}: the first {stats.read} records parse (kept {stats.kept}{note})")


def check_benchmark_prompts(checks: Checks, cfg: BenchmarkConfig) -> None:
    if cfg.prompts_builtin is not None:
        from draftsmith.data.packaged import check_installed

        try:
            check_installed(cfg.prompts_builtin)
        except InputError as err:
            checks.error("benchmark prompts", f"benchmark.prompts_builtin: {err}")
            return
        checks.ok("benchmark prompts", f"builtin prompt set {cfg.prompts_builtin!r} is "
                                       "installed")
        return
    if cfg.prompts_file is None:
        return
    from draftsmith.data.formats import load_source, peek_rows

    path = Path(cfg.prompts_file)
    if not path.is_file():
        checks.error("benchmark prompts", f"benchmark.prompts_file={path}: file not found")
        return
    try:
        load_source("benchmark", path, "auto", None, 1.0, rows=peek_rows(path, FIRST_RECORDS))
    except InputError as err:
        checks.error("benchmark prompts", f"benchmark.prompts_file={path}: {err}")
        return
    checks.ok("benchmark prompts", f"{path}: the first records parse")


# --- the target, its layers and vocab --------------------------------------------------------


@dataclass(frozen=True)
class TargetShape:
    num_layers: int
    vocab_size: int
    family: str
    where: str  # the config.json read, or the built-in recipe


def target_shape(checks: Checks, config: PipelineConfig) -> TargetShape | None:
    """The target's layer count, vocab and family from its config.json (no weights read)."""
    from draftsmith.target import (
        BUILTIN_SMOLLM2,
        BUILTIN_TINY,
        builtin_target_path,
        family_of,
        read_model_config,
        text_config_of,
        tiny_target_path,
    )

    cfg = config.target
    builtin = builtin_target_path(cfg.model)
    if cfg.model == BUILTIN_TINY and not (tiny_target_path() / "config.json").is_file():
        from draftsmith.tiny_target import build_tiny_target, tiny_llama_config

        vocab = inspect.signature(build_tiny_target).parameters["vocab_size"].default
        model_config = tiny_llama_config(vocab).to_dict()
        where = "the built-in tiny target's recipe (built on the first run)"
    elif cfg.model == BUILTIN_SMOLLM2 and not (builtin / "config.json").is_file():
        from draftsmith.smollm2_target import SHAPE

        model_config = dict(SHAPE)
        where = f"{BUILTIN_SMOLLM2}'s pinned shape (converted on the first run)"
    else:
        path = builtin or Path(cfg.model).expanduser()
        if not (path / "config.json").is_file():
            checks.error("target", f"target.model={cfg.model!r}: no config.json there; give a "
                                   "local model directory (weights, config.json, tokenizer)")
            return None
        try:
            model_config = read_model_config(path)
        except InputError as err:
            checks.error("target", str(err))
            return None
        where = str(path / "config.json")
    text = text_config_of(model_config)
    missing = [k for k in ("num_hidden_layers", "vocab_size") if k not in text]
    if missing:
        checks.error("target", f"{where}: missing {missing}")
        return None
    family = family_of(model_config) if cfg.family == "auto" else cfg.family
    checks.ok("target", f"{where}: {text['num_hidden_layers']} layers, vocab "
                        f"{text['vocab_size']}, family {family}")
    return TargetShape(text["num_hidden_layers"], text["vocab_size"], family, where)


def check_layers(checks: Checks, config: PipelineConfig, target: TargetShape) -> None:
    from draftsmith.export.layer_ids import (
        check_aux_layer_ids,
        default_aux_layer_ids,
        engine_layer_ids,
    )

    given = config.extract.aux_layer_ids
    ids = list(given) if given is not None else default_aux_layer_ids(target.num_layers)
    try:
        check_aux_layer_ids(ids, target.num_layers)
        if config.extract.backend == "sglang":
            from draftsmith.extract.sglang_backend import check_capturable

            check_capturable(ids, target.num_layers)
    except InputError as err:
        checks.error("aux layers", f"{err} ({target.where})")
        return
    engine = "vllm" if config.export.format == "speculators" else "sglang"
    try:
        written = engine_layer_ids(ids, target.family, engine)
    except InputError as err:
        checks.error("aux layers", f"export would refuse them after training: {err}")
        return
    checks.ok("aux layers", f"{ids} (outputs; {'default' if given is None else 'given'}) within "
                            f"0..{target.num_layers - 1}, written {written} for {engine} on a "
                            f"{target.family} target")


def check_vocab(checks: Checks, config: PipelineConfig, target: TargetShape) -> None:
    if config.merge.draft_vocab_size > target.vocab_size:
        checks.error("draft vocab", f"merge.draft_vocab_size={config.merge.draft_vocab_size} "
                                    f"exceeds the target's vocab ({target.vocab_size}); set it to "
                                    f"at most {target.vocab_size}")


# --- drafting, ports, endpoint, devices, paths -----------------------------------------------


def check_drafting(checks: Checks, config: PipelineConfig) -> None:
    deploy = config.deploy
    if deploy.engine == "sglang" and config.export.format != "sglang":
        checks.error("drafting", f"deploy.engine=sglang with export.format="
                                 f"{config.export.format}: SGLang loads the SGLang layout only; "
                                 "set export.format=sglang")
    for warning in config.warnings():  # drafting more steps than were trained, and the like
        checks.warn("drafting", warning)
    if not any(f.check == "drafting" for f in checks.findings):
        steps = deploy.num_steps if deploy.num_steps is not None else "engine default"
        trained = kind_named(config.drafter.kind).trained_for(config)
        checks.ok("drafting", f"{deploy.engine}: {steps} draft steps, trained with {trained}")


def port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound here, or None when it is free."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return f"{host}:{port} is in use by another process"
            if err.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine"
            return f"{host}:{port} cannot be bound ({err.strerror})"
    return None


def check_ports(checks: Checks, config: PipelineConfig) -> None:
    wanted = []
    if config.deploy.engine == "sglang":
        wanted.append(("deploy", config.deploy.host, config.deploy.port))
    capture = config.extract.sglang
    if config.extract.backend == "sglang" and capture.url is None:
        wanted.append(("extract.sglang", capture.host, capture.port))
    endpoint = config.generate.endpoint if config.generate.backend == "openai" else None
    if endpoint is not None:
        url = httpx_url(endpoint.base_url)
        for section, host, port in wanted:
            if url is not None and url[1] == port and url[0] in (host, "localhost", "127.0.0.1"):
                checks.warn("port", f"generate.endpoint.base_url={endpoint.base_url} and "
                                    f"{section}.port={port} are the same port: the server that "
                                    f"answers generate must be stopped before {section} starts "
                                    f"its own, or {section} fails; give {section}.port another "
                                    "port")
    if config.orchestration.mode == "distributed" and wanted:
        checks.ok("port", ", ".join(f"{s}.port={p}" for s, _, p in wanted) + ": bound on the "
                          "GPU host, checked there when the stage starts")
        return
    for section, host, port in wanted:
        problem = port_problem(host, port)
        if problem is None:
            checks.ok("port", f"{section}.port={port} on {host} is free")
        elif section == "deploy" and config.deploy.keep_serving:
            checks.warn("port", f"{section}.port: {problem}; fine if it is this run's own server "
                                "kept from an earlier run (deploy.keep_serving), otherwise stop "
                                f"it or set {section}.port")
        else:
            checks.error("port", f"{section}.port: {problem}; stop it or set {section}.port "
                                 f"(and {section}.host)")


def httpx_url(base_url: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) URL, None when it is not one."""
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return None


def check_endpoint(checks: Checks, config: PipelineConfig) -> None:
    endpoint = config.generate.endpoint
    if config.generate.backend != "openai" or endpoint is None:
        return
    if httpx_url(endpoint.base_url) is None:
        checks.error("endpoint", f"generate.endpoint.base_url={endpoint.base_url!r}: expected "
                                 "an http:// or https:// URL, e.g. http://host:30000/v1")
    if endpoint.api_key_env and not os.environ.get(endpoint.api_key_env):
        checks.error("endpoint", f"generate.endpoint.api_key_env={endpoint.api_key_env!r}: that "
                                 "environment variable is not set (or empty); export it before "
                                 "the run")
    elif endpoint.api_key_secret:
        checks.ok("endpoint", f"API key from the Prefect Secret block "
                              f"{endpoint.api_key_secret!r} (read when the stage runs)")
    if not any(f.check == "endpoint" for f in checks.findings):
        checks.ok("endpoint", f"{endpoint.base_url} (model {endpoint.model}; not contacted)")


def check_devices(checks: Checks, config: PipelineConfig) -> None:
    wanted = {f"{section}.device": device for section, device in
              (("target", config.target.device), ("train", config.train.device))
              if device.startswith("cuda")}
    if not wanted:
        return
    import torch

    if not torch.cuda.is_available():
        if config.orchestration.mode == "distributed":
            checks.ok("devices", f"{', '.join(wanted)}: no CUDA here; the GPU stages run on the "
                                 "gpu work pool (orchestration.mode: distributed)")
            return
        checks.error("devices", f"{', '.join(f'{k}={v}' for k, v in wanted.items())}: torch "
                                f"{torch.__version__} sees no CUDA device here; set them to cpu, "
                                "or run the GPU stages on a GPU host (orchestration.mode: "
                                "distributed)")
        return
    count = torch.cuda.device_count()
    if config.train.nproc_per_node > count:
        checks.error("devices", f"train.nproc_per_node={config.train.nproc_per_node} but {count} "
                                "GPU(s) are visible here")
    else:
        checks.ok("devices", f"{count} CUDA device(s) visible")


def check_hosts(checks: Checks, config: PipelineConfig) -> None:
    """Training across hosts: enough GPU hosts, and distributed mode (where one flow run per
    host starts them)."""
    nodes, hosts = config.train.nnodes, config.orchestration.hosts()
    if nodes == 1:
        return
    if config.orchestration.mode != "distributed":
        checks.warn("hosts", f"train.nnodes={nodes}: training across hosts runs in distributed "
                             "mode only (the pipeline deployment that draftsmith prefect setup "
                             "--host ... creates selects it); draftsmith run refuses it")
    elif nodes > len(hosts):
        checks.error("hosts", f"train.nnodes={nodes} but orchestration.gpu_hosts names "
                              f"{len(hosts)} GPU host block(s) ({', '.join(hosts)}): name one "
                              "per host, or lower train.nnodes")
    else:
        checks.ok("hosts", f"train on {', '.join(hosts[:nodes])}, rendezvous at "
                           f"{config.train.rdzv_endpoint}")


def check_placement(checks: Checks, config: PipelineConfig) -> None:
    """Distributed mode: which pool each stage runs on, and why generate goes where it goes
    (draftsmith/stages.py generate_pool)."""
    if config.orchestration.mode != "distributed":
        return
    from draftsmith.stages import STAGES, generate_pool

    on_gpu = [s.label for s in STAGES if s.gpu(config)]
    on_cpu = [s.label for s in STAGES if not s.gpu(config)]
    pool, why = generate_pool(config)
    checks.ok("placement", f"gpu pool: {', '.join(on_gpu)}; with the pipeline on the cpu pool: "
                           f"{', '.join(on_cpu)} (generate on the {pool} pool: {why})")


def check_run_root(checks: Checks, config: PipelineConfig) -> None:
    root = Path(config.run_root)
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        checks.error("run_root", f"run_root={root}: {existing} is not a writable directory")
    else:
        checks.ok("run_root", f"{root} ({'exists' if existing == root else 'will be created'})")


def check_drafters(checks: Checks, config: PipelineConfig) -> None:
    """The drafters made elsewhere that the config names: fine-tuned from, or deployed."""
    from draftsmith.export.convert import detect_layout

    for check, setting, given in (("init_from", "train.init_from", config.train.init_from),
                                  ("drafter", "deploy.drafter", config.deploy.drafter)):
        if not given:
            continue
        path = Path(given)
        try:
            layout = detect_layout(path)
        except (InputError, OSError) as err:
            checks.error(check, f"{setting}={path}: {err}")
            continue
        checks.ok(check, f"{path}: a {layout}-layout drafter (weights read at run time)")


# --- deep: the target's own files ------------------------------------------------------------


def check_target_files(checks: Checks, config: PipelineConfig) -> None:
    """Load the target's config with transformers and its tokenizer, check the end-of-turn
    token, and render the first records of each source with the chat template."""
    from draftsmith.target import builtin_target_path

    cfg = config.target
    builtin = builtin_target_path(cfg.model)
    path = builtin or Path(cfg.model).expanduser()
    if not (path / "config.json").is_file():
        if builtin is not None:
            checks.ok("target files", f"the built-in target {cfg.model} is built on the first "
                                      "run")
        return  # reported by target_shape already
    from transformers import AutoConfig

    from draftsmith.artifacts import external_descriptor
    from draftsmith.data.tokenize import check_special_tokens
    from draftsmith.target import load_tokenizer

    try:
        AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises for this config
        checks.error("target files", f"{path / 'config.json'}: transformers cannot read it "
                                     f"({type(err).__name__}: {err})")
        return
    try:
        tokenizer = load_tokenizer(external_descriptor("target", path, "validate"))
        end_of_turn: dict[str, Any] = check_special_tokens(tokenizer, path)
    except InputError as err:
        checks.error("target files", str(err))
        return
    checks.ok("target files", f"{path}: config and tokenizer load; the template ends a turn "
                              f"with {end_of_turn['end_of_turn_token']!r}")
    if not end_of_turn["stops_generation"]:
        checks.warn("target files", f"generation does not stop on "
                                    f"{end_of_turn['end_of_turn_token']!r} (stop ids "
                                    f"{end_of_turn['generation_stop_ids']}): answers generated "
                                    "by the target may run past the end of their turn")
    for source in config.data.sources:
        if source.path is None or not Path(source.path).is_file():
            continue
        check_template_renders(checks, tokenizer, source, config.data.max_drop_rate)


def check_template_renders(checks: Checks, tokenizer, source: DataSource,
                           max_drop_rate: float) -> None:
    from draftsmith.data.formats import load_source, peek_rows
    from draftsmith.data.tokenize import tokenize_record

    name = f"template {source.name}"
    try:
        records, _ = load_source(source.name, source.path, source.format, None, max_drop_rate,
                                 rows=peek_rows(source.path, FIRST_RECORDS))
    except InputError:
        return  # reported by check_source
    for record in records:
        try:
            tokenize_record(tokenizer, record)
        except InputError as err:
            checks.error(name, f"record {record.id}: {err}")
            return
        except Exception as err:  # noqa: BLE001 - jinja raises what the template's author chose
            checks.error(name, f"the chat template cannot render record {record.id}: "
                               f"{type(err).__name__}: {err}")
            return
    checks.ok(f"template {source.name}", f"the chat template renders the first "
                                         f"{len(records)} records")


def format_findings(findings: list[Finding]) -> list[str]:
    marks = {"ok": "ok     ", "warning": "WARNING", "error": "ERROR  "}
    return [f"{marks[f.level]} {f.check}: {f.message}" for f in findings]
