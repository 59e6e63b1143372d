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
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    family: Literal["auto", "llama", "qwen", "deepseek", "gpt-oss"] = Field(
        "auto", description="Decides how SGLang reads aux layer ids (REFERENCE.md section 1)."
    )
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs when served by SGLang.")
    context_length: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _no_backend(cls, data: Any) -> Any:
        if isinstance(data, dict) and "backend" in data:
            raise ValueError(
                f"target.backend={data['backend']!r} is not a setting (earlier versions accepted "
                "it and read it nowhere): each stage chooses its own, with generate.backend, "
                "extract.backend and deploy.engine; remove target.backend")
        return data


class DataSource(StrictModel):
    name: str = Field(..., min_length=1)
    path: str | None = Field(None, description="Local JSON/JSONL/Parquet file.")
    hub: str | None = Field(None, description=(
        "A Hugging Face dataset: a hub name the user has access to, or a local dataset "
        "directory; read with datasets.load_dataset."))
    hub_config: str | None = Field(None, description="The hub dataset's configuration (subset).")
    split: str = Field("train", description="The hub dataset's split.")
    revision: str | None = Field(None, description=(
        "Pin the hub dataset's revision: the generate key covers it, so new hub data is picked "
        "up only when the revision changes."))
    format: Literal["auto", "sharegpt", "openai", "trajectory", "prompt"] = "auto"
    limit: int | None = Field(None, ge=1, description="Read at most this many records.")

    @model_validator(mode="after")
    def _one_location(self) -> DataSource:
        if (self.path is None) == (self.hub is None):
            raise ValueError(f"data.sources[{self.name}]: give exactly one of path (a local "
                             "JSON/JSONL/Parquet file) or hub (a dataset name or directory)")
        return self


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


class Partition(StrictModel):
    """Prompts up to max_prompt_tokens share a concurrency limit and a completion budget:
    long prompts hold a server's KV cache longer, so they get fewer requests in flight."""

    max_prompt_tokens: int = Field(..., ge=1)
    concurrency: int = Field(..., ge=1)
    max_tokens: int = Field(..., ge=1, description="Completion tokens per request.")


class EndpointConfig(StrictModel):
    """An OpenAI-compatible chat-completions server (SGLang, vLLM, OpenRouter, transformers
    serve). The API key comes from an environment variable or a Prefect Secret block, never
    from this file."""

    base_url: str = Field(..., min_length=1, description="e.g. http://host:30000/v1")
    model: str = Field(..., min_length=1)
    api_key_env: str | None = Field(None, description="Name of the env var holding the key.")
    api_key_secret: str | None = Field(None, description=(
        "Name of a Prefect Secret block holding the key (resolved by the Prefect task)."))
    timeout_s: float = Field(600.0, gt=0, description="Per request.")
    max_retries: int = Field(6, ge=0, description="On 429, 5xx, timeouts, connection errors.")
    partitions: list[Partition] = Field(
        default_factory=lambda: [Partition(max_prompt_tokens=2048, concurrency=64,
                                           max_tokens=2048),
                                 Partition(max_prompt_tokens=32768, concurrency=8,
                                           max_tokens=4096)],
        min_length=1)
    price_per_1m_prompt_tokens: float | None = Field(None, ge=0.0)
    price_per_1m_completion_tokens: float | None = Field(None, ge=0.0)

    @model_validator(mode="before")
    @classmethod
    def _no_plain_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError(
                "generate.endpoint.api_key: API keys are never read from the config file; put "
                "the key in an environment variable and set generate.endpoint.api_key_env to its "
                "name, or store it in a Prefect Secret block and set "
                "generate.endpoint.api_key_secret")
        return data

    @model_validator(mode="after")
    def _partitions_ascending(self) -> EndpointConfig:
        bounds = [p.max_prompt_tokens for p in self.partitions]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"generate.endpoint.partitions: max_prompt_tokens must be distinct "
                             f"and ascending (got {bounds})")
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
    endpoint: EndpointConfig | None = Field(None, description=(
        "The OpenAI-compatible server that answers (backend: openai only)."))
    max_failure_rate: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Requests that fail after every retry go to errors.jsonl, never into the data; a "
        "larger share than this fails the stage (a rerun retries only those)."))

    @model_validator(mode="after")
    def _endpoint_matches_backend(self) -> GenerateConfig:
        # backend=openai without an endpoint is checked by PipelineConfig: an inference
        # endpoint block (orchestration.endpoint_block) may supply it at run time.
        if self.backend != "openai" and self.endpoint is not None:
            raise ValueError(f"generate.endpoint is set but generate.backend={self.backend!r}; "
                             "set generate.backend=openai or remove generate.endpoint")
        return self


