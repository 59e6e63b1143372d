"""Stage `deploy`: bring the exported drafter up behind a speculative engine and prove it works.

The embedded engine (the CPU default) loads the target and the drafter from the exported files,
and deploy is complete only when one real speculative generation has run and matched plain
greedy decoding token for token. The SGLang engine launches a server (draftsmith/serve/
sglang_launch.py) and the vLLM engine `vllm serve` (draftsmith/serve/vllm_launch.py); each is
complete only when it passes every readiness check. Both servers go through one routine,
`deploy_server`, over an engine adapter (draftsmith/serve/engine_adapter.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    atomic_write_json,
    finish_stage,
    read_descriptor,
    stage_output,
)
from draftsmith.config import DeployConfig, TargetConfig
from draftsmith.data.merge import read_split
from draftsmith.figures import ExportFigures, TargetFigures
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, plain_generate
from draftsmith.serve.engine_adapter import EngineAdapter
from draftsmith.target import load_target_model, load_tokenizer

log = logging.getLogger(__name__)

DEPLOYMENT_FILE = "deployment.json"


def load_embedded_engine(deployment: Descriptor, target_cfg: TargetConfig):
    spec = json.loads((Path(deployment.path) / DEPLOYMENT_FILE).read_text())
    model = load_target_model(spec["target_path"], target_cfg.device, target_cfg.dtype)
    engine = EmbeddedSpeculativeEngine.load(model, spec["drafter_dir"], spec["num_steps"],
                                            spec["target_family"], spec["eagle_topk"],
                                            spec["num_draft_tokens"],
                                            spec.get("embedded_cache", "auto"))
    return engine, spec


def prompt_ids(tokenizer, messages_json: str) -> list[int]:
    """The conversation up to (not including) its last assistant turn, ready for generation."""
    messages = [{"role": m["role"], "content": m["content"]} for m in json.loads(messages_json)]
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def run_deploy(cfg: DeployConfig, target_cfg: TargetConfig, exported: Descriptor,
               merged: Descriptor | None, target: Descriptor, plan: StagePlan,
               smoke_messages: str | None = None) -> Descriptor:
    """The export stage's drafter (or one made elsewhere) served. The embedded engine's smoke
    generation answers a merged record (validation first), or `smoke_messages` (messages JSON)
    when the run has no merge output."""
    drafter = ExportFigures.of(exported)
    # The deployment of a drafter made elsewhere names its files' content: its directory does
    # not, and the benchmark's key follows the deployment.
    files = exported.fingerprint if drafter.external else None
    if cfg.engine in ("sglang", "vllm"):
        return deploy_server(server_engine(cfg.engine), cfg, target_cfg, drafter.drafter_dir,
                             target.path, TargetFigures.of(target).family, plan, files)
    if merged is not None:
        rows = read_split(merged, "validation") or read_split(merged, "train")
        smoke_messages = rows[0]["messages"]
    if smoke_messages is None:
        raise ValueError("run_deploy: give the merge output or smoke_messages")
    return deploy_embedded(cfg, target_cfg, drafter.drafter_dir, target, plan, smoke_messages,
                           files)


def deploy_embedded(cfg: DeployConfig, target_cfg: TargetConfig, drafter_dir: str,
                    target: Descriptor, plan: StagePlan, smoke_messages: str,
                    drafter_files: str | None = None) -> Descriptor:
    """The embedded engine's deployment of a drafter directory (the export stage's, or one
    trained elsewhere), after a smoke generation from `smoke_messages` (a record's messages,
    as JSON) that must match plain greedy decoding in float32. drafter_files: the content
    fingerprint of a drafter made elsewhere, recorded in the deployment."""
    spec = {"engine": "embedded", "target_path": target.path,
            "drafter_dir": drafter_dir, "num_steps": cfg.num_steps,
            "target_family": TargetFigures.of(target).family,
            "eagle_topk": cfg.eagle_topk, "num_draft_tokens": cfg.num_draft_tokens,
            "embedded_cache": cfg.embedded_cache,
            **({"drafter_files": drafter_files} if drafter_files else {})}
    model = load_target_model(target.path, target_cfg.device, target_cfg.dtype)
    engine = EmbeddedSpeculativeEngine.load(model, spec["drafter_dir"], cfg.num_steps,
                                            spec["target_family"], cfg.eagle_topk,
                                            cfg.num_draft_tokens, cfg.embedded_cache)
    tokenizer = load_tokenizer(target)
    prompt = prompt_ids(tokenizer, smoke_messages)
    speculative = engine.generate(prompt, 32, tokenizer.eos_token_id)
    greedy = plain_generate(engine.runner, prompt, 32, tokenizer.eos_token_id)
    if not speculative.tokens:
        raise RuntimeError("deploy: the speculative engine generated nothing")
    if speculative.tokens != greedy.tokens and target_cfg.dtype != "float32":
        log.warning(
            "deploy: with a %s target the speculative output differs from one-token greedy "
            "decoding; in reduced precision a (k+1)-token verify forward and a 1-token forward "
            "round differently, so near-ties can flip. Token identity is checked in float32.",
            target_cfg.dtype)
    elif speculative.tokens != greedy.tokens:
        raise RuntimeError(
            "deploy: the smoke generation through the speculative engine does not match plain "
            f"greedy decoding (speculative {speculative.tokens[:16]}..., greedy "
            f"{greedy.tokens[:16]}...); the drafter or the engine is broken"
        )
    with stage_output(plan) as out:
        atomic_write_json(out / DEPLOYMENT_FILE, spec)
    log.info("deploy: embedded engine ready (drafter %s, %s); smoke generation of %d "
             "tokens matched greedy, acceptance length %.2f", spec["drafter_dir"],
             drafting_label(cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens),
             len(speculative.tokens), speculative.acceptance_length)
    return finish_stage(plan, figures={
        **spec, "smoke_acceptance_length": round(speculative.acceptance_length, 3)})


def server_engine(engine: str) -> EngineAdapter:
    """The adapter of a server engine (deploy.engine sglang or vllm)."""
    if engine == "sglang":
        from draftsmith.serve.sglang_launch import SGLANG

        return SGLANG
    if engine == "vllm":
        from draftsmith.serve.vllm_launch import VLLM

        return VLLM
    raise ValueError(f"deploy.engine={engine!r} is not a server engine (sglang, vllm)")


def deploy_server(engine: EngineAdapter, cfg: DeployConfig, target_cfg: TargetConfig,
                  drafter_dir: str, target_path: str, family: str,
                  plan: StagePlan, drafter_files: str | None = None) -> Descriptor:
    """Launch the engine's server with the exported drafter and wait for real readiness.

    A server is state, not an artifact: a finished deploy directory is reused only while the
    server it recorded still passes every readiness check with this drafter; otherwise the
    server is launched again.
    """
    import httpx

    from draftsmith.serve import servers
    from draftsmith.serve.gpus import require_free_gpus
    from draftsmith.serve.holders import require_free_port
    from draftsmith.serve.readiness import ReadinessError

    launch = engine.build_launch(cfg, target_cfg, drafter_dir, family, target_path)
    if plan.is_complete():
        try:
            engine.wait_until_ready(launch, cfg, timeout_s=5)
            log.info("deploy: the %s server at %s is still up with this drafter; reusing it",
                     engine.label, launch.url)
            return read_descriptor(plan)
        except (ReadinessError, OSError, httpx.HTTPError) as err:
            log.info("deploy: the recorded %s server is gone (%s); launching again",
                     engine.label, err)
            shutil.rmtree(plan.dir)
    require_free_port("deploy", cfg.host, cfg.port)
    require_free_gpus(visible_gpus(), "deploy")
    with stage_output(plan) as out:
        log.info("deploy: starting %s: %s", engine.label, launch.shell())
        process, reported = engine.start(launch, cfg, out / "server.log", cfg.startup_timeout_s)
        servers.register(launch.url, process)
        made_elsewhere = {"drafter_files": drafter_files} if drafter_files else {}
        atomic_write_json(out / DEPLOYMENT_FILE,
                          {**engine.deployment(launch, cfg, target_path, family),
                           **made_elsewhere})
        # Volatile facts stay out of the fingerprint (hidden files are not checksummed).
        atomic_write_json(out / ".server.json", {"pid": process.pid, **reported})
    return finish_stage(plan, figures={**engine.figures(launch, cfg, reported),
                                       **made_elsewhere})


def drafting_label(num_steps: int | None, eagle_topk: int | None,
                   num_draft_tokens: int | None) -> str:
    """How a drafting config reads in logs, tables and charts."""
    if num_steps is None:
        return "engine defaults"
    if eagle_topk == 1:
        return f"chain, {num_steps} steps"
    return f"tree, {num_steps} steps, topk {eagle_topk}, {num_draft_tokens} draft tokens"


def visible_gpus() -> list[str] | None:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES), or None for all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g.strip() for g in visible.split(",") if g.strip()] if visible else None
