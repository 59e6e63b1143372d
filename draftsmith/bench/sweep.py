"""Benchmark sweeps over drafting configs: each point deployed and measured on its own.

A point's result is a small stage directory of its own (`<run_root>/benchmark-point/<key>/`),
keyed by the point, the benchmark settings, the drafter and the inputs, and finished with a
manifest like any stage. So a sweep interrupted at point 5 of 8 resumes at point 5, and
adding a point to the sweep measures only that point (`parts.measured_once`, as for the
embedded benchmark's own parts).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.artifacts import Descriptor, StagePlan
from draftsmith.bench.parts import measured_once
from draftsmith.config import BenchmarkConfig, DraftingPoint

POINT_STAGE = "benchmark-point"


def measure_sweep(cfg: BenchmarkConfig, plan: StagePlan, material: dict[str, Any],
                  inputs: list[Descriptor],
                  measure: Callable[[DraftingPoint, Path], dict[str, Any]]) -> list[dict]:
    """Results of every point of cfg.sweep, measured now or read back from an earlier run.
    `measure(point, out_dir)` deploys and measures one point and returns its figures."""
    run_root = plan.dir.parent.parent
    settings = cfg.model_dump(mode="json", exclude={"sweep"})
    results = []
    for i, point in enumerate(cfg.sweep, start=1):
        label = f"benchmark sweep {i}/{len(cfg.sweep)} ({point.label})"
        results.append(measured_once(
            run_root, POINT_STAGE,
            {"point": point.model_dump(), "benchmark": settings, **material}, inputs, label,
            lambda out, point=point: measure(point, out), file="point.json"))
    return results
