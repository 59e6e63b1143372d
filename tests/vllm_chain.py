"""The stages the vLLM tests share: the session's pipeline run (tests/tiny_run.py) on the
trained tiny target, with its drafter exported in the speculators layout; then one `vllm serve`
of target + drafter, started by the deploy stage itself and reused by every test of the session.

vLLM takes about a minute to start on a CPU, so the session starts it once; the deploy stage
reuses a server that still passes its readiness checks and launches it again otherwise (the
benchmark's baseline stops it).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.artifacts import Descriptor, plan_stage
from draftsmith.config import (
    BenchmarkConfig,
    DeployConfig,
    ExportConfig,
    TargetConfig,
    parse_config,
)
from tests.ports import free_port

# KV cache of the test server, in GiB (vLLM's CPU backend reserves it up front).
KV_CACHE_GIB = "1"
# The environment of the suite's vLLM servers. VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine
# core runs the model itself instead of starting a worker process for it, so one import of vLLM
# and torch fewer: SmolLM2 was ready in 23 s against 29-36 s on 2 busy cores
# (benchmarks/vllm_startup/run.sh). The capture test (tests/test_extract_vllm.py) keeps vLLM's
# default layout: draftsmith's connector is then loaded in a worker process, as on a user's server.
VLLM_TEST_ENV = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}



@dataclass
class Chain:
    root: Path
    target_cfg: TargetConfig
    target: Descriptor
    deploy_cfg: DeployConfig
    out: dict[str, Descriptor] = field(default_factory=dict)

    def plan(self, stage: str, *inputs: Descriptor, material: dict | None = None):
        return plan_stage(self.root, stage, material or {}, list(inputs))

    @property
    def drafter_dir(self) -> str:
        return self.out["export"].figures["drafter_dir"]

    def benchmark_cfg(self, **overrides) -> BenchmarkConfig:
        return BenchmarkConfig(**{"num_prompts": 8, "max_new_tokens": 48, **overrides})


def build_chain(root: Path, run: dict[str, dict], config: dict) -> Chain:
    """The chain from the session run's outputs: its target, data and trained drafter, exported
    again in the speculators layout. The hidden-state store is copied into `root`: the e2e
    retention test deletes the run's own."""
    from draftsmith.export.stage import run_export
    from draftsmith.target import resolve_target

    target_cfg = parse_config(config).target
    target = resolve_target(target_cfg)
    deploy_cfg = DeployConfig(
        engine="vllm", num_steps=3, eagle_topk=1, num_draft_tokens=4, port=free_port(),
        env=VLLM_TEST_ENV,
        # A string-based reasoning parser (no special tokens needed): the generation tests
        # read the reasoning field vLLM fills; structured outputs constrain the reasoning too,
        # so a regex can make the tiny target answer in the parser's shape.
        # --enforce-eager: torch.compile warm-up would take minutes on 2 cores, for nothing here.
        extra_args=["--reasoning-parser", "granite",
                    "--structured-outputs-config", '{"enable_in_reasoning": true}',
                    "--max-num-seqs", "16", "--enforce-eager"],
        startup_timeout_s=900)
    chain = Chain(root, target_cfg, target, deploy_cfg)
    out = chain.out
    for stage in ("generate", "merge", "extract", "train"):
        out[stage] = Descriptor.model_validate(run[stage]["descriptor"])
    store = root / "extract-copy"
    shutil.copytree(out["extract"].path, store)
    out["extract"] = out["extract"].model_copy(update={"path": str(store)})
    out["export"] = run_export(ExportConfig(format="speculators"), target_cfg, out["train"],
                               target, chain.plan("export", out["train"]))
    return chain


def ensure_deployed(chain: Chain) -> Descriptor:
    """The deploy stage: reuses the running server, or launches it (again)."""
    from draftsmith.serve.deploy import run_deploy

    chain.out["deploy"] = run_deploy(chain.deploy_cfg, chain.target_cfg, chain.out["export"],
                                     chain.out["merge"], chain.target,
                                     chain.plan("deploy", chain.out["export"]))
    return chain.out["deploy"]
