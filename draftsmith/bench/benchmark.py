"""Stage `benchmark`: held-out prompts through the deployed drafter.

Embedded engine: speculative vs plain greedy decoding in-process; acceptance length, tokens/s of
each, and whether the outputs are identical. Served endpoint (SGLang): streamed requests at each
concurrency of the sweep; tokens/s, time to first token, acceptance length from meta_info.
vLLM: the OpenAI API and vLLM's Prometheus counters (draftsmith/bench/vllm_bench.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    atomic_write_json,
    finish_stage,
    stage_output,
)
from draftsmith.bench.charts import markdown_table, plot_benchmark
from draftsmith.bench.identity import first_difference
from draftsmith.bench.parts import BenchmarkParts, device_label
from draftsmith.bench.suite import prompt_conversation, sets_markdown, suite_prompts, with_sets
from draftsmith.bench.sweep import measure_sweep
from draftsmith.config import BenchmarkConfig, DeployConfig, DraftingPoint, TargetConfig
from draftsmith.data.evalsets import EvalPrompt
from draftsmith.data.formats import load_source
from draftsmith.data.merge import read_split
from draftsmith.errors import InputError
from draftsmith.figures import DeployFigures, TargetFigures, TrainFigures
from draftsmith.progress import Progress
from draftsmith.serve.deploy import drafting_label, load_embedded_engine, prompt_ids
from draftsmith.serve.embedded import (
    EmbeddedSpeculativeEngine,
    Generation,
    Sampling,
    plain_generate,
)
from draftsmith.serve.embedded_batch import (
    BatchedSpeculativeDecoder,
    BatchGeneration,
    plain_generate_batch,
)
from draftsmith.target import load_tokenizer

log = logging.getLogger(__name__)


def held_out_prompts(cfg: BenchmarkConfig, merged: Descriptor | None, tokenizer
                     ) -> list[list[int]]:
    """Token ids of each prompt: the conversation up to its last assistant turn, from
    benchmark.prompts_file, benchmark.prompts_builtin (HumanEval) or the validation split
    (never trained on)."""
    if cfg.prompts_file or cfg.prompts_builtin:
        return [prompt_ids(tokenizer, c) for c in file_conversations(cfg, cfg.num_prompts)]
    if merged is None:
        raise InputError("benchmark: no merge output to take held-out prompts from (a drafter "
                         "made elsewhere, deploy.drafter); set benchmark.suite, "
                         "benchmark.prompts_file or benchmark.prompts_builtin")
    rows = read_split(merged, "validation")
    if not rows:
        raise ValueError("benchmark: the validation split is empty; raise "
                         "merge.validation_fraction so there are held-out prompts, or set "
                         "benchmark.prompts_file")
    return [prompt_ids(tokenizer, r["messages"]) for r in rows[: cfg.num_prompts]]


def file_conversations(cfg: BenchmarkConfig, limit: int) -> list[str]:
    """The first `limit` conversations (messages JSON) of benchmark.prompts_file or
    benchmark.prompts_builtin."""
    records, _ = load_source(
        "benchmark.prompts_file" if cfg.prompts_file else f"builtin:{cfg.prompts_builtin}",
        cfg.prompts_file, limit=limit, builtin=cfg.prompts_builtin)
    return [json.dumps([m.model_dump(include={"role", "content"}) for m in r.messages])
            for r in records]


def first_conversation(cfg: BenchmarkConfig) -> str:
    """The first prompt the benchmark measures, as messages JSON: the deploy stage's smoke
    generation when the run has no merge output to take a record from (deploy.drafter)."""
    if cfg.suite:
        return prompt_conversation(suite_prompts(cfg.suite, cfg.splits, 1)[0])
    if cfg.prompts_file or cfg.prompts_builtin:
        return file_conversations(cfg, 1)[0]
    raise InputError("benchmark: no prompt to smoke-test a drafter made elsewhere "
                     "(deploy.drafter) with; set benchmark.suite, benchmark.prompts_file or "
                     "benchmark.prompts_builtin")


def benchmark_prompts(cfg: BenchmarkConfig, merged: Descriptor | None, tokenizer
                      ) -> tuple[list[list[int]], list[EvalPrompt] | None]:
    """Token ids of the prompts measured, and with benchmark.suite the evaluation prompt each
    one is (its set and part), in the same order."""
    if not cfg.suite:
        return held_out_prompts(cfg, merged, tokenizer), None
    chosen = suite_prompts(cfg.suite, cfg.splits, cfg.prompts_per_set)
    return [prompt_ids(tokenizer, prompt_conversation(p)) for p in chosen], chosen


def made_elsewhere(drafter_files: str | None) -> dict[str, str]:
    """What a sweep point's key adds for a drafter made elsewhere: its files' fingerprint (its
    directory is the user's, so the path alone does not say what was measured)."""
    return {"drafter_files": drafter_files} if drafter_files else {}


def known(*descriptors: Descriptor | None) -> list[Descriptor]:
    """The inputs a sweep point's key covers: those this run has (a drafter made elsewhere
    comes without a merge output)."""
    return [d for d in descriptors if d is not None]


@contextlib.contextmanager
def warming_up(label: str, cfg: BenchmarkConfig) -> Iterator[None]:
    """Say that a warm-up runs (benchmark.warmup_prompts) and how long it took: on a GPU it
    compiles and captures the steps of each new shape, minutes on a fresh machine with nothing
    else in the log."""
    if not cfg.warmup_prompts:
        yield
        return
    log.info("%s: warming up (on a GPU the first time compiles and captures its steps: "
             "minutes on a fresh machine)", label)
    started = time.perf_counter()
    yield
    log.info("%s: warm after %.0f s", label, time.perf_counter() - started)


def longest_first(prompts: list[list[int]], count: int) -> list[list[int]]:
    """The warm-up prompts: the `count` longest. A static cache grows to the longest prompt it
    has been given, and on CUDA each new length compiles and records its steps again (45 s
    inside the first H100 measurement, 2026-12-05, when a 129-token prompt outgrew the
    warm-up's cache); after the longest, every measured prompt fits the caches there are."""
    return sorted(prompts, key=len, reverse=True)[:count]


def decode_each(prompts: list[list[int]], cfg: BenchmarkConfig, label: str,
                decode: Callable[[list[int], Sampling], Generation]) -> list[Generation]:
    """decode(prompt, sampling) for every prompt at cfg.temperature, each seeded by its index
    (so plain and speculative decoding of a prompt draw alike), with progress."""
    progress = Progress(label, total=len(prompts), unit="prompt")
    out = []
    for i, prompt in enumerate(prompts):
        out.append(decode(prompt, Sampling(cfg.temperature, seed=i)))
        progress.update(1)
    progress.close()
    return out


def plain_decoding(engine, prompts: list[list[int]], cfg: BenchmarkConfig,
                   eos: int | None) -> list[Generation]:
    """The baseline: every prompt decoded without speculation by the engine's target, at
    cfg.temperature (measured once per temperature and shared by every drafting config).
    It runs over the target's cache at the size the engine's own generations of these prompts
    take: a tree's is larger, and when its first generation replaced a smaller one, the
    plain step was compiled again for the new cache inside a later measured pass (43 s in
    one plain pass of an H200's speed pairs, which then said 4.4x)."""
    engine.size_target_cache(max(map(len, prompts)), cfg.max_new_tokens)
    runner = engine.runner
    with warming_up("benchmark plain decoding", cfg):
        for prompt in longest_first(prompts, cfg.warmup_prompts):
            plain_generate(runner, prompt, cfg.max_new_tokens, eos)
    return decode_each(prompts, cfg, "benchmark plain decoding",
                       lambda prompt, sampling: plain_generate(runner, prompt,
                                                               cfg.max_new_tokens, eos, sampling))


def accepted_by_position(round_tokens: list[int], num_steps: int) -> list[int]:
    """How many verify rounds accepted a j-th draft, j = 0..num_steps-1: a round keeps its
    accepted drafts and the target's own token."""
    accepted = [0] * num_steps
    for kept in round_tokens:
        for j in range(min(kept - 1, num_steps)):
            accepted[j] += 1
    return accepted


def acceptance_figures(round_tokens: list[list[int]], num_steps: int
                       ) -> tuple[float, list[float]]:
    """Over every prompt's verify rounds (tokens kept per round): tokens per round, and the
    share of rounds whose j-th draft was accepted, as vLLM's counters report it."""
    rounds = sum(len(r) for r in round_tokens)
    acceptance = sum(sum(r) for r in round_tokens) / max(rounds, 1)
    accepted = [sum(col) for col in zip(*(accepted_by_position(r, num_steps)
                                          for r in round_tokens), strict=True)]
    return acceptance, [round(a / max(rounds, 1), 4) for a in accepted]


def other_gpu_processes() -> list[str] | None:
    """The compute processes besides this one on the GPUs this process may use (all of the
    host's, or those CUDA_VISIBLE_DEVICES names by index), as `pid name`; None without
    nvidia-smi."""
    from draftsmith.serve.gpus import gpu_processes

    processes = gpu_processes()
    if processes is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = None if visible is None else {g.strip() for g in visible.split(",")}
    return [f"{p.pid} {p.name}" for p in processes
            if p.pid != os.getpid() and (mine is None or p.gpu in mine)]


def measured_on(device, cache: str, others: list[str] | None, steps: str | None = None
                ) -> dict:
    """Where the timings were taken, for the row that quotes them: the device, the target's
    cache, how the fixed-width steps ran (`steps`: EmbeddedSpeculativeEngine.steps_ran), and
    whether anything else ran on the GPU (`alone`; None on a CPU, or where nvidia-smi cannot
    tell)."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{device.type} ({torch.get_num_threads()} threads)"
    return {"device": name, "target_cache": cache, "steps": steps,
            "alone": None if others is None or device.type != "cuda" else not others,
            "other_gpu_processes": others if device.type == "cuda" else None}


def step_costs(per_prompt: list[dict], acceptance: float) -> dict:
    """Where decoding time goes, prompts' forwards left out: a plain token's step, and a
    speculative round's drafting, verification and the rest (bookkeeping, the aux states,
    sampling), in ms. speedup_limit is acceptance x plain step / verify: the speedup if drafting
    and bookkeeping cost nothing, which the measured speedup approaches as the engine does.
    ms_per_prompt: the median prompt's forward to its first token, plain and speculative (a
    batch: a group's), in both sides' wall time but in none of the figures above."""
    rounds = sum(p["verify_rounds"] for p in per_prompt)
    plain_steps = sum(p["plain_steps"] for p in per_prompt)
    if not rounds or not plain_steps:
        return {"ms_per_plain_token": None, "ms_per_round": None, "speedup_limit": None,
                "ms_per_prompt": None}
    draft = sum(p["draft_s"] for p in per_prompt)
    verify = sum(p["verify_s"] for p in per_prompt)
    decoding = sum(p["speculative_s"] - p["prefill_s"] for p in per_prompt)
    plain_ms = 1000 * sum(p["greedy_decode_s"] for p in per_prompt) / plain_steps
    verify_ms = 1000 * verify / rounds
    return {"ms_per_plain_token": round(plain_ms, 3),
            "ms_per_round": {"draft": round(1000 * draft / rounds, 3),
                             "verify": round(verify_ms, 3),
                             "other": round(1000 * (decoding - draft - verify) / rounds, 3)},
            "speedup_limit": round(acceptance * plain_ms / verify_ms, 3) if verify_ms else None,
            "ms_per_prompt": {side: round(1000 * statistics.median(p[key] for p in per_prompt), 3)
                              for side, key in (("plain", "greedy_prefill_s"),
                                                ("speculative", "prefill_s"))}}


def timings(greedy: Generation, speculative: Generation) -> dict:
    """One prompt's times, plain and speculative, as step_costs reads them."""
    return {"verify_rounds": speculative.verify_rounds,
            "speculative_s": speculative.seconds,
            "prefill_s": speculative.prefill_seconds,
            "draft_s": speculative.draft_seconds,
            "verify_s": speculative.verify_seconds,
            "greedy_s": greedy.seconds,
            "greedy_prefill_s": greedy.prefill_seconds,
            "greedy_decode_s": greedy.verify_seconds,
            "plain_steps": greedy.verify_rounds}


