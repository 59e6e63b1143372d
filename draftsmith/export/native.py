"""draftsmith's native drafter checkpoint: safetensors + draftsmith.json with full provenance.

The target's embedding is not stored (it is the target's, frozen); loading copies it back in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftsmith.artifacts import atomic_path, atomic_write_json
from draftsmith.model.eagle3 import Eagle3Config, Eagle3Drafter

WEIGHTS_FILE = "drafter.safetensors"
META_FILE = "draftsmith.json"
NATIVE_FORMAT = "draftsmith-eagle3"
NOT_STORED = ("embed_tokens.weight",)


def save_native(drafter: Eagle3Drafter, out_dir: str | Path, provenance: dict[str, Any],
                tensors: dict[str, torch.Tensor] | None = None) -> None:
    """The drafter's weights (or `tensors`, e.g. gathered whole from FSDP shards), its config
    and provenance."""
    out_dir = Path(out_dir)
    if tensors is None:
        tensors = drafter.state_dict()
    state = {k: v.detach().cpu().contiguous() for k, v in tensors.items() if k not in NOT_STORED}
    with atomic_path(out_dir / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp))
    atomic_write_json(out_dir / META_FILE, {
        "format": NATIVE_FORMAT,
        "config": drafter.config.model_dump(),
        "provenance": provenance,
    })


def read_native_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    meta = json.loads((Path(ckpt_dir) / META_FILE).read_text())
    if meta.get("format") != NATIVE_FORMAT:
        raise ValueError(f"{ckpt_dir}: not a native draftsmith checkpoint ({META_FILE} says "
                         f"format={meta.get('format')!r})")
    return meta


def load_native(ckpt_dir: str | Path, embed: torch.Tensor) -> Eagle3Drafter:
    meta = read_native_meta(ckpt_dir)
    drafter = Eagle3Drafter(Eagle3Config.model_validate(meta["config"]))
    state = load_file(str(Path(ckpt_dir) / WEIGHTS_FILE))
    state["embed_tokens.weight"] = embed
    drafter.load_state_dict(state, strict=True)
    return drafter.eval()
