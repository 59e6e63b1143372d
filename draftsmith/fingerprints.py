"""Content fingerprints of a run's inputs that no stage wrote: data source files, a drafter to
fine-tune from, a benchmark prompts file. Keys hash content, never paths, so moving a file
changes nothing and editing it re-runs what reads it."""

from __future__ import annotations

from pathlib import Path

from draftsmith.artifacts import Descriptor, external_descriptor, hash_json, sha256_file
from draftsmith.config import ConfigError, DataSource, PipelineConfig


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