def measure_embedded(engine, prompts: list[list[int]], cfg: BenchmarkConfig,
                     eos: int | None, label: str,
                     plain: list[Generation]) -> tuple[dict, list[dict]]:
    """Speculative decoding of every prompt against `plain` (plain_decoding at the same
    temperature). Greedy: outputs must be identical to plain greedy decoding. Sampled: each
    token is distributed as the target's own sampling, so outputs differ and only speed is
    compared."""
    with warming_up(f"benchmark {label}", cfg):
        for prompt in longest_first(prompts, cfg.warmup_prompts):
            engine.generate(prompt, cfg.max_new_tokens, eos)
    sampled = cfg.temperature > 0
    per_prompt = []
    round_tokens = []
    generated = decode_each(prompts, cfg, f"benchmark {label}",
                            lambda prompt, sampling: engine.generate(
                                prompt, cfg.max_new_tokens, eos, sampling))
    for prompt, greedy, speculative in zip(prompts, plain, generated, strict=True):
        round_tokens.append(speculative.round_tokens)
        per_prompt.append({
            "prompt_tokens": len(prompt),
            "completion_tokens": len(speculative.tokens),
            "plain_tokens": len(greedy.tokens),
            "round_tokens": sum(speculative.round_tokens),
            "accepted_by_position": accepted_by_position(speculative.round_tokens,
                                                         engine.num_steps),
            **timings(greedy, speculative),
            "identical": None if sampled else speculative.tokens == greedy.tokens,
        })

    acceptance, per_position = acceptance_figures(round_tokens, engine.num_steps)
    spec_tokens = sum(p["completion_tokens"] for p in per_prompt)
    spec_tps = spec_tokens / sum(p["speculative_s"] for p in per_prompt)
    greedy_tps = sum(p["plain_tokens"] for p in per_prompt) / sum(p["greedy_s"] for p in per_prompt)
    lossless = None if sampled else all(p["identical"] for p in per_prompt)
    summary = {
        "config": label, "num_steps": engine.num_steps, "eagle_topk": engine.topk,
        "num_draft_tokens": engine.num_draft_tokens, "prompts": len(per_prompt),
        "completion_tokens": spec_tokens,
        "acceptance_length": round(acceptance, 3),
        "accepted_per_position": per_position,
        "speculative_tokens_per_s": round(spec_tps, 1), "greedy_tokens_per_s": round(greedy_tps, 1),
        "speedup": round(spec_tps / greedy_tps, 3), "lossless": lossless,
        "identical_outputs": (f"n/a (sampled at temperature {cfg.temperature})" if sampled else
                              f"{sum(p['identical'] for p in per_prompt)}/{len(per_prompt)}"),
        **step_costs(per_prompt, acceptance),
    }
    if lossless is False:
        bad = [i for i, p in enumerate(per_prompt) if not p["identical"]]
        level, why = identity_log(engine, lossless)
        log.log(level, "benchmark %s: outputs differ from greedy decoding on prompts %s%s",
                label, bad, why)
    return summary, per_prompt


