"""Stage outputs on disk: content-addressed directories, manifests written last, descriptors.

Every stage writes into `<run_root>/<stage>/<key>/`. The key hashes the stage's config, the
fingerprints of its inputs and FORMAT_VERSION, so new data or new settings land in a new
directory and old results stay valid. A directory is complete only once `manifest.json` exists;
it is written last and atomically, so a crash leaves a directory without a manifest, which the
next run clears and redoes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from draftsmith.diskspace import writing, writing_into
from draftsmith.stage_cost import StageCost, cost_now


def cache_root() -> Path:
    """Where draftsmith keeps what outlives a run (built targets, file digests):
    DRAFTSMITH_CACHE, or ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))

# Bump when an on-disk format changes: every stage key changes with it, so old outputs are
# never read by code that expects the new format.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class Descriptor(BaseModel):
    """What a stage hands to the next: where its output is and what it contains. Small JSON."""

    stage: str
    path: str
    key: str
    fingerprint: str
    counts: dict[str, int] = {}
    figures: dict[str, Any] = {}
    cost: StageCost | None = None  # what making it took (draftsmith/stage_cost.py)

    @property
    def dir(self) -> Path:
        return Path(self.path)


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def hash_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp name in the same directory, fsync, rename: readers see all or nothing.
    A full disk raises DiskFullError naming the file and its size, and leaves no temp file."""
    path = Path(path)
    with writing(path, len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with writing(path, len(data), partial=tmp), os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    atomic_write_bytes(path, text.encode())


@contextmanager
def atomic_path(path: str | Path, size: int | None = None) -> Iterator[Path]:
    """Yield a temp path for a writer that wants a file name (torch.save, safetensors); the file
    appears under `path` only if the block succeeds. size: what the write needs, in bytes, if
    known: a full disk raises DiskFullError naming the file and it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with writing(path, size, partial=tmp):
            path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a (nested) state dict: what saving it needs, near enough."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.element_size() * obj.numel()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class StagePlan(BaseModel):
    """Where a stage will write, decided before it runs (the Prefect cache key is `key`).
    `material` and `input_fingerprints` are what the key hashes, kept in the manifest so that
    `draftsmith plan` can say what changed since an earlier output."""

    stage: str
    key: str
    path: str
    material: dict[str, Any] | None = None
    input_fingerprints: dict[str, Any] | None = None

    @property
    def dir(self) -> Path:
        return Path(self.path)

    def is_complete(self) -> bool:
        return (self.dir / MANIFEST).is_file()


def plan_stage(
    run_root: str | Path, stage: str, config: BaseModel | dict | None, inputs: list[Descriptor]
) -> StagePlan:
    material = {
        "stage": stage,
        "format_version": FORMAT_VERSION,
        "config": config.model_dump(mode="json") if isinstance(config, BaseModel) else config,
        "inputs": sorted(d.fingerprint for d in inputs),
    }
    key = hash_json(material)[:16]
    return StagePlan(stage=stage, key=key, path=str(Path(run_root) / stage / key))


def read_descriptor(plan: StagePlan) -> Descriptor:
    manifest = json.loads((plan.dir / MANIFEST).read_text())
    return Descriptor.model_validate(manifest["descriptor"])


def load_descriptor(plan: StagePlan) -> Descriptor:
    """The descriptor of a finished stage, or a clear error saying which stage to run first."""
    if not plan.is_complete():
        raise FileNotFoundError(
            f"stage {plan.stage!r} has no complete output at {plan.dir} for this config; "
            f"run it first (draftsmith run CONFIG --to {plan.stage})"
        )
    return read_descriptor(plan)


@contextmanager
def stage_output(plan: StagePlan) -> Iterator[Path]:
    """Give a stage an empty directory to fill. Leftovers of a crashed attempt are removed. A
    write into it that finds the disk full raises DiskFullError naming it."""
    if plan.is_complete():
        raise RuntimeError(f"{plan.dir} is already complete; refusing to overwrite it")
    if plan.dir.exists():
        shutil.rmtree(plan.dir)
    with writing_into(plan.dir, f"{plan.stage}'s output in"):
        plan.dir.mkdir(parents=True)
        yield plan.dir


def finish_stage(
    plan: StagePlan,
    counts: dict[str, int] | None = None,
    figures: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    known_checksums: dict[str, str] | None = None,
    leave_out: str | None = None,
) -> Descriptor:
    """Checksum every file the stage wrote, then write the manifest last, atomically, with
    what the output cost to make (its seconds and GPU peak when a measured stage runs, and its
    bytes on disk: draftsmith/stage_cost.py).

    known_checksums: sha256 of files the stage hashed as it wrote them (hidden-state shards
    run to terabytes; reading them all a second time would cost hours). leave_out: a
    subdirectory that is not part of the output (training's resume state, deleted once the
    manifest is written, so that a manifest that fails to be written leaves it to resume
    from)."""
    known = known_checksums or {}
    files, disk_bytes = {}, 0
    for p in sorted(plan.dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith("."):
            name = str(p.relative_to(plan.dir))
            if leave_out is not None and p.relative_to(plan.dir).parts[0] == leave_out:
                continue
            files[name] = known.get(name) or sha256_file(p)
            disk_bytes += p.stat().st_size
    fingerprint = hash_json({"stage": plan.stage, "files": files})[:16]
    descriptor = Descriptor(
        stage=plan.stage,
        path=str(plan.dir),
        key=plan.key,
        fingerprint=fingerprint,
        counts=counts or {},
        figures=figures or {},
        cost=cost_now(disk_bytes),
    )
    record = {"descriptor": descriptor.model_dump(mode="json"), "files": files, **(extra or {})}
    if plan.material is not None:
        record["key_material"] = {"config": plan.material, "inputs": plan.input_fingerprints}
    atomic_write_json(plan.dir / MANIFEST, record)
    return descriptor


def external_descriptor(
    stage: str, path: str | Path, fingerprint: str, **figures: Any
) -> Descriptor:
    """Describe an input that no stage wrote (a target model, a data file)."""
    return Descriptor(stage=stage, path=str(path), key=fingerprint, fingerprint=fingerprint,
                      figures=figures)