class MergeConfig(StrictModel):
    seed: int = 0
    max_length: int = Field(2048, ge=16)
    validation_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    dedup: bool = True
    near_dedup: bool = Field(True, description=(
        "Also drop records whose text matches another's after case, whitespace and "
        "punctuation are normalised."))
    draft_vocab_size: int = Field(32000, ge=2)


class SGLangCaptureConfig(StrictModel):
    """The capture server for extract.backend=sglang (targets only SGLang can serve)."""

    host: str = "127.0.0.1"
    port: int = Field(30100, ge=1, le=65535)
    url: str | None = Field(None, description=(
        "Use a capture server that is already running (started with the launch command "
        "`draftsmith` prints) instead of starting one."))
    concurrency: int = Field(8, ge=1, description="Requests in flight.")
    dump_dir: str | None = Field(None, description=(
        "Where the server writes per-request dumps; must be local to the server and to this "
        "process. Default: <extract output>/dumps."))
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    extra_args: list[str] = Field(default_factory=list, description="Passed to SGLang as is.")
    env: dict[str, str] = Field(default_factory=dict)
    sglang_command: list[str] | None = None
    startup_timeout_s: float = Field(1800.0, gt=0)
    dump_timeout_s: float = Field(120.0, gt=0, description=(
        "How long to wait for a request's dump after its response."))


class ExtractConfig(StrictModel):
    backend: Literal["transformers", "sglang"] = "transformers"
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Canonical ids (output of decoder layer i). Default [1, L//2-1, L-4].",
    )
    batch_size: int = Field(8, ge=1)
    batch_tokens: int | None = Field(None, ge=1, description=(
        "Cap on padded tokens (samples x longest) per forward pass; samples are bucketed by "
        "length, so batches pad little. null: batch_size alone decides."))
    shard_tokens: int = Field(1 << 16, ge=1, description=(
        "Tokens per safetensors shard (65536 tokens of a Llama-8B target are ~2 GiB; host "
        "memory holds about writer_queue + writer_threads shards)."))
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    data_parallel: int = Field(1, ge=1, description=(
        "Processes, one per GPU, each extracting its share of the shards (spawned here; under "
        "torchrun the world comes from its environment instead)."))
    device_map: str | None = Field(None, description=(
        "transformers device_map (e.g. 'auto') for a target that does not fit one GPU; "
        "exclusive with data_parallel > 1."))
    writer_queue: int = Field(2, ge=1, description="Shards waiting for the disk writers.")
    writer_threads: int = Field(2, ge=1)
    sglang: SGLangCaptureConfig = Field(default_factory=SGLangCaptureConfig)

    @model_validator(mode="after")
    def _check_parallel(self) -> ExtractConfig:
        if self.device_map is not None and self.data_parallel > 1:
            raise ValueError(
                f"extract.device_map={self.device_map!r} with extract.data_parallel="
                f"{self.data_parallel}: a model sharded over the GPUs runs in one process; set "
                "data_parallel=1 (or device_map=null for one model copy per GPU)")
        return self


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
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every process holds the whole drafter, gradients all-reduced; "
        "fsdp: parameters, gradients and AdamW state sharded over the processes (big drafters).")

    @model_validator(mode="after")
    def _step_weights_match_steps(self) -> TrainConfig:
        if self.step_weights is not None and len(self.step_weights) != self.ttt_steps:
            raise ValueError(f"train.step_weights has {len(self.step_weights)} entries but "
                             f"ttt_steps is {self.ttt_steps}: give one weight per step")
        return self

    @model_validator(mode="after")
    def _parallel_fits_device(self) -> TrainConfig:
        kind, _, index = self.device.partition(":")
        if self.parallel == "fsdp" and kind not in ("cuda", "cpu"):
            raise ValueError(f"train.parallel=fsdp with train.device={self.device}: FSDP shards "
                             "over NCCL (cuda) or gloo (cpu); set train.device to cuda or cpu, "
                             "or train.parallel=ddp")
        if kind == "cuda" and index and self.nproc_per_node > 1:
            raise ValueError(f"train.device={self.device} names one GPU, but each of the "
                             f"{self.nproc_per_node} processes (train.nproc_per_node) takes its "
                             "own (rank r: cuda:r); set train.device=cuda and choose the GPUs "
                             "with CUDA_VISIBLE_DEVICES")
        return self


class FixKeysConfig(StrictModel):
    format: Literal["sglang", "speculators"] = Field(
        "sglang", description="sglang: SGLang / EAGLE / SpecForge layout; speculators: vLLM.")
    speculative_tokens: int = Field(3, ge=1, description="Written into a speculators config.")