def identity_log(engine, lossless: bool | None) -> tuple[int, str]:
    """How outputs that leave greedy decoding are logged: an error where identity is exact (a
    float32 target) unless they all leave at near ties; in a lower precision a warning that
    says why (the deploy check treats it alike)."""
    import torch

    dtype = next(engine.runner.model.parameters()).dtype
    if dtype in (torch.float32, torch.float64):
        return (logging.WARNING if lossless else logging.ERROR), ""
    return logging.WARNING, (f" (a {str(dtype).removeprefix('torch.')} target: a verify "
                             "forward rounds otherwise than one-token steps, so near ties "
                             "flip; identity is exact in float32)")


def decode_again(engine, prompts: list[list[int]], cfg: BenchmarkConfig, eos: int | None,
                 side: str) -> list[Generation]:
    """Every prompt decoded once more, plain or speculative, at cfg.temperature (the same
    seeds as the measurement)."""
    def decode(prompt: list[int], sampling: Sampling) -> Generation:
        if side == "plain":
            return plain_generate(engine.runner, prompt, cfg.max_new_tokens, eos, sampling)
        return engine.generate(prompt, cfg.max_new_tokens, eos, sampling)

    return decode_each(prompts, cfg, f"benchmark repeat, {side}", decode)


STEP_COSTS = ("ms_per_plain_token", "ms_per_round", "speedup_limit", "ms_per_prompt")
PAIRS_AGREE = 1.1  # speed pairs further apart than this are worth a warning


