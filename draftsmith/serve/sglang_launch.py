"""The SGLang server for a target + EAGLE-3 drafter: the command, checks before launch, readiness.

Every constraint SGLang checks late (or not at all) is checked here, before minutes of weight
loading (docs/engines/sglang.md, "Serving"): EAGLE3 and never EAGLE for an EAGLE-3 drafter, a
draft path, steps / topk / draft tokens given all together and consistent, a draft context no
shorter than the served context. When sglang is importable, its own argument parser reads the
list too, so a misspelt or renamed flag fails in a second, and the installed version must be
one draftsmith supports (SUPPORTED_SGLANG; servers report theirs at readiness and are checked
again there).

Readiness: the port is open, /health answers 200, /server_info reports a supported SGLang
version and the speculative settings and drafter the server was launched with, and one real
generation returns tokens.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from draftsmith.config import SGLANG_SPECULATIVE_MAX_RUNNING_REQUESTS, DeployConfig, TargetConfig
from draftsmith.errors import InputError
from draftsmith.export.convert import read_drafter
from draftsmith.serve.engine_adapter import EngineAdapter, LaunchError
from draftsmith.serve.process import ManagedProcess, ServerLaunch
from draftsmith.serve.readiness import ReadinessError, wait_for_port

log = logging.getLogger(__name__)

ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
# The SGLang versions draftsmith's SGLang code was checked against: 0.5.23's own parser,
# registry and source (tests/test_sglang_conformance.py). 0.5.9 lacks what the Kimi-K2.5 path
# needs (set_eagle3_layers_to_capture on its class, --cuda-graph-max-bs-decode). The `sglang`
# extra of pyproject.toml pins the same range (a test compares them).
SUPPORTED_SGLANG = ">=0.5.23,<0.6"


class UnsupportedSGLangError(InputError, RuntimeError):
    """An SGLang outside the supported range: it fails the same way on every attempt."""


def check_sglang_version(version: str | None, where: str) -> None:
    """Refuse an SGLang outside SUPPORTED_SGLANG, naming where the version came from."""
    fix = (f"install a supported one (pip install 'draftsmith[sglang]', i.e. "
           f"sglang{SUPPORTED_SGLANG})")
    if not version:
        raise UnsupportedSGLangError(f"{where} reports no SGLang version; draftsmith supports "
                                     f"SGLang {SUPPORTED_SGLANG}: {fix}")
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise UnsupportedSGLangError(f"{where} reports SGLang version {version!r}, which is "
                                     f"not a version number; {fix}") from None
    if not SpecifierSet(SUPPORTED_SGLANG).contains(parsed, prereleases=True):
        raise UnsupportedSGLangError(
            f"{where} runs SGLang {version}; draftsmith supports SGLang {SUPPORTED_SGLANG} "
            f"(its capture, launch flags and metrics were checked against those versions' "
            f"code): {fix}")


class SGLangLaunch(ServerLaunch):
    """An SGLang server's launch (`sglang.launch_server`)."""


def build_launch(cfg: DeployConfig, target_cfg: TargetConfig, drafter_dir: str | Path | None,
                 family: str = "llama", model_path: str | None = None) -> SGLangLaunch:
    """model_path: the resolved target directory (default: target.model as configured).
    drafter_dir None: the same server without speculation (the benchmark's baseline)."""
    env = dict(cfg.env)
    context = target_cfg.context_length
    argv = [
        *(cfg.sglang_command or [sys.executable, "-m", "sglang.launch_server"]),
        "--model-path", model_path or target_cfg.model,
        "--tp-size", str(target_cfg.tp_size),
        "--host", cfg.host,
        "--port", str(cfg.port),
    ]
    if drafter_dir is not None:
        argv += _speculative_arguments(cfg, target_cfg, drafter_dir, family, env)
    if context:
        argv += ["--context-length", str(context)]
    if cfg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    # The same cap on both servers: SGLang caps a speculative server at 48 running requests
    # when it is unset and leaves a plain one uncapped, which understates the speedup above 48.
    argv += ["--max-running-requests", str(max_running_requests(cfg))]
    if cfg.cuda_graph_max_bs_decode is not None:
        argv += ["--cuda-graph-max-bs-decode", str(cfg.cuda_graph_max_bs_decode)]
    if cfg.enable_metrics:
        argv += ["--enable-metrics"]
    if target_cfg.dtype != "float32":
        argv += ["--dtype", target_cfg.dtype]
    argv += cfg.extra_args
    launch = SGLangLaunch(argv=argv, env=env, host=cfg.host, port=cfg.port,
                          drafter_dir=str(drafter_dir) if drafter_dir is not None else None)
    check_with_sglang_parser(launch)
    return launch


