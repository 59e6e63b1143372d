"""Which settings each stage's cache key covers, and which stages a run executes.

A stage's key covers exactly the settings that change its output, so changing the benchmark
settings re-runs only the benchmark, and new data re-runs everything from generate on. Device
choices are left out on purpose: moving a run to another device must not redo finished work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    external_descriptor,
    hash_json,
    load_descriptor,
    plan_stage,
    sha256_file,
)
from draftsmith.config import STAGES, ConfigError, DataSource, PipelineConfig


def key_material(config: PipelineConfig, stage: str) -> dict[str, Any]:
    dtype = config.target.dtype
    if stage == "generate":
        # Where the server is, how hard it is driven and what it costs change no answer.
        endpoint_operational = {"base_url", "api_key_env", "api_key_secret", "timeout_s",
                                "max_retries", "price_per_1m_prompt_tokens",
                                "price_per_1m_completion_tokens"}
        generate = config.generate.model_dump(exclude={"endpoint": endpoint_operational})
        if generate["endpoint"]:
            for partition in generate["endpoint"]["partitions"]:
                partition.pop("concurrency")
        return {"generate": generate, "target_dtype": dtype,
                "sources": [s.model_dump(exclude={"path"}) for s in config.data.sources]}
    if stage == "merge":
        return {"merge": config.merge.model_dump()}
    if stage == "extract":
        # How many processes, GPUs, writer threads or which server compute the shards does
        # not change their bytes (each shard is computed from the same batches).
        return {"extract": config.extract.model_dump(exclude={
            "data_parallel", "device_map", "writer_queue", "writer_threads", "sglang",
            "vllm"}),
                "target_dtype": dtype}
    if stage == "train":
        material = {"train": config.train.model_dump(
            exclude={"device", "log_every", "checkpoint_every"})}
        if config.train.init_from:  # the drafter's content, not just its path
            material["init_from_files"] = drafter_fingerprint(config.train.init_from)
        return material
    if stage == "fix_keys":
        return {"fix_keys": config.fix_keys.model_dump(),
                "context_length": config.target.context_length}
    if stage == "deploy":  # how long to wait and whether to keep serving change no output
        return {"deploy": config.deploy.model_dump(exclude={"startup_timeout_s", "keep_serving"}),
                "target_dtype": dtype}
    if stage == "benchmark":
        material = {"benchmark": config.benchmark.model_dump(exclude={"prompts_file"}),
                    "target_dtype": dtype}
        if config.benchmark.prompts_file:  # its content, not where it lies
            material["prompts"] = file_fingerprint("benchmark.prompts_file",
                                                   config.benchmark.prompts_file)
        return material
    raise ValueError(f"unknown stage {stage!r}")


def drafter_fingerprint(path: str) -> dict[str, str]:
    """sha256 of every file of a drafter to fine-tune from (a drafter is small enough)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"train.init_from={path}: no such directory (a drafter in the native, "
                          "SGLang, SpecForge or speculators layout)")
    return {f.name: sha256_file(f) for f in sorted(directory.iterdir()) if f.is_file()}


def file_fingerprint(what: str, path: str) -> str:
    """Content hash of an input file; `what` names the setting in the error."""
    try:
        return sha256_file(path)[:16]
    except FileNotFoundError:
        raise ConfigError(f"{what}={path}: file not found") from None


def data_descriptors(config: PipelineConfig) -> list[Descriptor]:
    """Content fingerprints of the source files: new data means new keys downstream."""
    out = []
    for source in config.data.sources:
        if source.hub is not None:
            out.append(external_descriptor("data", source.hub, hub_fingerprint(source)))
            continue
        fingerprint = file_fingerprint(f"data.sources[{source.name}].path", source.path)
        out.append(external_descriptor("data", source.path, fingerprint))
    return out


def hub_fingerprint(source: DataSource) -> str:
    """A local dataset directory is fingerprinted by its files' content; a hub dataset by its
    name, configuration, split and revision (pin the revision to pick up new hub data)."""
    where = Path(source.hub)
    if where.is_dir():
        files = {str(p.relative_to(where)): sha256_file(p)
                 for p in sorted(where.rglob("*")) if p.is_file()}
        return hash_json(files)[:16]
    return hash_json(source.model_dump(include={"hub", "hub_config", "split",
                                                "revision"}))[:16]


def select_stages(only: str | None = None, start: str | None = None,
                  stop: str | None = None) -> list[str]:
    def index(flag: str, name: str) -> int:
        normalised = name.replace("-", "_")
        if normalised not in STAGES:
            raise ConfigError(f"{flag} {name}: unknown stage; choose from "
                              + ", ".join(s.replace("_", "-") for s in STAGES))
        return STAGES.index(normalised)

    if only and (start or stop):
        raise ConfigError("--only cannot be combined with --from/--to")
    if only:
        return [STAGES[index("--only", only)]]
    first = index("--from", start) if start else 0
    last = index("--to", stop) if stop else len(STAGES) - 1
    if first > last:
        raise ConfigError(f"--from {start} comes after --to {stop}")
    return list(STAGES[first : last + 1])


# The outputs each stage reads ("target" is the resolved target model).
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "generate": ("target",),
    "merge": ("generate", "target"),
    "extract": ("merge", "target"),
    "train": ("extract", "merge", "target"),
    "fix_keys": ("train", "target"),
    "deploy": ("fix_keys", "merge", "target"),
    "benchmark": ("deploy", "merge", "target"),
}


def stage_plan(config: PipelineConfig, stage: str, outputs: dict[str, Descriptor]) -> StagePlan:
    """Where `stage` writes, given the descriptors of what it reads."""
    inputs = [outputs[name] for name in STAGE_INPUTS[stage]]
    if stage == "generate":
        inputs += data_descriptors(config)
    return plan_stage(config.run_root, stage, key_material(config, stage), inputs)


def finished_outputs(config: PipelineConfig, target: Descriptor,
                     upto: str) -> dict[str, Descriptor]:
    """Descriptors of the finished stages up to `upto`, read from disk; the error names the
    first stage that is not complete for this config."""
    outputs = {"target": target}
    for stage in STAGES[: STAGES.index(upto) + 1]:
        outputs[stage] = load_descriptor(stage_plan(config, stage, outputs))
    return outputs
