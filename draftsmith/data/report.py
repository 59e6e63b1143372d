"""How the merge stage's output reads: its line in the run summary, and its reports (records and
tokens per source, overlap with the benchmark, decontamination, draft vocab coverage)."""

from __future__ import annotations

import json

from draftsmith.artifacts import Descriptor
from draftsmith.figures import MERGE_COVERAGE_FILE, MergeFigures
from draftsmith.reports import Report, rounded


def reports(descriptor: Descriptor) -> list[Report]:
    stats = json.loads((descriptor.dir / "stats.json").read_text())
    rows = [{"source": s, **c} for s, c in stats.items()]
    rows = [{k: rounded(v) for k, v in row.items()} for row in rows]
    reports = [Report("table", "merge: records, tokens, masked tokens, mean length, duplicates "
                      "and truncations per source", key="merge-sources", rows=rows,
                      log_lines=[f"merge source {row}" for row in rows])]
    overlap = descriptor.figures.get("benchmark_overlap")
    if overlap:
        reports.append(Report("table", "merge: overlap with the benchmark's prompts (exact and "
                              "near duplicates)", key="merge-overlap",
                              rows=[{"figure": k, "value": str(rounded(v))}
                                    for k, v in overlap.items()],
                              log_lines=[f"merge benchmark overlap {overlap}"]))
    contamination = descriptor.dir / "decontamination.json"
    if contamination.is_file():
        from draftsmith.data.overlap import CHECKS

        reports_by_set = json.loads(contamination.read_text())
        rows = [{"set": r["set"], "eval prompts": r["eval_prompts"],
                 "records checked": r["records_checked"],
                 **{check.replace("_", " "): r[check] for check in CHECKS},
                 "records flagged": r["records_flagged"], "action": r["action"],
                 "example": "; ".join(f"{e['record']} ~ {next(iter(e['matches'].values()))} "
                                      f"({', '.join(e['matches'])})"
                                      for e in r["examples"][:2]) or "-"}
                for r in reports_by_set]
        reports.append(Report("table", "merge: training records that resemble an evaluation "
                              "set's prompts (same prompt, a shared 13-gram in the prompt or "
                              "the answer, a function named like an entry point), per set",
                              key="merge-decontamination", rows=rows,
                              log_lines=[f"merge decontamination {row}" for row in rows]))
    if (descriptor.dir / MERGE_COVERAGE_FILE).is_file():  # absent from older merge outputs
        coverage = json.loads((descriptor.dir / MERGE_COVERAGE_FILE).read_text())
        reports.append(Report("table", "merge: draft vocab coverage of loss-masked tokens",
                              key="merge-vocab",
                              rows=[{"figure": k, "value": str(rounded(v))}
                                    for k, v in coverage.items()],
                              log_lines=[f"merge draft vocab {coverage}"]))
    return reports


def describe(descriptor: Descriptor) -> str:
    counts, figures = descriptor.counts, MergeFigures.of(descriptor)
    text = (f"{counts['train_records']} train / {counts['validation_records']} validation "
            f"records, {counts['train_tokens']} train tokens, draft vocab covers "
            f"{100 * figures.draft_vocab_coverage:.1f}%")
    overlap = descriptor.figures.get("benchmark_overlap")
    if overlap:
        text += (f", no overlap with {overlap['benchmark']} (0 exact, 0 near; largest "
                 f"similarity {overlap['max_similarity']:.2f})")
    suite = descriptor.figures.get("decontamination")
    if suite:
        text += ", decontaminated against " + ", ".join(
            f"{r['set']} ({r['records_flagged']} left out)" for r in suite)
    return text
