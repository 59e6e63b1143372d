"""How the benchmark stage's output reads: its line in the run summary, its reports (the report
with its chart, acceptance per prompt set, and per drafting config), and the result the run
must not pass silently."""

from __future__ import annotations

import json

from draftsmith.artifacts import Descriptor
from draftsmith.figures import BenchmarkFigures
from draftsmith.reports import Report, embedded_image, rounded


def reports(descriptor: Descriptor) -> list[Report]:
    report = json.loads((descriptor.dir / "report.json").read_text())
    configs = report.get("configs") or []
    first = ["config", "acceptance_length", "speedup", "tokens_per_s",
             "speculative_tokens_per_s", "greedy_tokens_per_s", "lossless"]
    present = {k for c in configs for k in c if k != "rows"}
    columns = [c for c in first if c in present] + sorted(present - set(first))
    rows = [{c: rounded(config.get(c)) for c in columns} for config in configs]
    text = (descriptor.dir / "report.md").read_text()
    chart = descriptor.dir / "benchmark.png"
    if chart.is_file():
        text = (f"{embedded_image(chart, 'benchmark tokens/s and acceptance per config')}"
                f"\n\n{text}")
    reports = [Report("markdown", "benchmark: tokens/s and acceptance per config (chart), and "
                      "the report", key="benchmark", text=text)]
    sets = report.get("sets") or []
    if sets:
        set_rows = [{"set": r["set"], "part": r["split"], "prompts": r["prompts"],
                     "acceptance": r["acceptance"],
                     "ci95": f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}",
                     "per position": ", ".join(f"{a:.3f}" for a in r["per_position"]),
                     "identical": r["identical"] or "-", "speedup": r.get("speedup", "-")}
                    for r in sets]
        reports.append(Report("table", "benchmark: acceptance per prompt set (dev or test "
                              "part), with a 95% bootstrap interval over prompts and identity "
                              "with greedy decoding", key="benchmark-sets", rows=set_rows,
                              log_lines=[f"benchmark set {row}" for row in set_rows]))
    if rows:
        reports.append(Report("table", "benchmark: acceptance, speedup and tokens/s per "
                              "drafting config", key="benchmark-configs", rows=rows,
                              log_lines=[f"benchmark config {row}" for row in rows]))
    return reports


def describe(descriptor: Descriptor) -> str:
    figures = BenchmarkFigures.of(descriptor)
    if figures.engine != "embedded":
        same = (f", identical to the baseline: {figures.identical_outputs}"
                if figures.identical_outputs is not None else "")
        guard = ""
        if figures.guard:
            guard = (f", {100 * figures.guard['ratio']:.0f}% of the acceptance replayed in "
                     f"draftsmith's engine ({figures.guard['replayed_acceptance']:.2f})")
        return (f"{figures.engine} at {figures.url}: measured acceptance length "
                f"{figures.acceptance_length:.2f}{guard}, {figures.single_stream_tokens_per_s} "
                f"tok/s single stream{same}{_per_set(descriptor)}\n{figures.verdict}\n"
                f"report: {figures.report}")
    identical = figures.identical_outputs if figures.identical_outputs is not None \
        else figures.lossless
    return (f"measured acceptance length {figures.acceptance_length:.2f}, "
            f"{figures.speculative_tokens_per_s} vs {figures.greedy_tokens_per_s} tok/s, "
            f"identical to greedy decoding: {identical}{_per_set(descriptor)}\n"
            f"{figures.verdict}\nreport: {figures.report}")


def _per_set(descriptor: Descriptor) -> str:
    sets = descriptor.figures.get("sets") or []
    return "".join(f"; {r['set']} {r['split']} {r['acceptance']:.2f}" for r in sets)


def problem(descriptor: Descriptor) -> str | None:
    figures = BenchmarkFigures.of(descriptor)
    if figures.differs_from_greedy:
        return "speculative outputs differ from greedy decoding: this is a bug"
    return figures.guard_problem
