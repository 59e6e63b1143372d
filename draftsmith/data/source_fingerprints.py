"""Content fingerprints of a run's data sources: new data means new keys downstream.

A source file or a local dataset directory is fingerprinted by its content (remembered by the
file's identity, draftsmith/fingerprints.py), a packaged source by its package's data, a hub
dataset by its name and revision, and prompts the target writes itself by their settings.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.artifacts import Descriptor, external_descriptor, hash_json
from draftsmith.config import DataSource, PipelineConfig
from draftsmith.data.packaged import builtin_fingerprint
from draftsmith.fingerprints import file_fingerprint, remembered_digest


def data_descriptors(config: PipelineConfig) -> list[Descriptor]:
    """Content fingerprints of the source files: new data means new keys downstream."""
    out = []
    for source in config.data.sources:
        if source.synthesize is not None:  # written by the target: the generate key covers it
            out.append(external_descriptor("data", f"synthesize:{source.name}", hash_json(
                source.synthesize.model_dump(mode="json"))[:16]))
            continue
        if source.builtin is not None:
            out.append(external_descriptor("data", f"builtin:{source.builtin}",
                                           builtin_fingerprint(source.builtin, source.limit,
                                                               source.instruction)))
            continue
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
        files = {str(p.relative_to(where)): remembered_digest(p)
                 for p in sorted(where.rglob("*")) if p.is_file()}
        return hash_json(files)[:16]
    return hash_json(source.model_dump(include={"hub", "hub_config", "split",
                                                "revision"}))[:16]


def data_version(data: list[Descriptor]) -> str:
    """A short name for the data a run reads: the hash of its sources' fingerprints, in order."""
    return hash_json([d.fingerprint for d in data])[:8]
