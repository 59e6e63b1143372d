"""Preflight for the stages that use GPUs: the GPUs are free and the disk has room.

Which GPUs a stage uses: those in CUDA_VISIBLE_DEVICES when it is set (a GPU work pool's job
variables set it), all of them when the stage's device is CUDA, none otherwise. Disk room is
checked against an estimate of what the stage will write; extract's store, which dominates
(the seeds' 87.8M tokens took ~4.6 TB), has its own check with the breakdown of its estimate
(draftsmith/extract/preflight.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.artifacts import Descriptor, StagePlan
from draftsmith.config import GenerateConfig
from draftsmith.diskspace import free_bytes
from draftsmith.errors import InputError
from draftsmith.figures import TargetFigures
from draftsmith.serve.gpus import require_free_gpus

# Room a stage needs beyond its estimate: logs, temp files written before a rename.
MARGIN_BYTES = 256 << 20


class PreflightError(InputError, RuntimeError):
    pass


def stage_gpus(device: str) -> list[str] | None | bool:
    """The GPU indices the stage will use, None for all of them, False for none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
        return gpus or False
    return None if device.startswith("cuda") else False


def require_free_stage_gpus(stage: str, device: str) -> None:
    """Raise naming every other process that holds one of this stage's GPUs."""
    gpus = stage_gpus(device)
    if gpus is not False:
        require_free_gpus(gpus, stage)


def require_disk_room(stage: str, plan: StagePlan, needed_bytes: int) -> None:
    free = free_bytes(plan.dir)
    needed = needed_bytes + MARGIN_BYTES
    if free < needed:
        raise PreflightError(
            f"{stage}: needs about {needed / 2**30:.2f} GiB under {plan.dir.parent} (estimate "
            f"{needed_bytes / 2**30:.2f} GiB plus a {MARGIN_BYTES >> 20} MiB margin) but only "
            f"{free / 2**30:.2f} GiB is free; free space there or point run_root at a bigger "
            "disk (the GPU host block's scratch path)")


def check_stage(plan: StagePlan, device: str, needed_bytes: int = 0) -> None:
    """Everything a GPU stage needs before it starts: free GPUs, disk room."""
    require_free_stage_gpus(plan.stage, device)
    require_disk_room(plan.stage, plan, needed_bytes)


def generate_bytes(cfg: GenerateConfig, source_paths: list[str]) -> int:
    """Generations: about the input again plus the answers (a token is ~4 bytes of text)."""
    inputs = sum(Path(p).stat().st_size for p in source_paths if Path(p).is_file())
    return 2 * inputs


def train_bytes(target: Descriptor, draft_vocab_size: int) -> int:
    """Drafter checkpoints (best and last) in float32: one decoder layer, fc, head."""
    hidden = TargetFigures.of(target).hidden_size
    params = 16 * hidden * hidden + draft_vocab_size * hidden
    return 2 * 4 * params
