"""Retention: delete a stage's big output once the stage after it has finished with it.

A deleted output leaves a small record (`<run_root>/<stage>/<key>.pruned.json`) with its
descriptor, so the stages downstream keep their keys and stay cached; a later run that has to
execute a stage reading the deleted files recomputes them first (flows/pipeline.py) instead of
failing or pointing at nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from draftsmith.artifacts import Descriptor, StagePlan, atomic_write_json, read_descriptor

log = logging.getLogger(__name__)


def record_path(plan: StagePlan) -> Path:
    return plan.dir.with_name(f"{plan.dir.name}.pruned.json")


def prune(plan: StagePlan, reason: str) -> int:
    """Delete a complete stage directory, keeping its descriptor; returns the bytes freed."""
    if not plan.is_complete():
        return 0
    descriptor = read_descriptor(plan)
    freed = sum(p.stat().st_size for p in plan.dir.rglob("*") if p.is_file())
    # The record first: a crash between the two leaves a directory and a record, never neither.
    atomic_write_json(record_path(plan), {"descriptor": descriptor.model_dump(mode="json"),
                                          "reason": reason})
    shutil.rmtree(plan.dir)
    log.info("retention: deleted %s (%.1f MiB) %s", plan.dir, freed / 2**20, reason)
    return freed


def pruned_descriptor(plan: StagePlan) -> Descriptor | None:
    """The descriptor of an output that retention deleted, or None (never deleted, or since
    recomputed)."""
    record = record_path(plan)
    if plan.is_complete() or not record.is_file():
        return None
    return Descriptor.model_validate(json.loads(record.read_text())["descriptor"])
