"""A drafter trained on the GPU, served by vLLM on this CPU: SmolLM2-135M-Instruct (float32)
with the drafter, then the same server without it, on HumanEval prompts, through the deploy
stage's launch and the benchmark stage's vLLM measurement (draftsmith/bench/vllm_bench.py):
acceptance from vLLM's own counters, outputs against the baseline's, tokens/s per concurrency.

    python benchmarks/quality/vllm_cpu.py --drafter DIR --name eagle3-48000-e6 \\
        --summary benchmarks/results/quality_scale/summary.json --prompts 40

The drafter row named --name in --summary gets measured_vllm, speedup_vllm_c1/_c4 and
identical_vllm; the vLLM report is written beside the summary (vllm_<name>.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.artifacts import atomic_write_json, plan_stage  # noqa: E402
from draftsmith.bench.benchmark import held_out_prompts  # noqa: E402
from draftsmith.config import BenchmarkConfig, DeployConfig, TargetConfig  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.target import load_tokenizer, resolve_target  # noqa: E402

log = logging.getLogger("draftsmith.quality.vllm_cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True, help="speculators layout")
    parser.add_argument("--name", required=True, help="the drafter's row in --summary")
    parser.add_argument("--summary", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--work", type=Path, default=Path("/tmp/draftsmith-vllm-cpu"))
    parser.add_argument("--port", type=int, default=30181)
    parser.add_argument("--from-report", action="store_true",
                        help="serve nothing: fill the row from the kept vllm_NAME.json")
    args = parser.parse_args(argv)
    configure_logging()
    if args.from_report:
        kept = args.summary.parent / f"vllm_{args.name}.json"
        update_row(args.summary, args.name, json.loads(kept.read_text()))
        return
    started = time.monotonic()
    target_cfg = TargetConfig(model="builtin:smollm2-135m-instruct", dtype="float32")
    target = resolve_target(target_cfg)
    deploy_cfg = DeployConfig(engine="vllm", num_steps=3, eagle_topk=1, num_draft_tokens=4,
                              host="127.0.0.1", port=args.port,
                              env={"VLLM_CPU_KVCACHE_SPACE": "2"},
                              extra_args=["--enforce-eager", "--max-num-seqs", "8"],
                              startup_timeout_s=1200)
    bench_cfg = BenchmarkConfig(prompts_builtin="humaneval", num_prompts=args.prompts,
                                max_new_tokens=args.max_new_tokens,
                                concurrency=args.concurrency, baseline=True)
    from draftsmith.bench.vllm_bench import run_vllm_benchmark
    from draftsmith.serve import servers
    from draftsmith.serve.vllm_launch import run_deploy_vllm

    key = {"drafter": str(args.drafter.resolve()), "time": time.time()}
    deployment = run_deploy_vllm(deploy_cfg, target_cfg, str(args.drafter), target.path,
                                 target.figures["family"],
                                 plan_stage(args.work, "deploy", key, [target]))
    try:
        prompts = held_out_prompts(bench_cfg, None, load_tokenizer(target))
        report = run_vllm_benchmark(bench_cfg, deploy_cfg, target_cfg, deployment, prompts,
                                    target, plan_stage(args.work, "benchmark", key,
                                                       [deployment]))
    finally:
        servers.stop_all()
    full = json.loads((Path(report.figures["report"]).with_suffix(".json")).read_text())
    full = {**full, "prompts": len(prompts), "seconds": round(time.monotonic() - started, 1),
            "command": " ".join(sys.argv)}
    atomic_write_json(args.summary.parent / f"vllm_{args.name}.json", full)
    update_row(args.summary, args.name, full)


def row_update(full: dict) -> dict:
    """The summary row's vLLM columns from a vLLM report (speedups are keyed by concurrency,
    which JSON turns into strings)."""
    summary = full["summary"]
    speedups = {int(c): x for c, x in (summary.get("speedups") or {}).items()}
    return {"measured_vllm": summary["acceptance_length"],
            "accepted_per_position_vllm": summary["accepted_per_position"],
            "speedup_vllm_c1": speedups.get(1), "speedup_vllm_c4": speedups.get(4),
            "identical_vllm": summary.get("identical_outputs"),
            "vllm_prompts": full.get("prompts", summary.get("prompts")),
            "vllm_tokens_per_s_c1": summary["single_stream_tokens_per_s"],
            "vllm_baseline_tokens_per_s_c1": summary.get("baseline_single_stream_tokens_per_s"),
            "vllm_guard": summary.get("guard")}


def update_row(summary_path: Path, name: str, full: dict) -> None:
    update = row_update(full)
    rows = json.loads(summary_path.read_text()) if summary_path.exists() else []
    for row in rows:
        if row["drafter"] == name:
            row.update(update)
            break
    else:
        raise SystemExit(f"{summary_path} has no row named {name!r}")
    atomic_write_json(summary_path, rows)
    print(json.dumps(update, indent=1))


if __name__ == "__main__":
    main()