def repeated_speedups(engine, prompts: list[list[int]], cfg: BenchmarkConfig,
                      eos: int | None, first: dict) -> dict:
    """benchmark.repeats pairs of plain and speculative tokens/s: the first is the measurement
    (plain decoding first), each later pair decodes every prompt again both ways with the
    order alternating, so that a machine whose load drifts favours neither side. The speedup
    is the pairs' median, with their spread, as for vLLM. Each pair has its step costs; the
    report's are the median pair's (`step_costs_from`), so that they explain the speedup it
    gives: a first pass that still compiled, or shared the machine, explains neither."""
    pairs = [{"order": "plain first", "greedy_tokens_per_s": first["greedy_tokens_per_s"],
              "speculative_tokens_per_s": first["speculative_tokens_per_s"],
              "speedup": first["speedup"], **{key: first[key] for key in STEP_COSTS}}]
    for repeat in range(1, cfg.repeats):
        order = ("speculative", "plain") if repeat % 2 else ("plain", "speculative")
        runs = {side: decode_again(engine, prompts, cfg, eos, side) for side in order}
        rates = {side: sum(len(r.tokens) for r in done) / sum(r.seconds for r in done)
                 for side, done in runs.items()}
        acceptance, _ = acceptance_figures([r.round_tokens for r in runs["speculative"]],
                                           engine.num_steps)
        pairs.append({"order": f"{order[0]} first",
                      "greedy_tokens_per_s": round(rates["plain"], 1),
                      "speculative_tokens_per_s": round(rates["speculative"], 1),
                      "speedup": round(rates["speculative"] / rates["plain"], 3),
                      **step_costs([timings(g, s) for g, s in zip(
                          runs["plain"], runs["speculative"], strict=True)], acceptance)})
        log.info("benchmark: speed pair %d of %d (%s first): %.3fx", repeat + 1, cfg.repeats,
                 order[0], pairs[-1]["speedup"])
    speedups = [p["speedup"] for p in pairs]
    median_pair = speedups.index(statistics.median_low(speedups))
    if max(speedups) > PAIRS_AGREE * min(speedups):
        log.warning(
            "benchmark: the speed pairs disagree, %s: the machine's load changed between them, "
            "or the first pass was not warm yet. The report gives the median pair's figures; "
            "for steadier ones raise benchmark.warmup_prompts (now %d) or benchmark.repeats "
            "(now %d), and keep other work off the device",
            ", ".join(f"{p['speedup']:.2f}x ({p['order']})" for p in pairs),
            cfg.warmup_prompts, cfg.repeats)
    return {"speedup": round(statistics.median(speedups), 3),
            "speedup_spread": [min(speedups), max(speedups)], "speedup_pairs": pairs,
            **{key: pairs[median_pair][key] for key in STEP_COSTS},
            "step_costs_from": f"speed pair {median_pair + 1} of {len(pairs)}"}


