"""The benchmark on vLLM: held-out prompts through the deployed server's OpenAI API.

At each `benchmark.concurrency`: tokens/s, time to first token and inter-token latency from
streamed completions; acceptance from vLLM's own Prometheus counters, read before and after the
run (acceptance length = 1 + accepted / drafts; per position, the share of drafts whose token
there was accepted, next to the trainer's full_acc of that TTT step). Then the same server
without speculation, on the same prompts: the speedup per concurrency, a verdict, and under
greedy decoding the count of outputs identical to the baseline's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import httpx

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    atomic_write_json,
    finish_stage,
    stage_output,
)
from draftsmith.bench.charts import markdown_table, plot_benchmark
from draftsmith.bench.identity import weigh_differences
from draftsmith.bench.openai_load import Completion, run_completions, summarize
from draftsmith.bench.suite import sets_markdown, with_sets
from draftsmith.config import BenchmarkConfig, DeployConfig, TargetConfig
from draftsmith.data.evalsets import EvalPrompt
from draftsmith.serve.vllm_launch import (
    PER_POSITION,
    SPEC_COUNTERS,
    acceptance_from_counters,
    build_launch,
    read_counters,
    start_vllm,
)

log = logging.getLogger(__name__)


def measure_server(url: str, model: str, prompts: list[list[int]], cfg: BenchmarkConfig,
                   positions: int | None) -> tuple[list[dict[str, Any]], list[Completion]]:
    """One row per concurrency; returns the rows and the first row's completions (prompt
    order). positions None: a server without speculation (no counters to read)."""
    if cfg.warmup_prompts:
        asyncio.run(run_completions(url, model, prompts[: cfg.warmup_prompts], max_tokens=8))
    rows, first = [], None
    with httpx.Client(base_url=url, timeout=60) as client:
        for concurrency in cfg.concurrency:
            before = read_counters(client) if positions else None
            results, wall = asyncio.run(run_completions(
                url, model, prompts, max_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature, concurrency=concurrency))
            row: dict[str, Any] = {"concurrency": concurrency, **summarize(results, wall)}
            if positions:
                row.update(acceptance_from_counters(before, read_counters(client), positions))
            log.info("benchmark %s (%s) at concurrency %d: %s", url,
                     "speculative" if positions else "baseline", concurrency, row)
            rows.append(row)
            first = first or results
    return rows, first or []


def per_prompt_acceptance(url: str, model: str, prompts: list[list[int]], cfg: BenchmarkConfig,
                          positions: int) -> list[dict[str, Any]]:
    """Each prompt alone (concurrency 1), vLLM's counters read before and after it: its own
    drafts, accepted tokens and acceptance by position, in the shape the suite's rows read
    (verify_rounds = drafts; round_tokens = drafts + accepted, the tokens those rounds kept)."""
    rows = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for i, prompt in enumerate(prompts):
            before = read_counters(client)
            [completion], _ = asyncio.run(run_completions(
                url, model, [prompt], max_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature, concurrency=1))
            after = read_counters(client)

            def delta(name: str, before=before, after=after) -> int:
                return int(after.get(name, 0.0) - before.get(name, 0.0))

            drafts, accepted = delta(SPEC_COUNTERS[0]), delta(SPEC_COUNTERS[2])
            rows.append({"prompt": i, "prompt_tokens": len(prompt),
                         "completion_tokens": len(completion.output_ids),
                         "verify_rounds": drafts, "round_tokens": drafts + accepted,
                         "accepted_by_position": [delta(f"{PER_POSITION}[{p}]")
                                                  for p in range(positions)],
                         "output_ids": completion.output_ids})
    return rows


def run_vllm_benchmark(cfg: BenchmarkConfig, deploy_cfg: DeployConfig, target_cfg: TargetConfig,
                       deployment: Descriptor, prompts: list[list[int]], target: Descriptor,
                       plan: StagePlan, trainer_full_acc: list[float] | None = None,
                       trained_dir: str | None = None,
                       suite: list[EvalPrompt] | None = None) -> Descriptor:
    """trained_dir: the train stage's checkpoint, the drafter the guard replays (default: the
    deployed files). suite: the evaluation prompt each of `prompts` is; its sets get a row
    each, from a pass at concurrency 1 that reads vLLM's counters around every prompt."""
    from draftsmith.serve import servers

    url, model = deployment.figures["url"], deployment.figures["model"]
    positions = deployment.figures["num_steps"]
    greedy = cfg.temperature == 0
    with stage_output(plan) as out:
        by_prompt = (per_prompt_acceptance(url, model, prompts, cfg, positions)
                     if suite else None)
        sweep, speculative = measure_server(url, model, prompts, cfg, positions)
        sampled = None
        if cfg.sampled_temperature:
            sampled_cfg = cfg.model_copy(update={"temperature": cfg.sampled_temperature})
            sampled = measure_server(url, model, prompts, sampled_cfg, positions)[0]
        # The baseline needs the deployed server's port and devices, so it runs only when
        # this run started that server and can stop it.
        owned = servers.running(url) is not None
        baseline, plain, skipped = None, None, "benchmark.baseline is false"
        pairs: list[dict[str, Any]] = []
        if cfg.baseline and owned:
            servers.stop(url)
            log.info("benchmark: stopped the speculative vLLM server; serving the target alone "
                     "for the baseline")
            launch = build_launch(deploy_cfg, target_cfg, None, target.figures["family"],
                                  target.path)
            process, _ = start_vllm(launch, out / "baseline-server.log", "vllm-baseline",
                                    deploy_cfg.startup_timeout_s)
            try:
                baseline, plain = measure_server(launch.url, launch.model, prompts, cfg, None)
            finally:
                process.stop()
            pairs = [speed_pair(sweep, baseline, "speculative first")]
            pairs += repeated_pairs(cfg, deploy_cfg, target_cfg, target, deployment, prompts,
                                    positions, out)
        elif cfg.baseline:
            skipped = (f"the vLLM server at {url} was not started by this run, so it cannot be "
                       "stopped for the baseline (set benchmark.baseline=false, or let this run "
                       "start it)")

        first = sweep[0]
        summary: dict[str, Any] = {
            "engine": "vllm", "url": url, "config": f"chain, {positions} steps",
            "num_steps": positions, "prompts": len(prompts), "temperature": cfg.temperature,
            "target_dtype": target_cfg.dtype, "measured_on": server_device(owned),
            "acceptance_length": first["acceptance_length"],
            "accepted_per_position": first["accepted_per_position"],
            "trainer_full_acc": trainer_full_acc,
            "single_stream_tokens_per_s": first["tokens_per_s"],
            "ttft_p50_s": first["ttft_p50_s"], "inter_token_mean_s": first["inter_token_mean_s"],
        }
        per_prompt = [{"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.output_ids),
                       "ttft_s": round(c.ttft_s, 4), "latency_s": round(c.latency_s, 4)}
                      for c in speculative]
        if baseline:
            speedups = median_speedups(pairs)
            summary["baseline_single_stream_tokens_per_s"] = baseline[0]["tokens_per_s"]
            summary["speedup"] = speedups[first["concurrency"]]
            summary["speedups"] = speedups
            summary["speedup_pairs"] = len(pairs)
            if len(pairs) > 1:
                summary["speedup_spread"] = {c: [min(p["speedups"][c] for p in pairs),
                                                 max(p["speedups"][c] for p in pairs)]
                                             for c in speedups}
            slower = [c for c, s in speedups.items() if s < 1]
            verdict = (f"WARNING: speculation is slower than no speculation at concurrency "
                       f"{slower} (speedups {speedups})" if slower else
                       f"speculation pays: {speedups} x the baseline's tokens/s by concurrency")
            if greedy:
                differences = weigh_differences(
                    target.path, target_cfg, prompts, [c.output_ids for c in plain],
                    [c.output_ids for c in speculative])
                for entry in per_prompt:
                    entry["identical"] = True
                for difference in differences:
                    per_prompt[difference["prompt"]].update(
                        identical=False, first_difference=difference["position"],
                        gap=difference["gap"], near_tie=difference["near_tie"])
                summary["identical_outputs"] = f"{len(prompts) - len(differences)}/{len(prompts)}"
                summary["near_ties"] = sum(d["near_tie"] for d in differences)
                # A near tie is float32 rounding falling the other way, not a broken drafter.
                summary["lossless"] = all(d["near_tie"] for d in differences)
                if differences:
                    bad = [d["prompt"] for d in differences]
                    log.log(logging.WARNING if summary["lossless"] else logging.ERROR,
                            "benchmark: greedy outputs differ from the baseline's on prompts %s "
                            "(%s)", bad, differences)
                    verdict += (f"; outputs differ from the baseline on prompts {bad}, "
                                f"{summary['near_ties']} of them at a near tie")
            else:
                summary["identical_outputs"] = (f"n/a (sampled at temperature "
                                                f"{cfg.temperature})")
                summary["lossless"] = None
        else:
            summary.update(speedup=None, identical_outputs=f"n/a ({skipped})", lossless=None)
            verdict = (f"no baseline measured ({skipped}), so no speedup is claimed; "
                       f"acceptance length {summary['acceptance_length']:.2f}")
        sets: list[dict[str, Any]] = []
        if by_prompt is not None:
            for row in by_prompt:
                output = row.pop("output_ids")
                if greedy and plain:
                    row["identical"] = output == plain[row["prompt"]].output_ids
            sets = with_sets(cfg, suite, by_prompt, positions)
            summary["sets"] = sets
        if cfg.guard and greedy:
            from draftsmith.bench.guard import run_guard

            source = plain if plain else speculative
            summary["guard"] = run_guard(
                trained_dir or deployment.figures["drafter_dir"], target.path, target_cfg,
                target.figures["family"], positions, prompts, [c.output_ids for c in source],
                first["acceptance_length"], "baseline server" if plain else
                "speculative server (no baseline measured)", cfg.guard_threshold)
            if not summary["guard"]["ok"]:
                verdict += f"; PROBLEM: {summary['guard']['problem']}"
        configs = [{"config": summary["config"], "rows": sweep}]
        if sampled:
            configs.append({"config": f"{summary['config']} @ T={cfg.sampled_temperature}",
                            "temperature": cfg.sampled_temperature, "rows": sampled})
        rows = [{"server": c["config"], **r} for c in configs for r in c["rows"]]
        rows += [{"server": "baseline", **r} for r in baseline or []]
        atomic_write_json(out / "report.json", {"summary": summary, "verdict": verdict,
                                                "sets": sets, "rows": rows,
                                                "speed_pairs": pairs,
                                                "per_prompt": per_prompt,
                                                "per_prompt_acceptance": by_prompt})
        (out / "report.md").write_text(markdown_report(summary, rows, verdict))
        plot_benchmark([f"{r['server']} c={r['concurrency']}" for r in rows],
                       [r["tokens_per_s"] for r in rows],
                       [r.get("acceptance_length") for r in rows], out,
                       f"vLLM at {url}, {len(prompts)} held-out prompts")
    log.info("benchmark: acceptance length %.3f (per position %s, trainer full_acc %s); %s",
             summary["acceptance_length"], summary["accepted_per_position"], trainer_full_acc,
             verdict)
    return finish_stage(plan, counts={"prompts": len(prompts),
                                      "tokens": first["completion_tokens"]},
                        figures={**summary, "verdict": verdict,
                                 "report": str(Path(plan.dir) / "report.md")})


