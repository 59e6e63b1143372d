"""Stage `benchmark`: held-out prompts through the deployed drafter.

Embedded engine: speculative vs plain greedy decoding in-process; acceptance length, tokens/s of
each, and whether the outputs are identical. Served endpoint (SGLang): streamed requests at each
concurrency of the sweep; tokens/s, time to first token, acceptance length from meta_info.
"""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    atomic_write_json,
    finish_stage,
    stage_output,
)
from draftsmith.bench.charts import plot_benchmark
from draftsmith.config import BenchmarkConfig, DeployConfig, TargetConfig
from draftsmith.data.merge import read_split
from draftsmith.progress import Progress
from draftsmith.serve.deploy import load_embedded_engine, prompt_ids
from draftsmith.serve.embedded import Sampling, greedy_generate
from draftsmith.target import load_tokenizer

log = logging.getLogger(__name__)


def held_out_prompts(cfg: BenchmarkConfig, merged: Descriptor, tokenizer) -> list[list[int]]:
    rows = read_split(merged, "validation")
    if not rows:
        raise ValueError("benchmark: the validation split is empty; raise "
                         "merge.validation_fraction so there are held-out prompts")
    return [prompt_ids(tokenizer, r["messages"]) for r in rows[: cfg.num_prompts]]


def run_benchmark(cfg: BenchmarkConfig, target_cfg: TargetConfig, deployment: Descriptor,
                  merged: Descriptor, target: Descriptor, plan: StagePlan,
                  deploy_cfg: DeployConfig | None = None) -> Descriptor:
    if deployment.figures["engine"] == "sglang":
        return run_endpoint_benchmark(cfg, deploy_cfg or DeployConfig(engine="sglang"),
                                      target_cfg, deployment, merged, target, plan)
    engine, spec = load_embedded_engine(deployment, target_cfg)
    tokenizer = load_tokenizer(target)
    prompts = held_out_prompts(cfg, merged, tokenizer)
    eos = tokenizer.eos_token_id
    for prompt in prompts[: cfg.warmup_prompts]:
        engine.generate(prompt, cfg.max_new_tokens, eos)
        greedy_generate(engine.runner, prompt, cfg.max_new_tokens, eos)

    # Greedy: outputs must be identical to plain greedy decoding. Sampled: each token is
    # distributed as the target's own sampling, so outputs differ and only speed is compared.
    sampled = cfg.temperature > 0
    per_prompt = []
    progress = Progress("benchmark", total=len(prompts), unit="prompt")
    for i, prompt in enumerate(prompts):
        speculative = engine.generate(prompt, cfg.max_new_tokens, eos,
                                      Sampling(cfg.temperature, seed=i))
        greedy = greedy_generate(engine.runner, prompt, cfg.max_new_tokens, eos,
                                 Sampling(cfg.temperature, seed=i))
        per_prompt.append({
            "prompt_tokens": len(prompt),
            "completion_tokens": len(speculative.tokens),
            "plain_tokens": len(greedy.tokens),
            "verify_rounds": speculative.verify_rounds,
            "round_tokens": sum(speculative.round_tokens),
            "speculative_s": speculative.seconds,
            "greedy_s": greedy.seconds,
            "identical": None if sampled else speculative.tokens == greedy.tokens,
        })
        progress.update(1)
    progress.close()

    rounds = sum(p["verify_rounds"] for p in per_prompt)
    acceptance = sum(p["round_tokens"] for p in per_prompt) / max(rounds, 1)
    spec_tokens = sum(p["completion_tokens"] for p in per_prompt)
    spec_tps = spec_tokens / sum(p["speculative_s"] for p in per_prompt)
    greedy_tps = sum(p["plain_tokens"] for p in per_prompt) / sum(p["greedy_s"] for p in per_prompt)
    lossless = None if sampled else all(p["identical"] for p in per_prompt)
    summary = {
        "engine": spec["engine"], "num_steps": spec["num_steps"], "prompts": len(per_prompt),
        "acceptance_length": round(acceptance, 3),
        "speculative_tokens_per_s": round(spec_tps, 1), "greedy_tokens_per_s": round(greedy_tps, 1),
        "speedup": round(spec_tps / greedy_tps, 3), "lossless": lossless,
        "temperature": cfg.temperature,
        "identical_outputs": (f"n/a (sampled at temperature {cfg.temperature})" if sampled else
                              f"{sum(p['identical'] for p in per_prompt)}/{len(per_prompt)}"),
        # Token identity with one-token greedy decoding is exact only in float32 (see deploy).
        "target_dtype": target_cfg.dtype,
    }
    verdict = (f"speculation is {summary['speedup']:.2f}x plain greedy decoding"
               if summary["speedup"] >= 1 else
               f"WARNING: speculation is slower than plain decoding ({summary['speedup']:.2f}x)")
    with stage_output(plan) as out:
        atomic_write_json(out / "report.json", {"summary": summary, "verdict": verdict,
                                                "per_prompt": per_prompt})
        (out / "report.md").write_text(markdown_report(summary, verdict))
        plot_benchmark(["greedy", f"speculative ({spec['num_steps']} steps)"],
                       [greedy_tps, spec_tps], [None, acceptance], out,
                       f"embedded engine, {len(per_prompt)} held-out prompts")
    log.info("benchmark: acceptance length %.2f, %.1f tok/s speculative vs %.1f greedy, "
             "lossless %s; %s", acceptance, spec_tps, greedy_tps, lossless, verdict)
    if lossless is False:
        bad = [i for i, p in enumerate(per_prompt) if not p["identical"]]
        log.error("benchmark: outputs differ from greedy decoding on prompts %s", bad)
    return finish_stage(plan, counts={"prompts": len(per_prompt), "tokens": spec_tokens},
                        figures={**summary, "verdict": verdict,
                                 "report": str(out / "report.md")})


