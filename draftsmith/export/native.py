"""draftsmith's native drafter checkpoint: safetensors + draftsmith.json with full provenance.

The target's embedding is not stored (it is the target's, frozen); loading copies it back in.
Every read is guarded: a damaged file is an ExportError naming it, what is wrong and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from draftsmith.artifacts import atomic_path, atomic_write_json, tensor_bytes
from draftsmith.export.formats import ExportError
from draftsmith.model.kinds import (
    KINDS,
    Drafter,
    DrafterShape,
    build_drafter,
    kind_of,
    kind_of_native_format,
)

WEIGHTS_FILE = "drafter.safetensors"
META_FILE = "draftsmith.json"
NATIVE_FORMAT = "draftsmith-eagle3"  # an EAGLE-3 drafter's; each kind names its own
NOT_STORED = ("embed_tokens.weight",)
# What to do about a damaged native checkpoint: it is written by train and import.
REMAKE = ("write it again: rerun the train stage (or `draftsmith import` the drafter again), or "
          "copy it again if it was copied")


def read_json_file(path: Path, fix: str) -> dict[str, Any]:
    """A JSON object from a checkpoint file, or an ExportError naming the file and `fix`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path}: missing; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{path}: not valid JSON ({err}), the file is truncated or damaged; "
                          f"{fix}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: holds a JSON {type(data).__name__}, expected an object; "
                          f"{fix}")
    return data


def read_safetensors(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or an ExportError naming the file and `fix`."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        size = Path(path).stat().st_size if Path(path).is_file() else 0
        raise ExportError(f"{path} ({size} bytes): not a readable safetensors file ({err}); it "
                          f"is truncated or damaged: {fix}") from None


def safetensors_keys(path: Path, fix: str) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ExportError(f"{path}: not a readable safetensors file ({err}); it is truncated "
                          f"or damaged: {fix}") from None


def config_of(meta: dict[str, Any], where: Path) -> DrafterShape:
    """The drafter's shape, as the config class of the kind its format names."""
    if "config" not in meta:
        raise ExportError(f"{where}: no 'config' key (the drafter's shape); {REMAKE}")
    kind = kind_of_native_format(meta.get("format"))
    try:
        return kind.config.model_validate(meta["config"])
    except ValidationError as err:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) + f" ({e['msg']})"
                           for e in err.errors())
        raise ExportError(f"{where}: 'config' is not a drafter config: {fields}; {REMAKE}"
                          ) from None


def save_native(drafter: Drafter, out_dir: str | Path, provenance: dict[str, Any],
                tensors: dict[str, torch.Tensor] | None = None) -> None:
    """The drafter's weights (or `tensors`, e.g. gathered whole from FSDP shards), its config
    and provenance."""
    out_dir = Path(out_dir)
    if tensors is None:
        tensors = drafter.state_dict()
    state = {k: v.detach().cpu().contiguous() for k, v in tensors.items() if k not in NOT_STORED}
    with atomic_path(out_dir / WEIGHTS_FILE, tensor_bytes(state)) as tmp:
        save_file(state, str(tmp))
    atomic_write_json(out_dir / META_FILE, {
        "format": kind_of(drafter).native_format,
        "config": drafter.config.model_dump(),
        "provenance": provenance,
    })


def read_native_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    meta = read_json_file(Path(ckpt_dir) / META_FILE, REMAKE)
    if kind_of_native_format(meta.get("format")) is None:
        formats = sorted(kind.native_format for kind in KINDS.values())
        raise ExportError(f"{ckpt_dir}: not a native draftsmith checkpoint ({META_FILE} says "
                          f"format={meta.get('format')!r}, expected one of {formats})")
    return meta


def load_native(ckpt_dir: str | Path, embed: torch.Tensor) -> Drafter:
    meta = read_native_meta(ckpt_dir)
    drafter = build_drafter(config_of(meta, Path(ckpt_dir) / META_FILE))
    weights = Path(ckpt_dir) / WEIGHTS_FILE
    state = read_safetensors(weights, REMAKE)
    state["embed_tokens.weight"] = embed
    result = drafter.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ExportError(f"{weights}: tensors do not fit its {META_FILE}: missing "
                          f"{result.missing_keys}, unexpected {result.unexpected_keys}; {REMAKE}")
    return drafter.eval()