def server_device(owned: bool) -> dict[str, str | None]:
    """Where the served figures were measured: a server this run started serves from this
    host, on its first GPU where there is one (vLLM's default), else on its CPU. A server
    started elsewhere runs on hardware this process cannot see."""
    import torch

    if not owned:
        return {"device": None}
    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(0)}
    return {"device": f"cpu ({os.cpu_count()} cores)"}


def speed_pair(speculative: list[dict[str, Any]], baseline: list[dict[str, Any]],
               order: str) -> dict[str, Any]:
    """One speculative and one baseline measurement, back to back: tokens/s and the speedup
    per concurrency."""
    return {"order": order,
            "speculative": {r["concurrency"]: r["tokens_per_s"] for r in speculative},
            "baseline": {r["concurrency"]: r["tokens_per_s"] for r in baseline},
            "speedups": {s["concurrency"]: round(s["tokens_per_s"] / b["tokens_per_s"], 3)
                         for s, b in zip(speculative, baseline, strict=True)}}


def median_speedups(pairs: list[dict[str, Any]]) -> dict[int, float]:
    """The median speedup per concurrency over the pairs."""
    import statistics

    return {c: round(statistics.median(p["speedups"][c] for p in pairs), 3)
            for c in pairs[0]["speedups"]}


def repeated_pairs(cfg: BenchmarkConfig, deploy_cfg: DeployConfig, target_cfg: TargetConfig,
                   target: Descriptor, deployment: Descriptor, prompts: list[list[int]],
                   positions: int, out: Path) -> list[dict[str, Any]]:
    """benchmark.repeats - 1 more pairs after the first, each server started again in turn,
    the order alternating (baseline first, then speculative first, ...), so that a machine
    whose load drifts does not favour one side. Only one server runs at a time: the engines
    take the same cores or GPUs."""
    family = target.figures["family"]
    launches = {"speculative": build_launch(deploy_cfg, target_cfg,
                                            deployment.figures["drafter_dir"], family,
                                            target.path),
                "baseline": build_launch(deploy_cfg, target_cfg, None, family, target.path)}
    pairs = []
    for repeat in range(1, cfg.repeats):
        order = ("baseline", "speculative") if repeat % 2 else ("speculative", "baseline")
        rows = {}
        for side in order:
            launch = launches[side]
            process, _ = start_vllm(launch, out / f"{side}-server-{repeat}.log",
                                    f"vllm-{side}-{repeat}", deploy_cfg.startup_timeout_s)
            try:
                rows[side] = measure_server(launch.url, launch.model, prompts, cfg,
                                            positions if side == "speculative" else None)[0]
            finally:
                process.stop()
        pairs.append(speed_pair(rows["speculative"], rows["baseline"], f"{order[0]} first"))
        log.info("benchmark: speed pair %d of %d (%s first): speedups %s", repeat + 1,
                 cfg.repeats, order[0], pairs[-1]["speedups"])
    return pairs