def measure_batched(engine, prompts: list[list[int]], cfg: BenchmarkConfig, eos: int | None,
                    batch: int, plain: list[list[int]]) -> dict:
    """`batch` prompts decoded at once, plain and then speculative for each group of prompts in
    turn. Greedy: every row must equal plain decoding of its prompt alone (`plain`: those
    tokens), or leave it first at a near tie (`first_difference`): a batch sums attention over
    a longer cache with holes, in another order than one prompt alone does."""
    decoder = BatchedSpeculativeDecoder(engine)
    groups = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
    if len(prompts) < batch:
        log.warning("benchmark batch %d: only %d prompts, so the batch holds %d; raise "
                    "benchmark.num_prompts (or prompts_per_set) to fill it", batch, len(prompts),
                    len(prompts))

    def plain_rows(group: list[int]) -> BatchGeneration:
        return plain_generate_batch(engine.runner, [prompts[i] for i in group],
                                    cfg.max_new_tokens, eos,
                                    [Sampling(cfg.temperature, seed=i) for i in group])

    def speculative_rows(group: list[int]) -> BatchGeneration:
        return decoder.generate([prompts[i] for i in group], cfg.max_new_tokens, eos,
                                [Sampling(cfg.temperature, seed=i) for i in group])

    def run(group: list[int]) -> tuple[BatchGeneration, BatchGeneration]:
        return plain_rows(group), speculative_rows(group)

    # Each group size once (the longest prompts): a new size compiles its steps on CUDA.
    sizes = sorted({len(g) for g in groups}, reverse=True) if cfg.warmup_prompts else []
    with warming_up(f"benchmark batch {batch}", cfg):
        for size in sizes:
            group = max((g for g in groups if len(g) == size),  # the caches at their final
                        key=lambda g: max(len(prompts[i]) for i in g))  # length
            # Speculative first: its cache (room for every round's drafts) is the longer, and
            # plain decoding then runs over the same one. The other way round, the target's
            # steps compile for plain's cache and again for the longer one.
            speculative_rows(group)
            plain_rows(group)
    progress = Progress(f"benchmark batch {batch}", total=len(prompts), unit="prompt")
    runs = []
    for group in groups:
        runs.append(run(group))
        progress.update(len(group))
    progress.close()
    plain_rows = [row for baseline, _ in runs for row in baseline.rows]
    rows = [row for _, speculative in runs for row in speculative.rows]
    acceptance, per_position = acceptance_figures([r.round_tokens for r in rows],
                                                  engine.num_steps)
    tokens = sum(len(r.tokens) for r in rows)
    spec_tps = tokens / sum(s.seconds for _, s in runs)
    plain_tps = sum(len(r.tokens) for r in plain_rows) / sum(b.seconds for b, _ in runs)
    sampled = cfg.temperature > 0
    identical = [r.tokens == p for r, p in zip(rows, plain, strict=True)]
    differences = [] if sampled else [
        {"prompt": i, **first_difference(engine.runner, prompts[i], plain[i], rows[i].tokens)}
        for i, same in enumerate(identical) if not same]
    plain_identical = [r.tokens == p for r, p in zip(plain_rows, plain, strict=True)]
    # A round (a step) of the batch: num_steps drafts and one verify for every sequence (one
    # token for every sequence).
    costs = step_costs([{"verify_rounds": s.forwards, "plain_steps": b.forwards,
                         "draft_s": s.draft_seconds, "verify_s": s.verify_seconds,
                         "speculative_s": s.seconds, "prefill_s": s.prefill_seconds,
                         "greedy_prefill_s": b.prefill_seconds,
                         "greedy_decode_s": b.verify_seconds} for b, s in runs], acceptance)
    summary = {
        "batch": batch, "prompts": len(rows),
        "groups": [len(g) for g in groups],  # prompts decoded together, group by group
        "completion_tokens": tokens,
        "acceptance_length": round(acceptance, 3),
        "accepted_per_position": per_position,
        "speculative_tokens_per_s": round(spec_tps, 1), "greedy_tokens_per_s": round(plain_tps, 1),
        "speedup": round(spec_tps / plain_tps, 3),
        "lossless": None if sampled else all(d["near_tie"] for d in differences),
        "identical_outputs": (f"n/a (sampled at temperature {cfg.temperature})" if sampled else
                              f"{sum(identical)}/{len(identical)}"),
        "near_ties": None if sampled else sum(d["near_tie"] for d in differences),
        "differences": differences,
        # Batched plain decoding against one prompt at a time: where float32 is exact, all.
        "plain_identical_outputs": None if sampled else
        f"{sum(plain_identical)}/{len(plain_identical)}",
        **costs,
    }
    if differences:
        level, why = identity_log(engine, summary["lossless"])
        log.log(level, "benchmark batch %d: outputs leave greedy decoding at %s%s", batch,
                differences, why)
    return summary


def one_prompt_at_a_time(engine, prompts: list[list[int]], cfg: BenchmarkConfig,
                         eos: int | None, label: str, plain: list[Generation]) -> dict:
    """The benchmark's batch-1 part: measure_embedded against plain decoding, and the
    repeated speed pairs; with the plain tokens (the batches' reference) and how the steps
    ran."""
    summary, per_prompt = measure_embedded(engine, prompts, cfg, eos, label, plain)
    if cfg.repeats > 1:
        summary.update(repeated_speedups(engine, prompts, cfg, eos, summary))
    return {"summary": summary, "per_prompt": per_prompt,
            "plain_tokens": [run.tokens for run in plain]}


def on_this_device(engine, measure: Callable[[], dict]) -> dict:
    """measure()'s result with where it ran (`measured_on`): the device, the target's cache,
    how the steps ran, and whether anything else used the GPU before or after it."""
    on_gpu = engine.device.type == "cuda"
    before = other_gpu_processes() if on_gpu else None
    result = measure()
    after = other_gpu_processes() if on_gpu else None
    others = None if before is None or after is None else sorted(set(before) | set(after))
    return {**result, "measured_on": measured_on(engine.device, engine.runner.cache_kind,
                                                 others, engine.steps_ran())}


def sampled_run(engine, prompts: list[list[int]], cfg: BenchmarkConfig, eos: int | None,
                label: str) -> dict:
    """The deployed config again at benchmark.sampled_temperature, against plain decoding at
    that temperature."""
    sampled_cfg = cfg.model_copy(update={"temperature": cfg.sampled_temperature})
    sampled_plain = plain_decoding(engine, prompts, sampled_cfg, eos)
    return {**measure_embedded(engine, prompts, sampled_cfg, eos,
                               f"{label} @ T={cfg.sampled_temperature}", sampled_plain)[0],
            "temperature": cfg.sampled_temperature}


