"""The run summary: each stage's state and result, and the figures a run is judged by
(records, tau, measured acceptance, speedup, lossless). The CLI prints it as a table; under
Prefect it is the pipeline run's last artifact."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith import stages
from draftsmith.artifacts import Descriptor
from draftsmith.figures import BenchmarkFigures, TrainFigures
from draftsmith.reports import Report
from draftsmith.stage_cost import describe as describe_cost


@dataclass
class StageRow:
    stage: str
    state: str
    result: str
    cost: str  # what making its output took, a Cached one's included


def stage_rows(results: dict[str, dict]) -> tuple[list[StageRow], list[str]]:
    """One row per stage in the results, in pipeline order, and the problems that must fail
    the run (a lossless engine that was not)."""
    rows, problems = [], []
    for stage in stages.STAGES:
        if stage.name not in results:
            continue
        descriptor = Descriptor.model_validate(results[stage.name]["descriptor"])
        rows.append(StageRow(stage.label, results[stage.name]["state"],
                             stage.describe(descriptor), describe_cost(descriptor.cost)))
        if problem := stage.problem(descriptor):
            problems.append(problem)
    return rows, problems


def headline(results: dict[str, dict]) -> dict[str, Any]:
    """The figures a run is judged by, those its stages produced (absent ones are left out)."""
    out: dict[str, Any] = {}

    def descriptor(name: str) -> Descriptor | None:
        result = results.get(name)
        return Descriptor.model_validate(result["descriptor"]) if result else None

    if (generated := descriptor("generate")) is not None:
        out["records"] = generated.counts.get("records")
    if (trained := descriptor("train")) is not None:
        train = TrainFigures.of(trained)
        out["tau"] = round(train.tau, 3)
        if train.acceptance_replayed is not None:
            out["acceptance replayed"] = round(train.acceptance_replayed, 3)
    if (bench := descriptor("benchmark")) is not None:
        figures = BenchmarkFigures.of(bench)
        out["measured acceptance"] = round(figures.acceptance_length, 3)
        if figures.speedup is not None:
            out["speedup"] = f"{figures.speedup:.2f}x"
        if figures.lossless is not None:
            out["lossless"] = figures.lossless
    return out


def run_report(results: dict[str, dict], title: str) -> Report:
    """The summary as a markdown page: the headline figures, then the stage table."""
    rows, problems = stage_rows(results)
    figures = headline(results)
    text = f"# {title}\n\n"
    if figures:
        text += ("| " + " | ".join(figures) + " |\n|" + "---|" * len(figures) + "\n| "
                 + " | ".join(_cell(v) for v in figures.values()) + " |\n\n")
    sets = ((results.get("benchmark") or {}).get("descriptor") or {}).get(
        "figures", {}).get("sets")
    if sets:
        from draftsmith.bench.suite import sets_markdown

        text += "## By prompt set\n\n" + sets_markdown(sets) + "\n"
    text += "| stage | state | result | cost |\n|---|---|---|---|\n"
    text += "".join(f"| {r.stage} | {r.state} | {_cell(r.result)} | {r.cost} |\n"
                    for r in rows)
    for problem in problems:
        text += f"\n**{problem}**\n"
    return Report("markdown", f"{title}: stages, states and results", key="run", text=text,
                  log_lines=[f"run summary {figures}"])


def _cell(value: Any) -> str:
    """A value that stays in its markdown table cell."""
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return str(value).replace("|", "\\|").replace("\n", "; ")