def check_drafting(where: str, num_steps: int, eagle_topk: int, num_draft_tokens: int) -> None:
    """SGLang's constraints on a drafting config, checked before anything is launched."""
    if eagle_topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(
            f"{where}.num_draft_tokens={num_draft_tokens} with eagle_topk=1: chain "
            f"drafting needs num_draft_tokens = num_steps + 1 = {num_steps + 1}."
        )
    budget = eagle_topk + (num_steps - 1) * eagle_topk**2
    if num_draft_tokens - 1 > budget:
        raise ValueError(
            f"{where}.num_draft_tokens={num_draft_tokens}: at most {budget + 1} with "
            f"num_steps={num_steps} and eagle_topk={eagle_topk} (SGLang crashes on "
            "the first request otherwise)."
        )


# SGLang 0.5.23 (arg_groups/speculative_hook.py, _handle_eagle_family): an EAGLE server
# started without --max-running-requests runs at most 48 requests at once.
SGLANG_SPECULATIVE_MAX_RUNNING_REQUESTS = 48
# Same file: eagle_topk > 1 with a page size above 1 runs only on these attention backends;
# and arg_groups/overrides.py: these backends force a page size above 1 (FlashMLA 64, the
# TRT-LLM and CuteDSL MLA kernels 32 or 64, ...).
TREE_WITH_PAGES_BACKENDS = ("flashinfer", "fa3", "triton")
PAGED_BACKENDS = ("flashmla", "trtllm_mla", "cutedsl_mla", "hpc_ops", "trtllm_mha")


