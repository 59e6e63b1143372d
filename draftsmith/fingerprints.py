"""Content fingerprints of a run's inputs that no stage wrote: data source files, a drafter to
fine-tune from, a benchmark prompts file, the target's files. Keys hash content, never paths,
so moving a file changes nothing and editing it re-runs what reads it.

A file's digest is remembered by the file's identity (device, inode, size, modification and
change times): a run whose inputs did not change reads none of them again, and a file that was
written, replaced, touched or copied since has another identity and is hashed again. The
remembered digests live in `<DRAFTSMITH_CACHE>/file-digests.json`; deleting it is always safe.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from draftsmith.artifacts import (
    Descriptor,
    atomic_write_json,
    cache_root,
    external_descriptor,
    hash_json,
    sha256_file,
)
from draftsmith.config import ConfigError, DataSource, PipelineConfig

DIGESTS_FILE = "file-digests.json"
_remembered: dict[str, list] | None = None


def _digests_path() -> Path:
    return cache_root() / DIGESTS_FILE


def identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def remembered_digest(path: str | Path, compute: Callable[[Path], str] = sha256_file,
                      kind: str = "sha256") -> str:
    """compute(path), read from the remembered digests while the file keeps its identity."""
    global _remembered
    path = Path(path).resolve()
    now = identity(path)  # FileNotFoundError for a missing file, as compute would raise
    if _remembered is None:
        try:
            _remembered = json.loads(_digests_path().read_text())
        except (OSError, ValueError):
            _remembered = {}
    entry = f"{kind}:{path}"
    known = _remembered.get(entry)
    if known is not None and known[0] == now:
        return known[1]
    digest = compute(path)
    _remembered[entry] = [now, digest]
    with contextlib.suppress(OSError):  # a read-only cache only costs the hashing next time
        atomic_write_json(_digests_path(), _remembered)
    return digest


def drafter_fingerprint(path: str) -> dict[str, str]:
    """sha256 of every file of a drafter to fine-tune from (a drafter is small enough)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"train.init_from={path}: no such directory (a drafter in the native, "
                          "SGLang, SpecForge or speculators layout)")
    return {f.name: remembered_digest(f) for f in sorted(directory.iterdir()) if f.is_file()}


def file_fingerprint(what: str, path: str) -> str:
    """Content hash of an input file; `what` names the setting in the error."""
    try:
        return remembered_digest(path)[:16]
    except FileNotFoundError:
        raise ConfigError(f"{what}={path}: file not found") from None


def data_descriptors(config: PipelineConfig) -> list[Descriptor]:
    """Content fingerprints of the source files: new data means new keys downstream."""
    out = []
    for source in config.data.sources:
        if source.synthesize is not None:  # written by the target: the generate key covers it
            out.append(external_descriptor("data", f"synthesize:{source.name}", hash_json(
                source.synthesize.model_dump(mode="json"))[:16]))
            continue
        if source.builtin is not None:
            from draftsmith.data.packaged import builtin_fingerprint

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


def watched_files(config: PipelineConfig) -> dict[str, dict[str, str]]:
    """What the data watcher compares between two looks (flows/watch_data.py): for each
    source read from a file, the file and its content fingerprint. A file that is gone is
    left out (the run that reads it names it)."""
    out = {}
    for source in config.data.sources:
        if source.path is None:
            continue
        with contextlib.suppress(FileNotFoundError):
            out[source.name] = {"path": str(source.path),
                                "fingerprint": remembered_digest(source.path)[:16]}
    return out


def changed_files(seen: dict[str, dict[str, str]], now: dict[str, dict[str, str]]) -> list[str]:
    """The sources whose file has other content now than at the last look, at the same path.
    A source seen for the first time, or read from another file since (a new-data update, which
    started its own run), is not a change: the look only records it."""
    return [name for name, state in now.items()
            if name in seen and seen[name].get("path") == state["path"]
            and seen[name].get("fingerprint") != state["fingerprint"]]