def markdown_report(summary: dict, verdict: str) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    return f"# draftsmith benchmark\n\n| metric | value |\n|---|---|\n{rows}\n\n**{verdict}**\n"


def _sweep(url: str, prompts: list[list[int]], cfg: BenchmarkConfig,
           speculative: bool) -> list[dict]:
    import asyncio

    from draftsmith.bench.client import run_load, summarize

    if cfg.warmup_prompts:
        asyncio.run(run_load(url, prompts[: cfg.warmup_prompts], max_new_tokens=8))
    rows = []
    for concurrency in cfg.concurrency:
        results, wall = asyncio.run(run_load(url, prompts, max_new_tokens=cfg.max_new_tokens,
                                             temperature=cfg.temperature,
                                             concurrency=concurrency))
        row = {"concurrency": concurrency, **summarize(results, wall, speculative)}
        log.info("benchmark %s (%s) at concurrency %d: %s", url,
                 "speculative" if speculative else "baseline", concurrency, row)
        rows.append(row)
    return rows


def _baseline(cfg: BenchmarkConfig, deploy_cfg: DeployConfig, target_cfg: TargetConfig,
              url: str, target: Descriptor, prompts: list[list[int]],
              out: Path) -> tuple[list[dict] | None, str | None]:
    """The same target served without speculation, on the same GPUs: the speculative server
    is stopped first (a TP-8 target does not fit twice). Returns (rows, why it was skipped)."""
    from draftsmith.serve import servers
    from draftsmith.serve.process import ManagedProcess
    from draftsmith.serve.readiness import wait_until_ready
    from draftsmith.serve.sglang_launch import build_launch

    if servers.running(url) is None:
        return None, (f"the speculative server at {url} was not started by this run, so its "
                      "GPUs cannot be freed for a baseline (set benchmark.baseline=false to "
                      "skip it, or let this run start the server)")
    servers.stop(url)
    log.info("benchmark: stopped the speculative server to measure the baseline on its GPUs")
    launch = build_launch(deploy_cfg, target_cfg, None, target.figures["family"], target.path)
    with ManagedProcess(launch.argv, out / "baseline-server.log", launch.env,
                        name="sglang-baseline") as process:
        wait_until_ready(launch.url, deploy_cfg, None, process)
        return _sweep(launch.url, prompts, cfg, speculative=False), None


def run_endpoint_benchmark(cfg: BenchmarkConfig, deploy_cfg: DeployConfig,
                           target_cfg: TargetConfig, deployment: Descriptor, merged: Descriptor,
                           target: Descriptor, plan: StagePlan) -> Descriptor:
    url = deployment.figures["url"]
    prompts = held_out_prompts(cfg, merged, load_tokenizer(target))
    with stage_output(plan) as out:
        sweep = _sweep(url, prompts, cfg, speculative=True)
        baseline, skipped = (_baseline(cfg, deploy_cfg, target_cfg, url, target, prompts, out)
                             if cfg.baseline else (None, "benchmark.baseline is false"))
        summary = {"engine": "sglang", "url": url, "num_steps": deployment.figures["num_steps"],
                   "prompts": len(prompts), "temperature": cfg.temperature,
                   "acceptance_length": sweep[0]["acceptance_length"],
                   "single_stream_tokens_per_s": sweep[0]["tokens_per_s"]}
        if baseline:
            speedups = {row["concurrency"]: round(row["tokens_per_s"] / base["tokens_per_s"], 3)
                        for row, base in zip(sweep, baseline, strict=True)}
            summary["baseline_single_stream_tokens_per_s"] = baseline[0]["tokens_per_s"]
            summary["speedup"] = speedups[sweep[0]["concurrency"]]
            slower = [c for c, s in speedups.items() if s < 1]
            verdict = (f"WARNING: speculation is slower than no speculation at concurrency "
                       f"{slower} (speedups {speedups})" if slower else
                       f"speculation pays: {speedups} x the baseline's tokens/s by concurrency")
        else:
            verdict = (f"no baseline measured ({skipped}), so no speedup is claimed; "
                       f"acceptance length {summary['acceptance_length']:.2f}")
        rows = [{"server": "speculative", **r} for r in sweep]
        rows += [{"server": "baseline", **r} for r in baseline or []]
        atomic_write_json(out / "report.json", {"summary": summary, "rows": rows,
                                                "verdict": verdict})
        columns = list(rows[0])
        table = "\n".join("| " + " | ".join(str(r.get(k)) for k in columns) + " |" for r in rows)
        header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
        (out / "report.md").write_text(f"# draftsmith benchmark: {url}\n\n{header}\n{table}\n\n"
                                       f"**{verdict}**\n")
        plot_benchmark([f"{r['server']} c={r['concurrency']}" for r in rows],
                       [r["tokens_per_s"] for r in rows],
                       [r.get("acceptance_length") for r in rows], out, f"SGLang at {url}")
    log.info("benchmark: %s", verdict)
    return finish_stage(plan, counts={"prompts": len(prompts)},
                        figures={**summary, "verdict": verdict, "lossless": None,
                                 "report": str(out / "report.md")})
