"""benchmarks/general/summary.py: the rows of benchmarks/results/general/summary.json, read from
a benchmark stage's report (here the embedded report kept beside the summary)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.scripts import benchmark_script

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "general"


def summary_module():
    return benchmark_script("general/summary.py")


META = {"drafter": "d", "kind": "eagle3.1", "prompts": 564, "epochs": 4, "hardware": "cpu"}


def test_a_row_per_set_and_part_with_every_field_the_issue_names():
    summary = summary_module()
    report = json.loads((RESULTS / "embedded_cpu-general-600.json").read_text())
    rows = summary.rows_of(report, "embedded", META)
    assert [(r["set"], r["split"]) for r in rows] == [
        (s, p) for s in ("chat", "code", "math") for p in ("dev", "test")]
    for row, entry in zip(rows, report["sets"], strict=True):
        assert set(summary.FIELDS) <= set(row)
        assert row["acceptance"] == entry["acceptance"] and row["ci95"] == entry["ci95"]
        assert row["speedup_c4"] is None  # the embedded engine runs one sequence


def test_new_rows_replace_those_of_the_same_drafter_engine_set_and_part(tmp_path):
    summary = summary_module()
    report = json.loads((RESULTS / "embedded_cpu-general-600.json").read_text())
    path = tmp_path / "summary.json"
    first = summary.rows_of(report, "embedded", META)
    summary.merge_rows(path, first)
    other = summary.rows_of(report, "embedded", {**META, "drafter": "e"})
    summary.merge_rows(path, other)
    again = [{**r, "acceptance": 9.0} for r in first[:2]]
    rows = summary.merge_rows(path, again)
    assert len(rows) == 12 and json.loads(path.read_text()) == rows
    assert sorted(r["acceptance"] for r in rows if r["drafter"] == "d")[-2:] == [9.0, 9.0]


def test_the_kept_summary_holds_test_rows_for_every_set_in_both_engines():
    rows = json.loads((RESULTS / "summary.json").read_text())
    for engine in ("embedded", "vllm"):
        tested = {r["set"] for r in rows if r["engine"] == engine and r["split"] == "test"}
        assert tested == {"chat", "code", "math"}, engine
    assert all(r["identical"].split("/")[0] == r["identical"].split("/")[1] for r in rows)