def _speculative_arguments(cfg: DeployConfig, target_cfg: TargetConfig, drafter_dir: str | Path,
                           family: str, env: dict[str, str]) -> list[str]:
    drafter = read_drafter(drafter_dir, family)  # a drafter SGLang would mis-load stops here
    if drafter.layout not in ("sglang", "specforge"):
        raise LaunchError(
            f"{drafter_dir}: a {drafter.layout}-layout drafter; SGLang needs the SGLang layout "
            "(set export.format=sglang, or: draftsmith export DIR --to sglang --out NEW)"
        )
    context = target_cfg.context_length
    draft_context = drafter.config.max_position_embeddings
    if context and draft_context < context:
        if not cfg.allow_shorter_draft_context:
            raise LaunchError(
                f"target.context_length={context} exceeds the drafter's "
                f"max_position_embeddings={draft_context}: SGLang refuses to start. Re-export "
                f"with --context-length {context}, or set deploy.allow_shorter_draft_context="
                f"true (sets {ALLOW_LONGER_CONTEXT_ENV}=1)"
            )
        env[ALLOW_LONGER_CONTEXT_ENV] = "1"
    argv = ["--speculative-algorithm", cfg.speculative_algorithm,
            "--speculative-draft-model-path", str(drafter_dir)]
    if cfg.num_steps is not None:
        argv += ["--speculative-num-steps", str(cfg.num_steps),
                 "--speculative-eagle-topk", str(cfg.eagle_topk),
                 "--speculative-num-draft-tokens", str(cfg.num_draft_tokens)]
    return argv


def max_running_requests(cfg: DeployConfig) -> int:
    """deploy.max_running_requests, or the cap SGLang gives an EAGLE server when it is unset."""
    if cfg.max_running_requests is not None:
        return cfg.max_running_requests
    return SGLANG_SPECULATIVE_MAX_RUNNING_REQUESTS


def server_arguments(launch: SGLangLaunch) -> list[str]:
    """The flags after the program (`python -m sglang.launch_server`)."""
    first_flag = next(i for i, a in enumerate(launch.argv) if a == "--model-path")
    return launch.argv[first_flag:]


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_with_sglang_parser(launch: SGLangLaunch) -> list[str] | None:
    """Parse the flags with SGLang's own parser when sglang is installed, as
    `sglang.srt.server_args.prepare_server_args` does (without its logging setup). Returns
    None when sglang is not installed, else the deprecated flags the command uses (logged as
    warnings); raises LaunchError with the parser's message when SGLang rejects a flag, and
    UnsupportedSGLangError for an installed version outside SUPPORTED_SGLANG."""
    if importlib.util.find_spec("sglang") is None:
        return None
    check_sglang_version(installed_sglang_version(), "the installed sglang package")
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    argv = server_arguments(launch)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            ServerArgs.from_cli_args(parser.parse_args(argv))
    except (SystemExit, argparse.ArgumentError, TypeError, ValueError) as err:
        reason = errors.getvalue().strip() or err
        raise LaunchError(f"SGLang's argument parser rejects the launch command: {reason}\n"
                          f"command: {launch.shell()}") from None
    deprecated = deprecated_flags(parser, argv)
    for flag in deprecated:
        log.warning("SGLang deprecates %s in this command; it may stop working in a later "
                    "release", flag)
    return deprecated


def deprecated_flags(parser, argv: list[str]) -> list[str]:
    """The flags of `argv` that SGLang registers with one of its Deprecated* actions, each
    with the replacement SGLang names."""
    found = []
    for action in parser._actions:
        if not type(action).__name__.startswith("Deprecated"):
            continue
        for option in action.option_strings:
            if any(a == option or a.startswith(option + "=") for a in argv):
                found.append(f"{option} (use {getattr(action, 'new_flag', 'its replacement')})")
    return found


# ---------------------------------------------------------------------------------------------
# Readiness


def server_info(client: httpx.Client) -> dict[str, Any]:
    for path in ("/server_info", "/get_server_info"):  # newer and older SGLang
        response = client.get(path)
        if response.status_code == 200:
            return response.json()
    raise ReadinessError("server_info", "neither /server_info nor /get_server_info answers 200")


def check_server_version(info: dict[str, Any], url: str) -> None:
    try:
        check_sglang_version(info.get("version"), f"the server at {url}")
    except UnsupportedSGLangError as err:
        raise ReadinessError("version", str(err)) from None


