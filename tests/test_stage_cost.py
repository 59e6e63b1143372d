"""What making a stage's output cost (draftsmith/stage_cost.py): measured while a stage runs,
kept in its manifest, read back with a Cached output, shown in the run summary."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from draftsmith import stages
from draftsmith.artifacts import finish_stage, plan_stage, read_descriptor, stage_output
from draftsmith.stage_cost import StageCost, describe
from draftsmith.summary import run_report


def _write_output(plan, sizes: dict[str, int]):
    with stage_output(plan) as out:
        for name, size in sizes.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(b"x" * size)
        (out / ".partial-marker").write_bytes(b"y" * 999)  # not part of the output
    return finish_stage(plan, counts={"records": 1})


def test_a_stage_run_keeps_its_seconds_and_bytes_in_its_manifest(tmp_path):
    def run(_config, _inputs, plan, _secret=None):
        return _write_output(plan, {"a.bin": 1000, "sub/b.bin": 234})

    stage = dataclasses.replace(stages.get("merge"), run=run)
    plan = plan_stage(tmp_path, "merge", {"k": 1}, [])
    made = stage.execute(None, {}, plan)
    assert made.cost.disk_bytes == 1234  # the files, not the manifest or hidden files
    assert made.cost.seconds is not None and made.cost.seconds >= 0
    assert made.cost.peak_gpu_gib is None  # no GPU in this process
    assert read_descriptor(plan).cost == made.cost  # a Cached output shows what it cost


def test_an_output_finished_outside_a_measured_stage_has_only_its_bytes(tmp_path):
    # e.g. a stage joined from the parts its GPU hosts wrote: the seconds were spent there
    made = _write_output(plan_stage(tmp_path, "extract", {"k": 1}, []), {"s.bin": 10})
    assert made.cost == StageCost(seconds=None, peak_gpu_gib=None, disk_bytes=10)


def test_measuring_reads_nothing_a_stage_did_not_load():
    """A stage that never touched torch (merge, a cached summary) is not made to import it,
    nor CUDA initialized, to measure it."""
    code = ("import sys; from draftsmith.stage_cost import measuring, cost_now\n"
            "with measuring():\n    cost = cost_now(5)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert cost.peak_gpu_gib is None and cost.seconds is not None\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_run_summary_gives_each_stage_its_cost():
    cost = StageCost(seconds=41.23, peak_gpu_gib=3.1, disk_bytes=120_500_000)
    assert describe(cost) == "41.2 s, GPU peak 3.10 GiB, 120.5 MB on disk"
    assert describe(StageCost(disk_bytes=5_000)) == "0.0 MB on disk"
    assert describe(None) == "-"  # an output written before costs were kept
    results = {"train": {"state": "Cached", "descriptor": {
        "stage": "train", "path": "/r/train/k", "key": "k", "fingerprint": "f",
        "figures": {"tau": 3.0, "loss_0": 0.6}, "cost": cost.model_dump()}}}
    text = run_report(results, "t").text
    assert "| stage | state | result | cost |" in text
    assert "| 41.2 s, GPU peak 3.10 GiB, 120.5 MB on disk |" in text