def run_benchmark(cfg: BenchmarkConfig, target_cfg: TargetConfig, deployment: Descriptor,
                  merged: Descriptor | None, target: Descriptor, plan: StagePlan,
                  deploy_cfg: DeployConfig | None = None,
                  trained: Descriptor | None = None) -> Descriptor:
    """merged: the merge stage's descriptor (its validation split is the default prompt set;
    None for a drafter made elsewhere). trained: the train stage's descriptor, whose validation
    full_acc per TTT step sits next to the served engine's acceptance per position
    (optional)."""
    engine = DeployFigures.of(deployment).engine
    if engine != "embedded" and cfg.batch_sizes:
        log.warning("benchmark.batch_sizes %s: the embedded engine's setting; a served engine "
                    "is measured at benchmark.concurrency", cfg.batch_sizes)
    if engine == "vllm":
        from draftsmith.bench.vllm_bench import run_vllm_benchmark

        full_acc = (TrainFigures.of(trained).full_acc or None) if trained else None
        prompts, suite = benchmark_prompts(cfg, merged, load_tokenizer(target))
        return run_vllm_benchmark(cfg, deploy_cfg or DeployConfig(engine="vllm"), target_cfg,
                                  deployment, prompts, target, plan, full_acc,
                                  trained_dir=trained.path if trained else None, suite=suite)
    if engine == "sglang":
        return run_endpoint_benchmark(cfg, deploy_cfg or DeployConfig(engine="sglang"),
                                      target_cfg, deployment, merged, target, plan)
    engine, spec = load_embedded_engine(deployment, target_cfg)
    if cfg.batch_sizes and engine.is_tree:
        raise InputError(f"benchmark.batch_sizes {cfg.batch_sizes} with deploy.eagle_topk "
                         f"{engine.topk}: batched decoding drafts chains; set "
                         "deploy.eagle_topk: 1, or benchmark.batch_sizes: []")
    tokenizer = load_tokenizer(target)
    prompts, suite = benchmark_prompts(cfg, merged, tokenizer)
    eos = tokenizer.eos_token_id
    deployed = drafting_label(spec["num_steps"], spec["eagle_topk"], spec["num_draft_tokens"])
    material = {"engine": "embedded", "drafter_dir": spec["drafter_dir"],
                "target_dtype": target_cfg.dtype,
                **made_elsewhere(spec.get("drafter_files"))}
    if engine.cache != "auto":  # the timings differ; `auto` keeps the earlier runs' key
        material["embedded_cache"] = engine.cache
    elif engine.cache_kind != "dynamic":  # auto ran the dynamic cache everywhere before
        material["embedded_cache"] = f"auto: {engine.cache_kind}"
    parts = BenchmarkParts(plan, cfg, {**material, "device": device_label(engine.device)},
                           known(merged, target))
    # Plain decoding's timings, once, if a part measured now needs them.
    plain = functools.cache(lambda: plain_decoding(engine, prompts, cfg, eos))
    # The report's summary fields that are not measured, kept in the part: a part file alone
    # says what it is (benchmarks/gpu_speculative/summary.py reads a cut-off stage's parts).
    described = {"engine": spec["engine"], "temperature": cfg.temperature,
                 "target_dtype": target_cfg.dtype}
    one = parts.measure(
        "batch 1", lambda: {**on_this_device(engine, lambda: one_prompt_at_a_time(
            engine, prompts, cfg, eos, deployed, plain())), **described},
        not_deciding=("batch_sizes", "sampled_temperature"),
        figures=lambda part: part["summary"])
    per_prompt = one["per_prompt"]
    sets = with_sets(cfg, suite, per_prompt, engine.num_steps)
    batched = [parts.measure(
        f"batch {size}", lambda size=size: on_this_device(engine, lambda: measure_batched(
            engine, prompts, cfg, eos, size, one["plain_tokens"])),
        not_deciding=("batch_sizes", "sampled_temperature", "repeats"))
        for size in cfg.batch_sizes]

    def measure_point(point: DraftingPoint, _out: Path) -> dict:
        point_engine = EmbeddedSpeculativeEngine(
            engine.runner.model, engine.drafter, point.num_steps, point.eagle_topk,
            point.num_draft_tokens, engine.cache)
        try:
            return measure_embedded(point_engine, prompts, cfg, eos, point.label, plain())[0]
        finally:
            point_engine.runner.close()

    points = measure_sweep(cfg, plan, material, known(merged, target), measure_point)
    # The best config is chosen among runs at the benchmark's own temperature.
    best = max((c for c in [one["summary"], *points] if c["lossless"] is not False),
               key=lambda c: c["speedup"], default=one["summary"])
    configs = [one["summary"], *points]
    if cfg.sampled_temperature:
        configs.append(parts.measure(
            f"sampled at T={cfg.sampled_temperature}",
            lambda: sampled_run(engine, prompts, cfg, eos, deployed),
            not_deciding=("batch_sizes", "repeats")))
    # target_dtype: token identity with one-token greedy decoding is exact only in float32.
    summary = {"engine": spec["engine"], **one["summary"], **described,
               "measured_on": one["measured_on"]}
    if points:
        summary["best_config"] = best["config"]
    if summary["lossless"] is not None:  # greedy: every greedy config must be identical
        summary["lossless"] = all(c["lossless"] for c in [*configs, *batched]
                                  if c["lossless"] is not None)
    verdict = (f"speculation is {best['speedup']:.2f}x plain greedy decoding ({best['config']})"
               if best["speedup"] >= 1 else
               f"WARNING: speculation is slower than plain decoding ({best['speedup']:.2f}x "
               f"at best, {best['config']})")
    with stage_output(plan) as out:
        atomic_write_json(out / "report.json", {"summary": summary, "verdict": verdict,
                                                "sets": sets, "configs": configs,
                                                "batched": batched, "per_prompt": per_prompt})
        (out / "report.md").write_text(markdown_report(summary, verdict, configs, sets,
                                                       batched))
        plot_benchmark(["greedy", *(c["config"] for c in configs)],
                       [configs[0]["greedy_tokens_per_s"],
                        *(c["speculative_tokens_per_s"] for c in configs)],
                       [None, *(c["acceptance_length"] for c in configs)], out,
                       f"embedded engine, {len(per_prompt)} held-out prompts")
    log.info("benchmark: acceptance length %.2f, %.1f tok/s speculative vs %.1f greedy, "
             "lossless %s; %s", summary["acceptance_length"],
             summary["speculative_tokens_per_s"], summary["greedy_tokens_per_s"],
             summary["lossless"], verdict)
    return finish_stage(plan, counts={"prompts": len(per_prompt),
                                      "tokens": summary["completion_tokens"]},
                        figures={**summary, "verdict": verdict, "sets": sets,
                                 "batched": batched, "report": str(out / "report.md")})