def check_speculative_settings(info: dict[str, Any], cfg: DeployConfig,
                               drafter_dir: str | None) -> None:
    if drafter_dir is None:  # a baseline server must not speculate
        if info.get("speculative_algorithm"):
            raise ReadinessError("server_info", f"speculative_algorithm is "
                                 f"{info['speculative_algorithm']!r} on a server started "
                                 "without speculation")
        return
    if info.get("speculative_algorithm") != cfg.speculative_algorithm:
        raise ReadinessError("server_info", f"speculative_algorithm is "
                             f"{info.get('speculative_algorithm')!r}, expected "
                             f"{cfg.speculative_algorithm!r}")
    served = info.get("speculative_draft_model_path")
    if served is None or Path(served).resolve() != Path(drafter_dir).resolve():
        raise ReadinessError("server_info", f"speculative_draft_model_path is {served!r}, "
                             f"expected {drafter_dir}")
    if cfg.num_steps is not None:
        for key, want in (("speculative_num_steps", cfg.num_steps),
                          ("speculative_eagle_topk", cfg.eagle_topk),
                          ("speculative_num_draft_tokens", cfg.num_draft_tokens)):
            if info.get(key) != want:
                raise ReadinessError("server_info", f"{key} is {info.get(key)!r}, expected {want}")


def wait_until_ready(url: str, cfg: DeployConfig, drafter_dir: str | None,
                     process: ManagedProcess | None = None,
                     timeout_s: float | None = None) -> dict[str, Any]:
    """Run the checks in order; return the server's info. Raises ReadinessError naming
    the check that failed and why."""
    started = time.monotonic()
    timeout_s = timeout_s if timeout_s is not None else cfg.startup_timeout_s
    wait_for_port(cfg.host, cfg.port, process, timeout_s)
    log.info("server port %s:%d open after %.0fs", cfg.host, cfg.port, time.monotonic() - started)
    with httpx.Client(base_url=url, timeout=120.0) as client:
        health = client.get("/health")
        if health.status_code != 200:
            raise ReadinessError("health", f"/health answered {health.status_code}: "
                                 f"{health.text[:200]}")
        info = server_info(client)
        check_server_version(info, url)
        check_speculative_settings(info, cfg, drafter_dir)
        response = client.post("/generate", json={
            "text": "Speculative decoding is", "sampling_params": {"max_new_tokens": 8,
                                                                   "temperature": 0.0}})
        if response.status_code != 200:
            raise ReadinessError("generation", f"/generate answered {response.status_code}: "
                                 f"{response.text[:200]}")
        meta = response.json().get("meta_info", {})
        if not meta.get("completion_tokens"):
            raise ReadinessError("generation",
                                 f"/generate returned no tokens: {response.text[:200]}")
    log.info("server ready at %s after %.0fs (%s, %s steps)", url, time.monotonic() - started,
             info.get("speculative_algorithm"), info.get("speculative_num_steps"))
    return info


# ---------------------------------------------------------------------------------------------
# The deploy stage on SGLang


class SGLangEngine(EngineAdapter[SGLangLaunch]):
    """`sglang.launch_server` with the drafter: serving this drafter means /server_info shows
    it with deploy's speculative algorithm and step settings."""

    name = "sglang"
    label = "SGLang"

    def build_launch(self, cfg: DeployConfig, target_cfg: TargetConfig,
                     drafter_dir: str | Path | None, family: str = "llama",
                     model_path: str | None = None) -> SGLangLaunch:
        return build_launch(cfg, target_cfg, drafter_dir, family, model_path)

    def wait_until_ready(self, launch: SGLangLaunch, cfg: DeployConfig,
                         process: ManagedProcess | None = None,
                         timeout_s: float | None = None) -> dict[str, Any]:
        info = wait_until_ready(launch.url, cfg, launch.drafter_dir, process, timeout_s)
        return {"version": info.get("version")}

    def deployment(self, launch: SGLangLaunch, cfg: DeployConfig, target_path: str,
                   family: str) -> dict[str, Any]:
        return {"engine": self.name, "url": launch.url, "drafter_dir": launch.drafter_dir,
                "target_path": target_path, "num_steps": cfg.num_steps,
                "eagle_topk": cfg.eagle_topk, "num_draft_tokens": cfg.num_draft_tokens,
                "command": launch.argv, "target_family": family}

    def figures(self, launch: SGLangLaunch, cfg: DeployConfig,
                reported: dict[str, Any]) -> dict[str, Any]:
        return {"engine": self.name, "url": launch.url, "drafter_dir": launch.drafter_dir,
                "num_steps": cfg.num_steps}


SGLANG = SGLangEngine()
