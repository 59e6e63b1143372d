"""The SGLang server command for a target + EAGLE-3 drafter, built as an argument list.

Every constraint SGLang checks late (or not at all) is checked here, before minutes of weight
loading (REFERENCE.md section 4): EAGLE3 and never EAGLE for an EAGLE-3 drafter, a draft path,
steps / topk / draft tokens given all together and consistent, a draft context no shorter than
the served context. When sglang is importable, its own argument parser reads the list too, so a
misspelt or renamed flag fails in a second.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import shlex
import sys
from pathlib import Path

from pydantic import BaseModel

from draftsmith.config import DeployConfig, TargetConfig
from draftsmith.errors import InputError
from draftsmith.export.convert import read_drafter

ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


class LaunchError(InputError, ValueError):
    pass


class SGLangLaunch(BaseModel):
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    drafter_dir: str | None  # None: served without speculation

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell(self) -> str:
        """For people to read and paste; the launcher itself never goes through a shell."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


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


def server_arguments(launch: SGLangLaunch) -> list[str]:
    """The flags after the program (`python -m sglang.launch_server`)."""
    first_flag = next(i for i, a in enumerate(launch.argv) if a == "--model-path")
    return launch.argv[first_flag:]


def check_with_sglang_parser(launch: SGLangLaunch) -> bool:
    """Parse the flags with SGLang's own parser when sglang is installed. Returns whether it
    ran; raises LaunchError with the parser's message when SGLang rejects a flag."""
    if importlib.util.find_spec("sglang") is None:
        return False
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parser.parse_args(server_arguments(launch))
    except (SystemExit, argparse.ArgumentError) as err:
        reason = errors.getvalue().strip() or err
        raise LaunchError(f"SGLang's argument parser rejects the launch command: {reason}\n"
                          f"command: {launch.shell()}") from None
    return True
