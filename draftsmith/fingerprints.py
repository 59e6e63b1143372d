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

from draftsmith.artifacts import atomic_write_json, cache_root, sha256_file
from draftsmith.config import ConfigError, PipelineConfig

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


def drafter_fingerprint(path: str, setting: str = "train.init_from") -> dict[str, str]:
    """sha256 of every file of a drafter made elsewhere (a drafter is small enough), given as
    `setting` (train.init_from: fine-tuned from; deploy.drafter: deployed)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{setting}={path}: no such directory (a drafter in the native, "
                          "SGLang, SpecForge or speculators layout)")
    return {f.name: remembered_digest(f) for f in sorted(directory.iterdir()) if f.is_file()}


def file_fingerprint(what: str, path: str) -> str:
    """Content hash of an input file; `what` names the setting in the error."""
    try:
        return remembered_digest(path)[:16]
    except FileNotFoundError:
        raise ConfigError(f"{what}={path}: file not found") from None


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
