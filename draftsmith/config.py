"""Typed configuration: one pydantic model per stage, one PipelineConfig that holds them all.

YAML in, validated; unknown keys and bad values are errors that name the key. `--set a.b=c`
overrides are applied to the raw YAML before validation so they get the same checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

STAGES = ("generate", "merge", "extract", "train", "fix_keys", "deploy", "benchmark")


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and the fix."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(StrictModel):
    """The model the drafter is trained for."""

    model: str = Field(
        "builtin:tiny",
        description="Local directory with config.json + weights + tokenizer, or 'builtin:tiny' "
        "for the CPU demo target that draftsmith builds and caches locally.",
    )
    backend: Literal["transformers", "sglang"] = "transformers"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    family: Literal["auto", "llama", "qwen", "deepseek", "gpt-oss"] = Field(
        "auto", description="Decides how SGLang reads aux layer ids (REFERENCE.md section 1)."
    )
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs when served by SGLang.")
    context_length: int | None = Field(None, ge=1)


class DataSource(StrictModel):
    name: str = Field(..., min_length=1)
    path: str = Field(..., description="Local JSON/JSONL file.")
    format: Literal["auto", "sharegpt", "openai", "prompt"] = "auto"
    limit: int | None = Field(None, ge=1, description="Read at most this many records.")


class DataConfig(StrictModel):
    sources: list[DataSource] = Field(..., min_length=1)
    max_drop_rate: float = Field(0.05, ge=0.0, le=1.0, description=(
        "A source that drops a larger share of its records fails the run, naming why."))

    @model_validator(mode="after")
    def _unique_names(self) -> DataConfig:
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"data.sources: duplicate source names {dupes}; give each a unique name"
            )
        return self


class GenerateConfig(StrictModel):
    """Answer prompts with the target itself, so the drafter learns the target's distribution."""

    backend: Literal["transformers", "openai"] = "transformers"
    regenerate: Literal["missing", "all", "none"] = Field(
        "missing",
        description="missing: answer records whose last turn is not the assistant's; "
        "all: re-answer every record; none: keep records as they are.",
    )
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(16, ge=1)
    seed: int = 0


class MergeConfig(StrictModel):
    seed: int = 0
    max_length: int = Field(2048, ge=16)
    validation_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    dedup: bool = True
    draft_vocab_size: int = Field(32000, ge=2)


