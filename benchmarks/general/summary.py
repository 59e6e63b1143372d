"""benchmarks/results/general/summary.json: one row per drafter, engine, prompt set and part,
from the benchmark stage's own report (report.json), embedded or vLLM.

The measurement is the product's: `draftsmith run` (a drafter made elsewhere, such as a GPU
lease's export, through deploy.drafter) writes RUN_ROOT/benchmark/KEY/report.json; this
script only turns that report into rows.

    draftsmith run examples/smollm2-h200.yaml --set target.device=cpu \
        --set deploy.drafter=DRAFTER_DIR --set run_root=RUN_ROOT
    python benchmarks/general/summary.py embedded RUN_ROOT/benchmark/KEY/report.json \
        --drafter general-h100 --kind eagle3.1 --prompts 89400 --epochs 2 --hardware "2-core CPU"

With deploy.engine=vllm the report is vLLM's (acceptance from its counters per set, identity
against the baseline server, `benchmark.repeats` interleaved speed pairs): `... vllm REPORT`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.artifacts import atomic_write_json  # noqa: E402

SUMMARY = Path(__file__).resolve().parents[1] / "results" / "general" / "summary.json"
FIELDS = ("drafter", "kind", "prompts", "epochs", "set", "split", "engine", "acceptance",
          "ci95", "per_position", "identical", "speedup_c1", "speedup_c4")


def rows_of(report: dict, engine: str, meta: dict) -> list[dict]:
    """The summary rows of one benchmark report: one per set and part."""
    summary = report["summary"]
    speedups = {int(c): s for c, s in (summary.get("speedups") or {}).items()}
    spread = {int(c): s for c, s in (summary.get("speedup_spread") or {}).items()}
    out = []
    for entry in report["sets"]:
        row = {"drafter": meta["drafter"], "kind": meta["kind"], "prompts": meta["prompts"],
               "epochs": meta["epochs"], "set": entry["set"], "split": entry["split"],
               "engine": engine, "acceptance": entry["acceptance"], "ci95": entry["ci95"],
               "per_position": entry["per_position"], "identical": entry["identical"],
               # speed is measured over all the suite's prompts at once, not per set
               "speedup_c1": speedups.get(1) if engine == "vllm" else entry.get("speedup"),
               "speedup_c4": speedups.get(4) if engine == "vllm" else None,
               "set_prompts": entry["prompts"], "hardware": meta["hardware"],
               "target_dtype": summary.get("target_dtype", "float32")}
        if engine == "vllm":
            row["speedup_spread"] = {str(c): s for c, s in spread.items()} or None
            row["speed_pairs"] = summary.get("speedup_pairs")
        out.append(row)
    return out


def merge_rows(path: Path, new: list[dict]) -> list[dict]:
    """The file's rows with those of the same drafter, engine, set and part replaced."""
    rows = json.loads(path.read_text()) if path.is_file() else []

    def key(row: dict) -> tuple:
        return row["drafter"], row["engine"], row["set"], row["split"]

    replaced = {key(r) for r in new}
    rows = [r for r in rows if key(r) not in replaced] + new
    atomic_write_json(path, rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=["embedded", "vllm"])
    parser.add_argument("report", type=Path, help="a benchmark stage's report.json")
    parser.add_argument("--drafter", required=True, help="the rows' drafter name")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--prompts", type=int, required=True, help="training records")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--hardware", required=True)
    parser.add_argument("--summary", type=Path, default=SUMMARY)
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    if report["summary"]["engine"] != args.engine:
        parser.error(f"{args.report} is a {report['summary']['engine']} report, not {args.engine}")
    meta = {k: getattr(args, k) for k in ("drafter", "kind", "prompts", "epochs", "hardware")}
    # The raw report beside the summary, with the command that made the rows.
    kept = args.summary.parent / f"{args.engine}_{args.drafter}.json"
    command = ["python", "benchmarks/general/summary.py", *(sys.argv[1:] if argv is None else argv)]
    atomic_write_json(kept, {**report, "command": " ".join(map(str, command)),
                             "source": str(args.report)})
    rows = rows_of(report, args.engine, meta)
    merge_rows(args.summary, rows)
    for row in rows:
        print(json.dumps({k: row[k] for k in FIELDS}))


if __name__ == "__main__":
    main()
