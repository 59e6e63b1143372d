"""Stage `deploy`: bring the exported drafter up behind a speculative engine and prove it works.

The embedded engine (the CPU default) loads the target and the drafter from the exported files,
and deploy is complete only when one real speculative generation has run and matched plain
greedy decoding token for token.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    atomic_write_json,
    finish_stage,
    stage_output,
)
from draftsmith.config import DeployConfig, TargetConfig
from draftsmith.data.merge import read_split
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, greedy_generate
from draftsmith.target import load_target_model, load_tokenizer

log = logging.getLogger(__name__)

DEPLOYMENT_FILE = "deployment.json"


def load_embedded_engine(deployment: Descriptor, target_cfg: TargetConfig):
    spec = json.loads((Path(deployment.path) / DEPLOYMENT_FILE).read_text())
    model = load_target_model(spec["target_path"], target_cfg.device, target_cfg.dtype)
    engine = EmbeddedSpeculativeEngine.load(model, spec["drafter_dir"], spec["num_steps"],
                                            spec["target_family"])
    return engine, spec


def prompt_ids(tokenizer, messages_json: str) -> list[int]:
    """The conversation up to (not including) its last assistant turn, ready for generation."""
    messages = [{"role": m["role"], "content": m["content"]} for m in json.loads(messages_json)]
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def run_deploy(cfg: DeployConfig, target_cfg: TargetConfig, exported: Descriptor,
               merged: Descriptor, target: Descriptor, plan: StagePlan) -> Descriptor:
    if cfg.engine != "embedded":
        raise NotImplementedError(
            f"deploy.engine={cfg.engine!r} is not available yet; use 'embedded'"
        )
    spec = {"engine": "embedded", "target_path": target.path,
            "drafter_dir": exported.figures["drafter_dir"], "num_steps": cfg.num_steps,
            "target_family": target.figures["family"],
            "eagle_topk": cfg.eagle_topk, "num_draft_tokens": cfg.num_draft_tokens}
    model = load_target_model(target.path, target_cfg.device, target_cfg.dtype)
    engine = EmbeddedSpeculativeEngine.load(model, spec["drafter_dir"], cfg.num_steps,
                                            spec["target_family"])
    tokenizer = load_tokenizer(target)
    rows = read_split(merged, "validation") or read_split(merged, "train")
    prompt = prompt_ids(tokenizer, rows[0]["messages"])
    speculative = engine.generate(prompt, 32, tokenizer.eos_token_id)
    greedy = greedy_generate(engine.runner, prompt, 32, tokenizer.eos_token_id)
    if not speculative.tokens or speculative.tokens != greedy.tokens:
        raise RuntimeError(
            "deploy: the smoke generation through the speculative engine does not match plain "
            f"greedy decoding (speculative {speculative.tokens[:16]}..., greedy "
            f"{greedy.tokens[:16]}...); the drafter or the engine is broken"
        )
    with stage_output(plan) as out:
        atomic_write_json(out / DEPLOYMENT_FILE, spec)
    log.info("deploy: embedded engine ready (drafter %s, %d steps); smoke generation of %d "
             "tokens matched greedy, acceptance length %.2f", spec["drafter_dir"], cfg.num_steps,
             len(speculative.tokens), speculative.acceptance_length)
    return finish_stage(plan, figures={
        **spec, "smoke_acceptance_length": round(speculative.acceptance_length, 3)})