class ExtractConfig(StrictModel):
    backend: Literal["transformers", "sglang"] = "transformers"
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Canonical ids (output of decoder layer i). Default [1, L//2-1, L-4].",
    )
    batch_size: int = Field(8, ge=1)
    shard_tokens: int = Field(1 << 20, ge=1, description="Tokens per safetensors shard.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class TrainConfig(StrictModel):
    ttt_steps: int = Field(3, ge=1, le=16)
    step_weight_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of step j.")
    lr: float = Field(3e-5, gt=0.0)
    scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = Field(0.02, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    epochs: int = Field(5, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimiser steps.")
    batch_tokens: int = Field(8192, ge=16, description="Tokens per packed row.")
    grad_clip: float = Field(1.0, gt=0.0)
    lm_head_init: Literal["target", "random"] = "target"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    log_every: int = Field(10, ge=1)
    step_weights: list[float] | None = Field(
        None, description="Loss weight per TTT step (one per step); default step_weight_decay**j.")
    aux_noise_std: float = Field(0.0, ge=0.0, description="Gaussian noise on the aux inputs, "
                                 "relative to each position's RMS.")
    freeze_lm_head: bool = Field(False, description="Keep lm_head at its initial weights.")
    init_from: str | None = Field(None, description="Fine-tune this drafter (native, SGLang, "
                                  "SpecForge or speculators layout) instead of starting fresh.")
    init_family: str = Field("llama", description="Target family init_from's layer ids follow.")
    attention: Literal["auto", "flex", "sdpa"] = Field(
        "auto", description="auto: compiled flex_attention block masks on CUDA, SDPA on CPU.")
    compile: bool = Field(True, description="torch.compile the decoder layer on CUDA.")
    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N steps (0: only "
                                  "at epoch ends).")
    nproc_per_node: int = Field(1, ge=1, description="Processes (GPUs) under torchrun.")
    parallel: Literal["ddp", "fsdp"] = "ddp"

    @model_validator(mode="after")
    def _step_weights_match_steps(self) -> TrainConfig:
        if self.step_weights is not None and len(self.step_weights) != self.ttt_steps:
            raise ValueError(f"train.step_weights has {len(self.step_weights)} entries but "
                             f"ttt_steps is {self.ttt_steps}: give one weight per step")
        return self


class FixKeysConfig(StrictModel):
    format: Literal["sglang", "speculators"] = Field(
        "sglang", description="sglang: SGLang / EAGLE / SpecForge layout; speculators: vLLM.")
    speculative_tokens: int = Field(3, ge=1, description="Written into a speculators config.")


class DeployConfig(StrictModel):
    engine: Literal["embedded", "sglang"] = "embedded"
    speculative_algorithm: Literal["EAGLE3", "EAGLE"] = "EAGLE3"
    # All three or none (none: SGLang picks); SGLang fails obscurely on a partial set.
    num_steps: int | None = Field(3, ge=1)
    eagle_topk: int | None = Field(1, ge=1)
    num_draft_tokens: int | None = Field(4, ge=2)
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    cuda_graph_max_bs_decode: int | None = Field(None, ge=1)
    enable_metrics: bool = True
    allow_shorter_draft_context: bool = False
    extra_args: list[str] = Field(default_factory=list, description="Passed to SGLang as is.")
    env: dict[str, str] = Field(default_factory=dict, description="e.g. NCCL settings.")
    sglang_command: list[str] | None = Field(
        None, description="Program that starts the server; default: python -m "
        "sglang.launch_server with this interpreter.")
    startup_timeout_s: float = Field(1800.0, gt=0, description="Big targets need 15+ minutes.")
    keep_serving: bool = False

    @model_validator(mode="after")
    def _check_eagle3(self) -> DeployConfig:
        if self.speculative_algorithm != "EAGLE3":
            raise ValueError(
                f"deploy.speculative_algorithm={self.speculative_algorithm!r}: draftsmith trains "
                "EAGLE-3 drafters, and SGLang runs them with EAGLE3 only (EAGLE starts and accepts "
                "nothing). Set deploy.speculative_algorithm=EAGLE3."
            )
        for flag in ("--speculative-num-steps", "--speculative-eagle-topk",
                     "--speculative-num-draft-tokens", "--speculative-draft-model-path",
                     "--speculative-algorithm", "--num-speculative-tokens"):
            if flag in self.extra_args:
                raise ValueError(f"deploy.extra_args: {flag} is set by draftsmith from deploy.* "
                                 "(and --num-speculative-tokens is not an SGLang flag)")
        given = {k: getattr(self, k) for k in ("num_steps", "eagle_topk", "num_draft_tokens")}
        if None in given.values():
            if any(v is not None for v in given.values()):
                raise ValueError(
                    f"deploy: num_steps, eagle_topk and num_draft_tokens go together (got "
                    f"{given}); give all three or set all three to null"
                )
            if self.engine == "embedded":
                raise ValueError("deploy: the embedded engine needs num_steps, eagle_topk and "
                                 "num_draft_tokens")
            return self
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"deploy.num_draft_tokens={self.num_draft_tokens} with eagle_topk=1: chain "
                f"drafting needs num_draft_tokens = num_steps + 1 = {self.num_steps + 1}."
            )
        budget = self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
        if self.num_draft_tokens - 1 > budget:
            raise ValueError(
                f"deploy.num_draft_tokens={self.num_draft_tokens}: at most {budget + 1} with "
                f"num_steps={self.num_steps} and eagle_topk={self.eagle_topk} (SGLang crashes on "
                "the first request otherwise)."
            )
        return self


class BenchmarkConfig(StrictModel):
    num_prompts: int = Field(16, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    warmup_prompts: int = Field(1, ge=0)
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1,
                                   description="Served endpoints: requests in flight, a sweep.")
    temperature: float = Field(0.0, ge=0.0, description=(
        "0: greedy, and the embedded engine's outputs must equal plain greedy decoding; "
        ">0: sampled (speculative sampling keeps the target's distribution)."))
    baseline: bool = Field(True, description=(
        "Served endpoints: also measure the target without speculation on the same GPUs "
        "(stops the speculative server first)."))


class PipelineConfig(StrictModel):
    """Everything a run needs. Each stage reads only its own section (plus the target)."""

    run_root: str = "runs/default"
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    merge: MergeConfig = Field(default_factory=MergeConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    fix_keys: FixKeysConfig = Field(default_factory=FixKeysConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML so `x=3`, `x=[1,2]`, `x=true` work."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.epochs=2")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key; check its spelling against examples/tiny.yaml")
        elif e["type"] == "value_error":
            lines.append(f"  {loc}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_config(raw: dict[str, Any], source: str = "config") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(source, err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config, apply overrides, validate. Relative data paths resolve against the
    config file's directory, so a config can be run from anywhere."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    config = parse_config(raw, str(path))
    base = path.resolve().parent
    for src in config.data.sources:
        if not Path(src.path).is_absolute():
            src.path = str((base / src.path).resolve())
    if not Path(config.run_root).is_absolute():
        config.run_root = str(Path.cwd() / config.run_root)
    return config
