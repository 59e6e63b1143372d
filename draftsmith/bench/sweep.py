"""Benchmark sweeps over drafting configs: each point deployed and measured on its own.

A point's result is a small stage directory of its own (`<run_root>/benchmark-point/<key>/`),
keyed by the point, the benchmark settings, the drafter and the inputs, and finished with a
manifest like any stage. So a sweep interrupted at point 5 of 8 resumes at point 5, and
adding a point to the sweep measures only that point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    atomic_write_json,
    finish_stage,
    plan_stage,
    read_descriptor,
    stage_output,
)
from draftsmith.config import BenchmarkConfig, DraftingPoint

log = logging.getLogger(__name__)

POINT_STAGE = "benchmark-point"


def point_plan(run_root: Path, point: DraftingPoint, material: dict[str, Any],
               inputs: list[Descriptor]) -> StagePlan:
    return plan_stage(run_root, POINT_STAGE, {"point": point.model_dump(), **material}, inputs)


def measure_sweep(cfg: BenchmarkConfig, plan: StagePlan, material: dict[str, Any],
                  inputs: list[Descriptor],
                  measure: Callable[[DraftingPoint, Path], dict[str, Any]]) -> list[dict]:
    """Results of every point of cfg.sweep, measured now or read back from an earlier run.
    `measure(point, out_dir)` deploys and measures one point and returns its figures."""
    run_root = plan.dir.parent.parent
    settings = cfg.model_dump(mode="json", exclude={"sweep"})
    results = []
    for i, point in enumerate(cfg.sweep, start=1):
        point_dir = point_plan(run_root, point, {"benchmark": settings, **material}, inputs)
        if point_dir.is_complete():
            log.info("benchmark sweep %d/%d (%s): measured before, reusing %s", i,
                     len(cfg.sweep), point.label, point_dir.dir)
            results.append(read_descriptor(point_dir).figures)
            continue
        log.info("benchmark sweep %d/%d: %s", i, len(cfg.sweep), point.label)
        with stage_output(point_dir) as out:
            figures = measure(point, out)
            atomic_write_json(out / "point.json", figures)
        results.append(finish_stage(point_dir, figures=figures).figures)
    return results
