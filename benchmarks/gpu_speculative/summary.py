"""benchmarks/results/gpu_speculative/summary.json: one row per engine, drafter, target cache
and batch, from the benchmark stage's reports (`report.json`), repeated runs (and a report's own
interleaved pairs, benchmark.repeats) folded into one row (the median speedup and its spread).

    # the reports that benchmarks/embedded_cache_gpu.sh brought back
    python benchmarks/gpu_speculative/summary.py FILES_AT/report-*.json --drafter general-92k

Each report's `summary.measured_on` says where it ran (device, target cache, whether the GPU was
the measurement's alone); rows keep it. The summary is batch 1; each of the report's `batched`
rows (benchmark.batch_sizes) is its batch's. Each row names its drafting `config` ("chain, 3
steps"); a benchmark.sweep point measured beside the deployed one (a tree: "tree 3x4/8") is a
batch-1 row of its own, one pass without speed pairs.

A benchmark stage on vLLM (deploy.engine=vllm) gives one row per concurrency, engine
`vllm-gpu` (or `vllm-cpu`): acceptance from vLLM's counters, the speedup over the same server
without speculation (the median of the report's pairs, with their spread), a stream's ms a
plain token (the baseline's mean time between tokens), identity at the first concurrency (the
one the report checks). vLLM does not split a round into draft and verify, so those fields and
the limit are null. Reports from before 2026-12-06 do not say where they ran or in what dtype:

    python benchmarks/gpu_speculative/summary.py FILES_AT/report.json --drafter general-half \
        --device "NVIDIA H100 80GB HBM3" --dtype float32

A benchmark stage cut off before its report leaves its finished parts
(`RUN_ROOT/benchmark-part/*/part.json`: batch 1, then each batch size); given instead of a
report, one stage's parts make one report:

    python benchmarks/gpu_speculative/summary.py FILES_AT/root/benchmark-part/*/part.json \
        --drafter general-half
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.artifacts import atomic_write_json  # noqa: E402

SUMMARY = Path(__file__).resolve().parents[1] / "results" / "gpu_speculative" / "summary.json"
FIELDS = ("engine", "drafter", "batch", "dtype", "acceptance", "ms_per_plain_token",
          "ms_per_round", "speedup", "speedup_limit", "identical")
VLLM_FIELDS = ("engine", "drafter", "concurrency", "dtype", "acceptance", "ms_per_plain_token",
               "ms_per_round", "speedup", "speedup_limit", "identical")


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def rows_of(reports: list[dict], drafter: str) -> list[dict]:
    """One row per (engine, target cache, batch, drafting config) among `reports`: medians
    over the repeats, the speedup's spread, and every repeat's identity. A report's other
    configs (sweep points; a sampled run, named with its temperature) are batch-1 rows."""
    groups: dict[tuple[str, str, str | None, int, str | None], list[dict]] = {}
    for report in reports:
        summary = report["summary"]
        where = summary.get("measured_on") or {}
        key = summary["engine"], where.get("target_cache", "?"), where.get("steps")
        deployed = summary.get("config")  # reports from before the sweep do not name it
        groups.setdefault((*key, 1, deployed), []).append(summary)
        for batched in report.get("batched") or []:  # the dtype, and where unless it says
            groups.setdefault((*key, batched["batch"], deployed), []).append(
                {**batched, "target_dtype": summary.get("target_dtype"),
                 "measured_on": batched.get("measured_on") or where})
        for point in report.get("configs") or []:  # the sweep's other points, at batch 1
            if point["config"] != deployed:
                groups.setdefault((*key, 1, point["config"]), []).append(
                    {**point, "target_dtype": summary.get("target_dtype"),
                     "measured_on": where})
    rows = []
    for (engine, cache, steps, batch, config), runs in groups.items():
        rounds = [r["ms_per_round"] for r in runs if r.get("ms_per_round")]
        prompts = [r["ms_per_prompt"] for r in runs if r.get("ms_per_prompt")]  # since 16ff8d4
        # A report of benchmark.repeats > 1 holds its interleaved pairs: each is a repeat.
        speedups = [pair for r in runs
                    for pair in [p["speedup"] for p in r.get("speedup_pairs") or []]
                    or [r["speedup"]]]
        where = runs[0].get("measured_on") or {}
        rows.append({
            "engine": engine, "drafter": drafter, "config": config, "batch": batch,
            "dtype": runs[0].get("target_dtype"), "target_cache": cache, "steps": steps,
            "acceptance": median_of([r["acceptance_length"] for r in runs]),
            "ms_per_plain_token": median_of([r.get("ms_per_plain_token") for r in runs]),
            "ms_per_round": {part: median_of([r[part] for r in rounds])
                             for part in ("draft", "verify", "other")} if rounds else None,
            "speedup": median_of(speedups),
            "speedup_spread": [min(speedups), max(speedups)],
            "speedup_limit": median_of([r.get("speedup_limit") for r in runs]),
            "ms_per_prompt": {side: median_of([r[side] for r in prompts])
                              for side in ("plain", "speculative")} if prompts else None,
            "identical": [r["identical_outputs"] for r in runs],
            "repeats": len(speedups), "device": where.get("device"),
            "alone": all(r.get("measured_on", {}).get("alone") for r in runs)
            if all(r.get("measured_on", {}).get("alone") is not None for r in runs) else None,
        })
    return rows


def vllm_rows_of(report: dict, drafter: str, device: str | None = None,
                 dtype: str | None = None) -> list[dict]:
    """One row per concurrency of a vLLM benchmark report. device, dtype: for a report that
    does not say (the report's own values win)."""
    summary = report["summary"]
    device = (summary.get("measured_on") or {}).get("device") or device
    dtype = summary.get("target_dtype") or dtype
    if device is None or dtype is None:
        raise SystemExit(f"this vLLM report does not say where it ran or in what dtype "
                         f"(device {device}, dtype {dtype}): give --device and --dtype")
    pairs = report["speed_pairs"]
    served = {r["concurrency"]: r for r in report["rows"] if r["server"] != "baseline"}
    baseline = {r["concurrency"]: r for r in report["rows"] if r["server"] == "baseline"}
    first = report["rows"][0]["concurrency"]
    rows = []
    for concurrency, row in served.items():
        speedups = [p["speedups"][str(concurrency)] for p in pairs]
        rows.append({
            "engine": "vllm-cpu" if device.startswith("cpu") else "vllm-gpu",
            "drafter": drafter, "concurrency": concurrency, "dtype": dtype,
            "acceptance": row["acceptance_length"],
            "ms_per_plain_token": round(1000 * baseline[concurrency]["inter_token_mean_s"], 3),
            "ms_per_round": None, "speedup": median_of(speedups),
            "speedup_spread": [min(speedups), max(speedups)], "speedup_limit": None,
            "identical": [summary["identical_outputs"]] if concurrency == first else None,
            "tokens_per_s": {side: median_of([p[side][str(concurrency)] for p in pairs])
                             for side in ("speculative", "baseline")},
            "repeats": len(pairs), "device": device,
        })
    return rows


def report_of_parts(parts: list[dict], names: list[str]) -> dict:
    """One report from one benchmark stage's parts: its batch-1 part and any batch sizes."""
    firsts = [part for part in parts if "per_prompt" in part]
    if len(firsts) != 1:
        raise SystemExit(f"{len(firsts)} batch-1 parts among {', '.join(names)}: give one "
                         "stage's parts (its batch-1 part holds per_prompt), or its report")
    (first,) = firsts
    summary = {**first["summary"], "measured_on": first["measured_on"]}
    for field in ("engine", "target_dtype", "temperature"):
        summary[field] = first[field]
    return {"summary": summary, "batched": sorted((p for p in parts if "batch" in p),
                                                  key=lambda p: p["batch"])}


def read_reports(paths: list[Path]) -> list[dict]:
    """The reports among `paths`, and one more made of the part files among them."""
    files = [(path, json.loads(path.read_text())) for path in paths]
    reports = [data for _, data in files if "verdict" in data]
    parts = [(path, data) for path, data in files if "verdict" not in data]
    if parts:
        reports.append(report_of_parts([data for _, data in parts],
                                       [str(path) for path, _ in parts]))
    return reports


def merge_rows(path: Path, new: list[dict]) -> list[dict]:
    """The file's rows, those of the same engine, drafter, drafting config, target cache,
    batch (or concurrency) and dtype replaced."""
    rows = json.loads(path.read_text()) if path.is_file() else []

    def key(row: dict) -> tuple:
        return (row["engine"], row["drafter"], row.get("config"), row.get("target_cache"),
                row.get("batch"), row.get("concurrency"), row.get("dtype"))

    replaced = {key(r) for r in new}
    rows = [r for r in rows if key(r) not in replaced] + new
    atomic_write_json(path, rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+",
                        help="benchmark report.json files, or one cut-off stage's part.json files")
    parser.add_argument("--drafter", required=True, help="the rows' drafter name")
    parser.add_argument("--summary", type=Path, default=SUMMARY)
    parser.add_argument("--device", help="where a vLLM report that does not say was measured")
    parser.add_argument("--dtype", help="the target dtype of a vLLM report that does not say")
    args = parser.parse_args(argv)
    reports = read_reports(args.reports)
    served = [r for r in reports if r["summary"]["engine"] == "vllm"]
    rows = rows_of([r for r in reports if r not in served], args.drafter)
    for report in served:
        rows += vllm_rows_of(report, args.drafter, args.device, args.dtype)
    merge_rows(args.summary, rows)
    for row in rows:
        print(json.dumps({k: row.get(k) for k in (*FIELDS, "config", "concurrency",
                                                  "target_cache", "speedup_spread")}))


if __name__ == "__main__":
    main()
