"""How the generate stage's output reads: its line in the run summary, and its reports (records
per source, and the requests, tokens, throughput and cost of the answers)."""

from __future__ import annotations

import json

from draftsmith.artifacts import Descriptor
from draftsmith.figures import GenerateFigures
from draftsmith.reports import Report, rounded


def reports(descriptor: Descriptor) -> list[Report]:
    from draftsmith.generate.stage import GENERATION_FILE

    sources = json.loads((descriptor.dir / "stats.json").read_text())
    summary_file = descriptor.dir / GENERATION_FILE
    # absent from outputs of a draftsmith before the HTTP backend
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    per_source = summary.get("per_source", {})
    rows = []
    for s in sources:
        cache = per_source.get(s["source"], {})
        rows.append({
            "source": s["source"], "read": s["read"], "kept": s["kept"],
            "answered now": cache.get("answered_this_attempt", "-"),
            "answers reused": cache.get("answered_before", "-"),
            "dropped": sum(s["dropped"].values()),
            "drop reasons": "; ".join(f"{r} ({n})" for r, n in s["dropped"].items()) or "-",
            "notes": "; ".join(f"{r} ({n})" for r, n in s.get("notes", {}).items()) or "-"})
    reports = [Report("table", "generate: records read, kept, answered now or reused from "
                      "earlier runs, and dropped, per source", key="generate-sources",
                      rows=rows, log_lines=[f"generate source {row}" for row in rows])]
    if summary:
        flat = {k: rounded(v) for k, v in summary.items() if k not in ("per_partition",
                                                                       "per_source")}
        reports.append(Report("table", "generate: requests, tokens, seconds, throughput, cost",
                              key="generate-summary",
                              rows=[{"figure": k, "value": "-" if v is None else str(v)}
                                    for k, v in flat.items()],
                              log_lines=[f"generate summary {flat}"]))
    return reports


def describe(descriptor: Descriptor) -> str:
    counts, figures = descriptor.counts, GenerateFigures.of(descriptor)
    text = f"{counts['records']} records, {counts['generated']} answered by the target"
    if counts.get("failed"):
        text += f", {counts['failed']} failed (errors.jsonl)"
    if counts.get("with_reasoning"):
        text += f", {counts['with_reasoning']} with reasoning"
    if figures.cost_usd is not None:
        cost = figures.cost_usd
        text += f", cost ${cost:.2f}" if cost >= 1 else f", cost ${cost:.4f}"
    return text