def markdown_report(summary: dict, verdict: str, configs: list[dict] | None = None,
                    sets: list[dict] | None = None, batched: list[dict] | None = None) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    text = f"# draftsmith benchmark\n\n| metric | value |\n|---|---|\n{rows}\n"
    if sets:
        text += ("\n## By prompt set\n\nAcceptance length with a 95% bootstrap interval over "
                 "prompts; per position: the share of rounds that accepted the j-th draft.\n\n"
                 + sets_markdown(sets))
    if configs and len(configs) > 1:
        text += "\n## Drafting configs\n\n" + markdown_table(configs)
    if batched:
        text += ("\n## Several prompts at once\n\nPlain and speculative decoding of `batch` "
                 "prompts together; ms per plain token and per round are a step of the whole "
                 "batch.\n\n" + markdown_table(batched))
    return text + f"\n**{verdict}**\n"


def _concurrency_sweep(url: str, prompts: list[list[int]], cfg: BenchmarkConfig,
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


def _serve_and_measure(deploy_cfg: DeployConfig, target_cfg: TargetConfig,
                       drafter_dir: str | None, target: Descriptor, prompts: list[list[int]],
                       cfg: BenchmarkConfig, log_path: Path, name: str) -> list[dict]:
    """Launch a server (drafter_dir None: no speculation), wait for readiness, measure the
    concurrency sweep, stop it with its whole process group."""
    from draftsmith.serve.engine_adapter import start_until_ready
    from draftsmith.serve.sglang_launch import build_launch, wait_until_ready

    launch = build_launch(deploy_cfg, target_cfg, drafter_dir, TargetFigures.of(target).family,
                          target.path)
    process, _ = start_until_ready(  # the deploy port checked first, as every server start
        launch, log_path, name,
        lambda started: wait_until_ready(launch.url, deploy_cfg, drafter_dir, started))
    try:
        return _concurrency_sweep(launch.url, prompts, cfg, speculative=drafter_dir is not None)
    finally:
        process.stop()


def run_endpoint_benchmark(cfg: BenchmarkConfig, deploy_cfg: DeployConfig,
                           target_cfg: TargetConfig, deployment: Descriptor,
                           merged: Descriptor | None, target: Descriptor,
                           plan: StagePlan) -> Descriptor:
    from draftsmith.serve import servers

    deployed = DeployFigures.of(deployment)
    url, drafter_dir = deployed.url, deployed.drafter_dir
    prompts, _ = benchmark_prompts(cfg, merged, load_tokenizer(target))
    deployed = drafting_label(deploy_cfg.num_steps, deploy_cfg.eagle_topk,
                              deploy_cfg.num_draft_tokens)
    from draftsmith.serve.sglang_launch import max_running_requests

    cap = max_running_requests(deploy_cfg)
    if max(cfg.concurrency) > cap:
        log.warning("benchmark: concurrency %s is above the servers' max_running_requests=%d: "
                    "requests beyond it queue, on both servers (raise "
                    "deploy.max_running_requests to measure them running)",
                    [c for c in cfg.concurrency if c > cap], cap)
    with stage_output(plan) as out:
        sweep = _concurrency_sweep(url, prompts, cfg, speculative=True)
        sampled = (_concurrency_sweep(url, prompts, cfg.model_copy(
            update={"temperature": cfg.sampled_temperature}), speculative=True)
            if cfg.sampled_temperature else None)
        # Sweep points and the baseline need the deployed server's GPUs (a TP-8 target does
        # not fit twice), so they run only when this run started that server and can stop it.
        owned = servers.running(url) is not None
        not_owned = (f"the speculative server at {url} was not started by this run, so its "
                     "GPUs cannot be freed")
        if owned and (cfg.sweep or cfg.baseline):
            servers.stop(url)
            log.info("benchmark: stopped the deployed server to free its GPUs for the "
                     "sweep points and the baseline")

        def measure_point(point: DraftingPoint, point_out: Path) -> dict:
            rows = _serve_and_measure(deploy_cfg.model_copy(update=point.model_dump()),
                                      target_cfg, drafter_dir, target, prompts, cfg,
                                      point_out / "server.log", f"sglang-{point.label}")
            return {"config": point.label, **point.model_dump(),
                    "acceptance_length": rows[0]["acceptance_length"],
                    "tokens_per_s": rows[0]["tokens_per_s"], "rows": rows}

        points: list[dict] = []
        if cfg.sweep and owned:
            material = {"engine": "sglang", "drafter_dir": drafter_dir,
                        **made_elsewhere(DeployFigures.of(deployment).drafter_files),
                        "deploy": deploy_cfg.model_dump(mode="json", exclude={
                            "num_steps", "eagle_topk", "num_draft_tokens", "keep_serving",
                            "embedded_cache"})}
            points = measure_sweep(cfg, plan, material, known(merged, target), measure_point)
        elif cfg.sweep:
            log.warning("benchmark: drafting sweep skipped: %s (let this run start the "
                        "server)", not_owned)
        baseline, skipped = None, "benchmark.baseline is false"
        if cfg.baseline and owned:
            baseline = _serve_and_measure(deploy_cfg, target_cfg, None, target, prompts, cfg,
                                          out / "baseline-server.log", "sglang-baseline")
        elif cfg.baseline:
            skipped = f"{not_owned} (set benchmark.baseline=false, or let this run start it)"

        configs = [{"config": deployed, "num_steps": deploy_cfg.num_steps,
                    "eagle_topk": deploy_cfg.eagle_topk,
                    "num_draft_tokens": deploy_cfg.num_draft_tokens,
                    "acceptance_length": sweep[0]["acceptance_length"],
                    "tokens_per_s": sweep[0]["tokens_per_s"], "rows": sweep}, *points]
        if sampled:
            configs.append({"config": f"{deployed} @ T={cfg.sampled_temperature}",
                            "temperature": cfg.sampled_temperature,
                            "acceptance_length": sampled[0]["acceptance_length"],
                            "tokens_per_s": sampled[0]["tokens_per_s"], "rows": sampled})
        summary = {"engine": "sglang", "url": url, "config": deployed,
                   "num_steps": deploy_cfg.num_steps, "prompts": len(prompts),
                   "temperature": cfg.temperature,
                   "acceptance_length": sweep[0]["acceptance_length"],
                   "single_stream_tokens_per_s": sweep[0]["tokens_per_s"]}
        best = max((c for c in configs if "temperature" not in c),
                   key=lambda c: c["tokens_per_s"])
        if points:
            summary["best_config"] = best["config"]
        if baseline:
            base = baseline[0]["tokens_per_s"]
            for config in configs:
                config["speedup"] = round(config["tokens_per_s"] / base, 3)
            speedups = {row["concurrency"]: round(row["tokens_per_s"] / b["tokens_per_s"], 3)
                        for row, b in zip(sweep, baseline, strict=True)}
            summary["baseline_single_stream_tokens_per_s"] = base
            summary["speedup"] = speedups[sweep[0]["concurrency"]]
            slower = [c for c, s in speedups.items() if s < 1]
            verdict = (f"WARNING: speculation is slower than no speculation at concurrency "
                       f"{slower} (speedups {speedups})" if slower else
                       f"speculation pays: {speedups} x the baseline's tokens/s by concurrency")
            if points:
                verdict += (f"; best drafting config {best['config']} at "
                            f"{best['speedup']:.2f}x single stream")
        else:
            verdict = (f"no baseline measured ({skipped}), so no speedup is claimed; "
                       f"acceptance length {summary['acceptance_length']:.2f}")
        rows = [{"server": c["config"], **r} for c in configs for r in c["rows"]]
        rows += [{"server": "baseline", **r} for r in baseline or []]
        table_configs = [{k: v for k, v in c.items() if k != "rows"} for c in configs]
        atomic_write_json(out / "report.json", {"summary": summary, "rows": rows,
                                                "configs": table_configs, "verdict": verdict})
        text = f"# draftsmith benchmark: {url}\n\n{markdown_table(rows)}"
        if len(configs) > 1:
            text += f"\n## Drafting configs\n\n{markdown_table(table_configs)}"
        (out / "report.md").write_text(f"{text}\n**{verdict}**\n")
        plot_benchmark([f"{r['server']} c={r['concurrency']}" for r in rows],
                       [r["tokens_per_s"] for r in rows],
                       [r.get("acceptance_length") for r in rows], out, f"SGLang at {url}")
    log.info("benchmark: %s", verdict)
    return finish_stage(plan, counts={"prompts": len(prompts)},
                        figures={**summary, "verdict": verdict, "lossless": None,
                                 "report": str(out / "report.md")})
