"""benchmarks/results/general/summary.json: one row per drafter, engine, prompt set and part,
from the benchmark stage's own report (report.json), embedded or vLLM.

    # the embedded rows of a run's benchmark stage
    python benchmarks/general/summary.py embedded RUN_ROOT/benchmark/KEY/report.json \\
        --drafter general-1200 --kind eagle3.1 --prompts 1200 --epochs 3 --hardware "2-core CPU"
    # a drafter served by vLLM on this CPU, the suite's test parts, 3 speed pairs
    python benchmarks/general/summary.py vllm DRAFTER_DIR --drafter general-1200 ...
    # a drafter made elsewhere (a GPU lease's export), in the embedded engine on this CPU
    python benchmarks/general/summary.py embedded-drafter DRAFTER_DIR --drafter ... ...

The vLLM measurement is the product's: the deploy stage starts `vllm serve` with the drafter,
the benchmark stage reads vLLM's counters around every prompt (acceptance per set), compares
the outputs with the baseline server's (identity) and runs `--repeats` pairs of speculative
and baseline servers in alternating order (the speedup is their median; the spread is kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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


def smollm2_float32():
    """SmolLM2-135M-Instruct in float32 (greedy identity is exact there): config, descriptor."""
    from draftsmith.config import TargetConfig
    from draftsmith.target import resolve_target

    target_cfg = TargetConfig(model="builtin:smollm2-135m-instruct", dtype="float32")
    return target_cfg, resolve_target(target_cfg)


def report_of(benchmark) -> dict:
    """The benchmark stage's report.json, from the stage's descriptor."""
    return json.loads(Path(benchmark.figures["report"]).with_suffix(".json").read_text())


def serve_and_measure(drafter: Path, args) -> dict:
    """The drafter on vLLM's CPU build, float32, through the deploy and benchmark stages."""
    from draftsmith.artifacts import plan_stage
    from draftsmith.bench.benchmark import benchmark_prompts
    from draftsmith.bench.vllm_bench import run_vllm_benchmark
    from draftsmith.config import BenchmarkConfig, DeployConfig
    from draftsmith.serve import servers
    from draftsmith.serve.deploy import deploy_server
    from draftsmith.serve.vllm_launch import VLLM
    from draftsmith.target import load_tokenizer

    target_cfg, target = smollm2_float32()
    deploy_cfg = DeployConfig(engine="vllm", num_steps=3, eagle_topk=1, num_draft_tokens=4,
                              host="127.0.0.1", port=args.port,
                              env={"VLLM_CPU_KVCACHE_SPACE": "2"},
                              extra_args=["--enforce-eager", "--max-num-seqs", "8"],
                              startup_timeout_s=1200)
    bench_cfg = BenchmarkConfig(suite=args.sets, splits=args.splits,
                                prompts_per_set=args.prompts_per_set,
                                max_new_tokens=args.max_new_tokens,
                                concurrency=[1, 4], baseline=True, repeats=args.repeats)
    key = {"drafter": str(drafter.resolve()), "time": time.time()}
    deployment = deploy_server(VLLM, deploy_cfg, target_cfg, str(drafter), target.path,
                               target.figures["family"],
                               plan_stage(args.work, "deploy", key, [target]))
    try:
        prompts, suite = benchmark_prompts(bench_cfg, None, load_tokenizer(target))
        report = run_vllm_benchmark(bench_cfg, deploy_cfg, target_cfg, deployment, prompts,
                                    target, plan_stage(args.work, "benchmark", key,
                                                       [deployment]), suite=suite)
    finally:
        servers.stop_all()
    return report_of(report)


def benchmark_embedded(drafter: Path, args) -> dict:
    """The drafter in the embedded engine, SmolLM2 in float32 on this CPU, through the deploy
    (its smoke generation against greedy decoding) and benchmark stages' own code."""
    from draftsmith.artifacts import plan_stage
    from draftsmith.bench.benchmark import run_benchmark
    from draftsmith.bench.suite import prompt_conversation, suite_prompts
    from draftsmith.config import BenchmarkConfig, DeployConfig
    from draftsmith.serve.deploy import deploy_embedded

    target_cfg, target = smollm2_float32()
    # A tree (--topk above 1) verifies on the dynamic cache: the static one verifies chains.
    deploy_cfg = DeployConfig(engine="embedded", num_steps=3, eagle_topk=args.topk,
                              num_draft_tokens=args.draft_tokens or 4)
    bench_cfg = BenchmarkConfig(suite=args.sets, splits=args.splits,
                                prompts_per_set=args.prompts_per_set,
                                max_new_tokens=args.max_new_tokens)
    key = {"drafter": str(drafter.resolve()), "time": time.time()}
    smoke = prompt_conversation(suite_prompts(bench_cfg.suite, bench_cfg.splits, 1)[0])
    deployment = deploy_embedded(deploy_cfg, target_cfg, str(drafter), target,
                                 plan_stage(args.work, "deploy", key, [target]), smoke)
    report = run_benchmark(bench_cfg, target_cfg, deployment, None, target,
                           plan_stage(args.work, "benchmark", key, [deployment]), deploy_cfg)
    return report_of(report)


def eval_set(text: str) -> str | dict:
    """A --sets entry: a builtin set's name, or NAME=PATH (benchmark.suite's {name, path})."""
    name, _, path = text.partition("=")
    return {"name": name, "path": path} if path else name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=["embedded", "embedded-drafter", "vllm"])
    parser.add_argument("source", type=Path, help="embedded: a benchmark report.json; "
                        "embedded-drafter and vllm: the drafter's directory (speculators "
                        "layout)")
    parser.add_argument("--drafter", required=True, help="the rows' drafter name")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--prompts", type=int, required=True, help="training records")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--hardware", required=True)
    parser.add_argument("--summary", type=Path, default=SUMMARY)
    parser.add_argument("--sets", nargs="+", default=["chat", "code", "math"], type=eval_set,
                        help="builtin sets by name, or NAME=PATH for a set of your own")
    parser.add_argument("--splits", nargs="+", default=["test"])
    parser.add_argument("--prompts-per-set", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--topk", type=int, default=1,
                        help="embedded-drafter: eagle_topk, a tree above 1 (3 levels deep)")
    parser.add_argument("--draft-tokens", type=int,
                        help="embedded-drafter: num_draft_tokens (default 4, the chain's)")
    parser.add_argument("--port", type=int, default=30183)
    parser.add_argument("--work", type=Path, default=Path("/tmp/draftsmith-general-vllm"))
    args = parser.parse_args(argv)
    from draftsmith.logs import configure_logging

    configure_logging()
    meta = {k: getattr(args, k) for k in ("drafter", "kind", "prompts", "epochs", "hardware")}
    started = time.monotonic()
    if args.engine == "embedded":
        report = json.loads(args.source.read_text())
    elif args.engine == "embedded-drafter":
        report = benchmark_embedded(args.source, args)
    else:
        report = serve_and_measure(args.source, args)
    engine = "vllm" if args.engine == "vllm" else "embedded"
    # The raw report beside the summary, with the command that made the rows.
    kept = args.summary.parent / f"{engine}_{args.drafter}.json"
    command = ["python", "benchmarks/general/summary.py", *(sys.argv[1:] if argv is None else argv)]
    atomic_write_json(kept, {**report, "seconds": round(time.monotonic() - started, 1),
                             "command": " ".join(map(str, command)), "source": str(args.source)})
    rows = rows_of(report, engine, meta)
    merge_rows(args.summary, rows)
    for row in rows:
        print(json.dumps({k: row[k] for k in FIELDS}))


if __name__ == "__main__":
    main()