def markdown_report(summary: dict[str, Any], rows: list[dict[str, Any]], verdict: str) -> str:

    table = "\n".join(f"| {k} | {v} |" for k, v in summary.items() if k not in ("guard",
                                                                                 "sets"))
    text = f"# draftsmith benchmark: vLLM\n\n| metric | value |\n|---|---|\n{table}\n"
    if summary.get("sets"):
        text += ("\n## By prompt set\n\nEach prompt alone (concurrency 1), vLLM's counters "
                 "read around it; a 95% bootstrap interval over prompts; identical: to the "
                 "baseline server's greedy output.\n\n" + sets_markdown(summary["sets"]))
    text += "\n## By server and concurrency\n\n" + markdown_table(rows)
    guard = summary.get("guard")
    if guard:
        text += ("\n## Does vLLM run the drafter as it was trained?\n\n"
                 f"Served acceptance {guard['served_acceptance']}, replayed in draftsmith's "
                 f"engine over the {guard['outputs_from']}'s greedy outputs "
                 f"{guard['replayed_acceptance']} ({100 * guard['ratio']:.0f}%; below "
                 f"{100 * guard['threshold']:.0f}% is a problem).\n")
        if not guard["ok"]:
            text += f"\n**PROBLEM: {guard['problem']}**\n"
    full_acc = summary.get("trainer_full_acc")
    if full_acc:
        per_pos = summary["accepted_per_position"]
        text += ("\n## Acceptance by position\n\n| position | vLLM accepted | trainer "
                 "full_acc |\n|---|---|---|\n")
        text += "\n".join(f"| {p} | {a} | {full_acc[p] if p < len(full_acc) else ''} |"
                          for p, a in enumerate(per_pos)) + "\n"
    return text + f"\n**{verdict}**\n"
