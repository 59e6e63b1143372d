"""The stages the vLLM tests share: the demo's pipeline, smaller, through export in the
speculators layout, on the trained tiny target; then one `vllm serve` of target + drafter,
started by the deploy stage itself and reused by every test of the session.

vLLM takes about a minute to start on a CPU, so the session starts it once; the deploy stage
reuses a server that still passes its readiness checks and launches it again otherwise (the
benchmark's baseline stops it).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.artifacts import Descriptor, plan_stage, read_descriptor
from draftsmith.config import (
    BenchmarkConfig,
    DataConfig,
    DeployConfig,
    ExportConfig,
    ExtractConfig,
    GenerateConfig,
    MergeConfig,
    TargetConfig,
    TrainConfig,
)
from tests.conftest import REPO

# KV cache of the test server, in GiB (vLLM's CPU backend reserves it up front).
KV_CACHE_GIB = "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Chain:
    root: Path
    target_cfg: TargetConfig
    target: Descriptor
    deploy_cfg: DeployConfig
    out: dict[str, Descriptor] = field(default_factory=dict)

    def plan(self, stage: str, *inputs: Descriptor, material: dict | None = None):
        return plan_stage(self.root, stage, material or {}, list(inputs))

    def run(self, stage: str, fn, *args, inputs: tuple[Descriptor, ...]) -> Descriptor:
        """A stage of the chain, or its finished output when the root already holds it (a
        developer can keep a root between sessions with DRAFTSMITH_VLLM_CHAIN_ROOT)."""
        plan = self.plan(stage, *inputs)
        self.out[stage] = read_descriptor(plan) if plan.is_complete() else fn(*args, plan)
        return self.out[stage]

    @property
    def drafter_dir(self) -> str:
        return self.out["export"].figures["drafter_dir"]

    def benchmark_cfg(self, **overrides) -> BenchmarkConfig:
        return BenchmarkConfig(**{"num_prompts": 8, "max_new_tokens": 48, **overrides})


def build_chain(root: Path) -> Chain:
    from draftsmith.data.merge import run_merge
    from draftsmith.export.stage import run_export
    from draftsmith.extract.stage import run_extract
    from draftsmith.generate.stage import run_generate
    from draftsmith.target import resolve_target
    from draftsmith.train.trainer import run_train

    target_cfg = TargetConfig(model="builtin:tiny")
    target = resolve_target(target_cfg)
    deploy_cfg = DeployConfig(
        engine="vllm", num_steps=3, eagle_topk=1, num_draft_tokens=4, port=free_port(),
        env={"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB},
        # A string-based reasoning parser (no special tokens needed): the generation tests
        # read the reasoning field vLLM fills; structured outputs constrain the reasoning too,
        # so a regex can make the tiny target answer in the parser's shape.
        # --enforce-eager: torch.compile warm-up would take minutes on 2 cores, for nothing here.
        extra_args=["--reasoning-parser", "granite",
                    "--structured-outputs-config", '{"enable_in_reasoning": true}',
                    "--max-num-seqs", "16", "--enforce-eager"],
        startup_timeout_s=900)
    chain = Chain(root, target_cfg, target, deploy_cfg)
    data = DataConfig(sources=[
        {"name": "sg", "path": str(REPO / "examples/data/sharegpt.jsonl"), "limit": 48},
        {"name": "oa", "path": str(REPO / "examples/data/openai.jsonl"), "limit": 48},
    ])
    out = chain.out
    chain.run("generate", run_generate, GenerateConfig(max_new_tokens=64, batch_size=32), data,
              target_cfg, target, inputs=(target,))
    chain.run("merge", run_merge, MergeConfig(max_length=512, validation_fraction=0.15,
                                              draft_vocab_size=1024),
              out["generate"], target, inputs=(out["generate"],))
    chain.run("extract", run_extract, ExtractConfig(batch_size=16, shard_tokens=16384),
              target_cfg, out["merge"], target, inputs=(out["merge"],))
    chain.run("train", run_train, TrainConfig(ttt_steps=3, lr=3e-3, warmup_ratio=0.05, epochs=6,
                                              batch_tokens=2048, log_every=20),
              out["extract"], out["merge"], target, inputs=(out["extract"],))
    chain.run("export", run_export, ExportConfig(format="speculators"), target_cfg,
              out["train"], target, inputs=(out["train"],))
    return chain


def ensure_deployed(chain: Chain) -> Descriptor:
    """The deploy stage: reuses the running server, or launches it (again)."""
    from draftsmith.serve.deploy import run_deploy

    chain.out["deploy"] = run_deploy(chain.deploy_cfg, chain.target_cfg, chain.out["export"],
                                     chain.out["merge"], chain.target,
                                     chain.plan("deploy", chain.out["export"]))
    return chain.out["deploy"]