def sglang_flag(args: list[str], *names: str) -> str | None:
    """The value of the last `--name V` or `--name=V` among SGLang arguments."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def check_tree_attention(where: str, eagle_topk: int, extra_args: list[str]) -> None:
    """SGLang refuses eagle_topk > 1 on a paged attention backend other than flashinfer, fa3
    or triton (the paged MLA kernels cannot draw a tree): refuse it before a launch."""
    if eagle_topk <= 1:
        return
    backend = sglang_flag(extra_args, "--attention-backend")
    prefill = sglang_flag(extra_args, "--prefill-attention-backend")
    if prefill is not None and prefill == sglang_flag(extra_args, "--decode-attention-backend"):
        backend = prefill  # SGLang then serves both phases with it
    page_size = int(sglang_flag(extra_args, "--page-size") or 1)
    if backend in PAGED_BACKENDS:
        page_size = max(page_size, 32)
    if backend is not None and page_size > 1 and backend not in TREE_WITH_PAGES_BACKENDS:
        raise ValueError(
            f"{where}.eagle_topk={eagle_topk} with attention backend {backend!r} (page size "
            f"{page_size}, from deploy.extra_args): SGLang runs tree drafting on paged KV only "
            f"with {', '.join(TREE_WITH_PAGES_BACKENDS)} and refuses to start. Use "
            "eagle_topk=1 for this point, or one of those backends.")


class DraftingPoint(StrictModel):
    """One drafting config of a benchmark sweep (SGLang's three speculative flags)."""

    num_steps: int = Field(ge=1)
    eagle_topk: int = Field(ge=1)
    num_draft_tokens: int = Field(ge=2)

    @model_validator(mode="after")
    def _check(self) -> DraftingPoint:
        check_drafting("benchmark.sweep[]", self.num_steps, self.eagle_topk,
                       self.num_draft_tokens)
        return self

    @property
    def label(self) -> str:
        if self.eagle_topk == 1:
            return f"chain {self.num_steps}"
        return f"tree {self.num_steps}x{self.eagle_topk}/{self.num_draft_tokens}"


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
    max_running_requests: int | None = Field(None, ge=1, description=(  # keyed
        "Requests SGLang runs at once, passed to the speculative server and to the "
        "benchmark's baseline alike; default 48, what SGLang gives an EAGLE server when it "
        "is unset (a plain server is uncapped, which would understate the speedup)."))
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
        if sglang_flag(self.extra_args, "--max-running-requests") is not None:
            raise ValueError("deploy.extra_args: set deploy.max_running_requests instead of "
                             "--max-running-requests (the baseline server gets the same)")
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
        check_drafting("deploy", self.num_steps, self.eagle_topk, self.num_draft_tokens)
        if self.engine == "sglang":
            check_tree_attention("deploy", self.eagle_topk, self.extra_args)
        return self


class BenchmarkConfig(StrictModel):
    prompts_file: str | None = Field(None, description=(
        "Held-out prompts from a file in any data format (ShareGPT, OpenAI messages, "
        "trajectories, prompt-only); default: the validation split of the merged data."))
    num_prompts: int = Field(16, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    warmup_prompts: int = Field(1, ge=0)
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1,
                                   description="Served endpoints: requests in flight, a sweep.")
    temperature: float = Field(0.0, ge=0.0, description=(
        "0: greedy, and the embedded engine's outputs must equal plain greedy decoding; "
        ">0: sampled (speculative sampling keeps the target's distribution)."))
    sampled_temperature: float | None = Field(None, gt=0.0, description=(
        "Also measure the deployed config sampled at this temperature (e.g. 0.7), next to the "
        "greedy run: acceptance usually drops when sampling."))
    baseline: bool = Field(True, description=(
        "Served endpoints: also measure the target without speculation on the same GPUs "
        "(stops the speculative server first)."))
    sweep: list[DraftingPoint] = Field(default_factory=list, description=(
        "More drafting configs to compare with the deployed one, e.g. num_draft_tokens "
        "16/10/5 and topk 1 vs 4. Each point gets its own deploy and its own cached result, so "
        "an interrupted sweep resumes at the first point not yet measured."))


class OrchestrationConfig(StrictModel):
    """Where the stages run. Changes no stage's output, so no cache key covers it."""

    mode: Literal["local", "distributed"] = Field("local", description=(
        "local: every stage in this process; distributed: GPU stages run as deployments on the "
        "gpu work pool (draftsmith prefect setup creates them), the rest here."))
    gpu_deployment: str = Field("gpu", description=(
        "Deployment name of the GPU stage flows (draftsmith-<stage>/<name>)."))
    gpu_host: str = Field("gpu-host", description=(
        "GPU host block: its GPUs size the concurrency limit GPU stages take."))
    stage_timeout_s: float | None = Field(None, gt=0, description=(
        "Fail a GPU stage whose child run has not finished after this long (e.g. its worker "
        "died); none waits for ever."))
    poll_interval_s: float = Field(2.0, gt=0, description="How often to poll a child run.")
    endpoint_block: str | None = Field(None, description=(
        "Inference endpoint block that fills generate.endpoint (base URL, model, API key)."))


class RetentionConfig(StrictModel):
    """Big intermediate outputs to delete once the next stage no longer needs them. A later run
    that needs deleted files recomputes them."""

    delete_generations_after_merge: bool = False
    delete_hidden_states_after_train: bool = Field(False, description=(
        "Hidden-state stores run to terabytes on real targets."))


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
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)

    @model_validator(mode="after")
    def _endpoint_given(self) -> PipelineConfig:
        if (self.generate.backend == "openai" and self.generate.endpoint is None
                and not self.orchestration.endpoint_block):
            raise ValueError(
                "generate.backend=openai needs generate.endpoint (base_url, model, partitions, "
                "...; see examples/kimi-k2.5-8gpu.yaml) or orchestration.endpoint_block (an "
                "inference endpoint block registered by draftsmith prefect setup)")
        return self

    @model_validator(mode="after")
    def _sweep_launches_on_sglang(self) -> PipelineConfig:
        if self.deploy.engine == "sglang":  # each point is served with deploy.extra_args
            for i, point in enumerate(self.benchmark.sweep):
                check_tree_attention(f"benchmark.sweep[{i}]", point.eagle_topk,
                                     self.deploy.extra_args)
        return self


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
        if src.path is not None and not Path(src.path).is_absolute():
            src.path = str((base / src.path).resolve())
        if src.hub is not None and not Path(src.hub).is_absolute() and (base / src.hub).is_dir():
            src.hub = str((base / src.hub).resolve())  # a local dataset directory
    if not Path(config.run_root).is_absolute():
        config.run_root = str(Path.cwd() / config.run_root)
    return config


class DatasetUpdate(StrictModel):
    """New data for one source (the payload of a draftsmith.dataset.updated event)."""

    source: str = Field(..., min_length=1, description="data.sources name; a new name adds one.")
    path: str = Field(..., min_length=1, description="The dataset file to read from now on.")


def with_source(config: PipelineConfig, name: str, path: str) -> PipelineConfig:
    """The config with data source `name` read from `path` (a new source when none has that
    name): what a new-data event asks for."""
    raw = config.model_dump(mode="json")
    sources = raw["data"]["sources"]
    match = [s for s in sources if s["name"] == name]
    if match:
        match[0]["path"] = path
    else:
        sources.append({"name": name, "path": path})
    return parse_config(raw, f"dataset update {name}={path}")
