"""The benchmark stage's measurements, each kept on disk the moment it is finished.

A benchmark decodes for minutes (hours on a CPU): one prompt at a time, then each batch size,
a sampled run, every point of a sweep. Each of those parts is a small stage directory of its
own (`<run_root>/benchmark-part/<key>/`; a sweep point's under `benchmark-point/`), keyed by
what it measures, the settings that decide it, the drafter, the inputs and the device it ran
on, and finished with a manifest like any stage. So a benchmark cut off after batch 4 keeps
batch 1 and batch 4, running it again measures only what is missing, and adding a batch size
to a finished benchmark measures only that size. A part measured on another GPU model is
measured again: one report's figures come from one kind of device.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    atomic_write_json,
    finish_stage,
    plan_stage,
    stage_output,
)
from draftsmith.config import BenchmarkConfig, key_settings

log = logging.getLogger(__name__)

PART_STAGE = "benchmark-part"


def measured_once(run_root: Path, stage: str, material: dict[str, Any],
                  inputs: list[Descriptor], label: str,
                  measure: Callable[[Path], dict[str, Any]], file: str = "part.json",
                  figures: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                  ) -> dict[str, Any]:
    """What `measure(out_dir)` returns, measured now and written to `file` in the part's own
    finished directory, or read back from an earlier run's. figures(result): what the
    manifest keeps of it (all of it by default)."""
    plan = plan_stage(run_root, stage, material, inputs)
    if plan.is_complete():
        log.info("%s: measured before, reusing %s", label, plan.dir)
        return json.loads((plan.dir / file).read_text())
    log.info("%s: measuring", label)
    with stage_output(plan) as out:
        result = measure(out)
        atomic_write_json(out / file, result)
    finish_stage(plan, figures=(figures or dict)(result))
    return result


def device_label(device) -> str:
    """The device a part's timings belong to: the GPU's model on CUDA, else the device type."""
    if device.type != "cuda":
        return device.type
    import torch

    return torch.cuda.get_device_name(device)


class BenchmarkParts:
    """The parts of one benchmark stage (`plan`): each keyed by its name, the benchmark
    settings except those named as not deciding it, `material` (engine, drafter, dtype,
    cache, device) and `inputs`."""

    def __init__(self, plan: StagePlan, cfg: BenchmarkConfig, material: dict[str, Any],
                 inputs: list[Descriptor]):
        self.run_root = plan.dir.parent.parent
        self.cfg, self.material, self.inputs = cfg, material, inputs

    def measure(self, name: str, measure: Callable[[], dict[str, Any]],
                not_deciding: Iterable[str] = (),
                figures: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                ) -> dict[str, Any]:
        """The part `name`: measure() now, or what an earlier run measured with the same key.
        not_deciding: benchmark settings that do not change this part (another part's own,
        such as batch_sizes for the batch-1 part), so changing them leaves it finished."""
        skipped = {"sweep", *not_deciding}
        settings = {k: v for k, v in key_settings(self.cfg).items() if k not in skipped}
        material = {"part": name, "benchmark": settings, **self.material}
        return measured_once(self.run_root, PART_STAGE, material, self.inputs,
                             f"benchmark {name}", lambda _out: measure(), figures=figures)
