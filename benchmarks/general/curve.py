"""The data curve of the general recipe: acceptance on the evaluation suite's dev parts against
the training records, one line per set, from the benchmark reports of drafters that differ
in their data (and a point or two that differ otherwise, drawn apart).

    python benchmarks/general/curve.py --out benchmarks/results/general/curve \\
        --point quarter 22150 curve REPORT.json --point half 44307 curve REPORT.json ... \\
        --point half-wide 44307 capacity REPORT.json

A point's series is `curve` (joined by a line, in order of records) or any other name
(markers only). Writes OUT/curve.json (one row per point, set and part, with the report's
interval, per-position acceptance, identity and where it ran) and OUT/curve.png and .svg,
and prints each set's gain per doubling of the records along the curve.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.artifacts import atomic_write_json  # noqa: E402
from draftsmith.plotting import plt, save_figure  # noqa: E402


def rows_of(name: str, records: int, series: str, report_path: Path) -> list[dict]:
    report = json.loads(report_path.read_text())
    where = report["summary"].get("measured_on") or {}
    return [{"point": name, "records": records, "series": series, "set": s["set"],
             "split": s["split"], "acceptance": s["acceptance"], "ci95": s["ci95"],
             "per_position": s["per_position"], "identical": s["identical"],
             "prompts": s["prompts"], "device": where.get("device"),
             "report": str(report_path)} for s in report["sets"]]


def gains_per_doubling(rows: list[dict]) -> dict[str, list[dict]]:
    """Along the `curve` series, per set: each step's acceptance gain per doubling."""
    gains: dict[str, list[dict]] = {}
    curve = sorted((r for r in rows if r["series"] == "curve"), key=lambda r: r["records"])
    for name in dict.fromkeys(r["set"] for r in curve):
        points = [r for r in curve if r["set"] == name]
        gains[name] = [{"from": a["point"], "to": b["point"],
                        "per_doubling": round((b["acceptance"] - a["acceptance"])
                                              / math.log2(b["records"] / a["records"]), 3)}
                       for a, b in zip(points, points[1:], strict=False)]
    return gains


def plot(rows: list[dict], out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(dict.fromkeys(r["set"] for r in rows)):
        color = f"C{i}"
        curve = sorted((r for r in rows if r["set"] == name and r["series"] == "curve"),
                       key=lambda r: r["records"])
        ax.errorbar([r["records"] for r in curve], [r["acceptance"] for r in curve],
                    yerr=[[r["acceptance"] - r["ci95"][0] for r in curve],
                          [r["ci95"][1] - r["acceptance"] for r in curve]],
                    color=color, marker="o", capsize=3, label=f"{name} ({curve[0]['split']})")
        for r in rows:
            if r["set"] == name and r["series"] != "curve":
                ax.plot(r["records"] * 1.04, r["acceptance"], color=color, marker="D",
                        linestyle="none")
                ax.annotate(r["point"], (r["records"] * 1.06, r["acceptance"]), fontsize=7,
                            color=color, va="center")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["records"] for r in rows})
    ax.set_xticks(ticks, [f"{t / 1000:.1f}K" for t in ticks])
    ax.minorticks_off()
    ax.set(xlabel="training records (log scale)", ylabel="acceptance length (3 drafts)",
           title="General recipe: acceptance against data (diamonds: other changes)")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, out, "curve")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", nargs=4, action="append", required=True,
                        metavar=("NAME", "RECORDS", "SERIES", "REPORT"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = [row for name, records, series, report in args.point
            for row in rows_of(name, int(records), series, Path(report))]
    gains = gains_per_doubling(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    command = ["python", "benchmarks/general/curve.py", *(sys.argv[1:] if argv is None else argv)]
    atomic_write_json(args.out / "curve.json", {"command": " ".join(command), "rows": rows,
                                                "gains_per_doubling": gains})
    plot(rows, args.out)
    for row in rows:
        print(f"{row['point']:>10} {row['records']:>6} {row['set']:>20} {row['split']} "
              f"{row['acceptance']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}] "
              f"{row['identical']} {row['device']}")
    for name, steps in gains.items():
        print(name, ", ".join(f"{g['from']}->{g['to']}: {g['per_doubling']:+.3f}" for g in steps))


if __name__ == "__main__":
    main()
