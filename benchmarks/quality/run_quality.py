"""Quality benchmark: a real small target, the whole draftsmith pipeline, measured acceptance.

No pretrained model can be downloaded where this runs, so the benchmark brings its own real
target: a Llama trained here, for a few minutes, on the Python source files installed on the
machine (a BPE tokenizer trained on the same files). Its task is the demo's "complete this
function" chat, so its next-token distribution is peaked and real. Then:

  prompts from held-out source files -> generate (the target answers them) -> merge ->
  extract -> train the drafter -> fix-keys -> deploy (embedded engine) -> benchmark
  (chain drafting, plus a tree sweep)

and one JSON/markdown report with the target's validation loss, the drafter's per-step accuracy
and simulated acceptance (tau), measured acceptance length (chain and tree), the lossless check,
tokens/s with and without speculation and the wall time of each stage. After the train stage
the best drafter is evaluated again over the answer positions the benchmark decodes (tau over
the first N answer tokens), and greedy chain decoding is replayed over the stored answers
(acceptance counted per verify round, as the benchmark counts it; replay_check.py shows it
equals the measured figure prompt by prompt on the CPU demo).

On one H200 (docs/results/acceptance.md has the exact command and the figures):
    python benchmarks/quality/run_quality.py --out /tmp/quality --device cuda --bench-tokens 256
A CPU smoke run of every step, in about two minutes:
    python benchmarks/quality/run_quality.py --out /tmp/quality-smoke --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from draftsmith.artifacts import Descriptor, atomic_write_json
from draftsmith.config import PipelineConfig
from draftsmith.figures import TrainFigures
from draftsmith.logs import configure_logging
from draftsmith.plan import run_in_process
from draftsmith.target import resolve_target
from draftsmith.tiny_target import function_chat, python_functions, train_tokenizer

log = logging.getLogger("draftsmith.quality")

# (target shape, run sizes) for the GPU run and for the CPU smoke run.
GPU = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
           num_key_value_heads=4, vocab=8192, seq_len=1024, batch=32, lr=1.5e-3,
           corpus_mb=48, target_seconds=150, prompts=1500, max_new_tokens=256, gen_batch=128,
           drafter_epochs=6, bench_prompts=20, bench_tokens=96, validation=0.05)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, vocab=1024, seq_len=256, batch=8, lr=3e-3,
             corpus_mb=2, target_seconds=20, prompts=48, max_new_tokens=32, gen_batch=16,
             drafter_epochs=2, bench_prompts=3, bench_tokens=16, validation=0.25)


def corpus_files(limit_mb: float) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): Python sources of the installed packages and the
    standard library, split by a hash of the path (1 in 20 held out), up to limit_mb."""
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["stdlib"])]
    files = sorted({p for root in roots for p in root.rglob("*.py") if p.is_file()})
    # A stable shuffle, so the byte cap samples every package rather than the first few.
    files.sort(key=lambda p: hashlib.sha256(str(p).encode()).hexdigest())
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if size > 200_000:  # generated tables, vendored bundles
            continue
        chosen.append(path)
        total += size
        if total > limit_mb * 1e6:
            break
    held_out = [p for p in chosen if int(hashlib.sha256(p.name.encode()).hexdigest(), 16) % 20 == 0]
    held = set(held_out)
    return [p for p in chosen if p not in held], held_out


def _functions_of(paths: list[Path]) -> list[tuple[str, str, str]]:
    return list(python_functions(paths, max_lines=40))


def functions(paths: list[Path], workers: int) -> list[tuple[str, str, str]]:
    chunks = [paths[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        return [f for part in pool.map(_functions_of, chunks) for f in part]


def token_rows(tokenizer, chats: list, seq_len: int) -> torch.Tensor:
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    stream = [t for ids in tokenizer(texts)["input_ids"] for t in ids]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)  # [N, S]


def build_target(out: Path, size: dict, device: str, workers: int) -> dict:
    """Train the target for a fixed wall-time budget; returns its figures."""
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    train_files, held_files = corpus_files(size["corpus_mb"])
    tokenizer = train_tokenizer(out, size["vocab"], files=train_files)
    train_funcs = functions(train_files, workers)
    held_funcs = functions(held_files, workers)
    rows = token_rows(tokenizer, [function_chat(*f) for f in train_funcs], size["seq_len"])
    val_rows = token_rows(tokenizer, [function_chat(*f) for f in held_funcs], size["seq_len"])
    log.info("corpus: %d training files (%d functions, %d rows), %d held-out files (%d "
             "functions); %.0fs", len(train_files), len(train_funcs), len(rows), len(held_files),
             len(held_funcs), time.monotonic() - started)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"], num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_key_value_heads"], max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=size["lr"], betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=device.startswith("cuda"))
    autocast = torch.autocast(device.split(":")[0], torch.bfloat16,
                              enabled=device.startswith("cuda"))

    def val_loss() -> float:
        model.eval()
        losses = []
        with torch.no_grad(), autocast:
            for batch in val_rows[:64].split(size["batch"]):
                batch = batch.to(device)
                losses.append(model(input_ids=batch, labels=batch).loss.item())
        model.train()
        return sum(losses) / len(losses)

    initial = val_loss()
    generator = torch.Generator().manual_seed(0)
    budget = size["target_seconds"]
    train_started = time.monotonic()
    step, tokens, loss = 0, 0, float("nan")
    while (elapsed := time.monotonic() - train_started) < budget:
        # Warmup, then cosine over the wall-time budget (the step count is not known ahead).
        frac = elapsed / budget
        for group in optimizer.param_groups:
            warmup = min(1.0, (step + 1) / 50)
            group["lr"] = size["lr"] * warmup * 0.5 * (1 + math.cos(math.pi * frac))
        batch = rows[torch.randint(len(rows), (size["batch"],), generator=generator)].to(device)
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss  # [B, S] tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += batch.numel()
        if step % 100 == 0:
            log.info("target step %d: loss %.3f, %.0f tokens/s", step, loss.item(),
                     tokens / (time.monotonic() - train_started))
    train_s = time.monotonic() - train_started
    final = val_loss()
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    figures = {"parameters": params, "train_steps": step, "train_tokens": tokens,
               "train_tokens_per_s": round(tokens / train_s), "train_s": round(train_s, 1),
               "val_loss_initial": round(initial, 3), "val_loss_final": round(final, 3),
               "train_loss_final": round(loss.item(), 3),
               "build_s": round(time.monotonic() - started, 1)}
    log.info("target: %s", figures)
    return {"figures": figures, "held_funcs": held_funcs}


def write_prompts(path: Path, held_funcs: list, limit: int) -> int:
    seen, rows = set(), []
    for module, signature, _body in held_funcs:
        prompt = function_chat(module, signature, "")[0]["content"]
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt})
    rows = rows[:limit]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def pipeline_config(root: Path, target_dir: Path, prompts: Path, size: dict, device: str,
                    ttt_steps: int) -> PipelineConfig:
    cuda = device.startswith("cuda")
    return PipelineConfig.model_validate({
        "run_root": str(root / "runs"),
        # float32 target: the lossless check (token identity with greedy decoding) is exact
        # only in float32; extraction and generation speed are not what this measures.
        "target": {"model": str(target_dir), "device": device, "dtype": "float32"},
        "data": {"sources": [{"name": "heldout-functions", "path": str(prompts),
                              "format": "prompt"}]},
        "generate": {"max_new_tokens": size["max_new_tokens"], "batch_size": size["gen_batch"]},
        "merge": {"max_length": 1024, "validation_fraction": size["validation"],
                  "draft_vocab_size": size["vocab"] // 2},
        "extract": {"batch_size": 32, "dtype": "bfloat16" if cuda else "float32"},
        "train": {"ttt_steps": ttt_steps, "lr": 1e-3, "epochs": size["drafter_epochs"],
                  "batch_tokens": 8192 if cuda else 1024, "device": device,
                  "dtype": "bfloat16" if cuda else "float32", "log_every": 20},
        "deploy": {"num_steps": ttt_steps, "eagle_topk": 1, "num_draft_tokens": ttt_steps + 1},
        "benchmark": {"num_prompts": size["bench_prompts"], "max_new_tokens": size["bench_tokens"],
                      "sweep": [{"num_steps": ttt_steps, "eagle_topk": 4, "num_draft_tokens": 16},
                                {"num_steps": 4, "eagle_topk": 2, "num_draft_tokens": 8}]},
    })


def run_stages(config: PipelineConfig, target: Descriptor,
               after=None) -> tuple[dict, dict]:
    """The pipeline's stages in order, in this process (draftsmith.plan.run_in_process: the
    plan the Prefect flow loops over, without Prefect); after(stage, outputs, seconds), if
    given, runs after each stage."""
    seconds: dict[str, float] = {}
    outputs: dict[str, Descriptor] = {}

    def each(stage: str, descriptor: Descriptor, took: float) -> None:
        outputs[stage] = descriptor
        seconds[stage] = round(took, 1)
        if after:
            after(stage, {"target": target, **outputs}, seconds)

    run = run_in_process(config, target, after=each)
    return dict(run.outputs), seconds


# --------------------------------------------------------------------------- tau by position
#
# The train stage's tau averages over every assistant token of the validation answers (up to
# generate's max_new_tokens), the benchmark decodes the first bench_tokens of a few of them.
# Both are measured here over the same answer positions, with the trainer's own functions.


def cut_to_window(sample, window: int | None):
    """The sample with its loss mask kept on its first `window` assistant tokens (all of them
    for None). These samples have one assistant turn, so that is the first `window` tokens of
    the answer: the positions a benchmark with max_new_tokens=window decodes."""
    if window is None:
        return sample
    mask = sample.loss_mask.bool()  # [T]
    keep = mask & (mask.long().cumsum(0) <= window)  # [T]
    return dataclasses.replace(sample, loss_mask=keep.to(sample.loss_mask.dtype))


def tau_by_position(config: PipelineConfig, outputs: dict, windows: list[int]) -> dict:
    """The best drafter (the train stage's native checkpoint) on the validation split of the
    hidden-state store, on the trainer's path (same packing, dtype, attention and compiled
    layer as its validation):

    - tau: the trainer's `RowRunner.evaluate` on rows whose loss masks are cut to the first N
      answer tokens of each sample, and uncut (which must equal the train stage's validation
      tau);
    - walk: per anchor, how many drafts in a row the target agrees with (the trainer's runs,
      `row_loss_on_device(with_runs=True)`), then greedy chain decoding of each stored
      answer's first N tokens replayed over them (`replay_chain_decoding`, what the train
      stage's validation reports over whole answers): acceptance as the benchmark counts it
      (tokens per verify round) rather than averaged over every position."""
    from draftsmith.distributed import Dist
    from draftsmith.export.native import load_native
    from draftsmith.extract.store import ShardReader
    from draftsmith.target import load_target_head_and_embedding
    from draftsmith.train.metrics import replay_chain_decoding
    from draftsmith.train.packing import plan_rows
    from draftsmith.train.parallel import DDP
    from draftsmith.train.trainer import row_runner

    cfg = config.train
    steps = cfg.ttt_steps
    device = torch.device(cfg.device)
    embed, head = load_target_head_and_embedding(outputs["target"])
    drafter = load_native(outputs["train"].dir, embed)
    # The trainer's own runner: same dtype, attention, compiled layer, padding and fallback.
    runner = row_runner(cfg, drafter, head, device, DDP(Dist.single()))
    store = ShardReader(outputs["extract"].path)
    rows = plan_rows(list(store.samples("validation")), cfg.batch_tokens)  # the trainer's rows

    def tau_of(window: int | None) -> dict:
        cut = [[cut_to_window(s, window) for s in row] for row in rows]
        counts = runner.guarded(lambda: runner.evaluate(cut))
        summary = counts.summary()
        return {"tau": round(summary["tau"], 4),
                "full_acc": [round(summary[f"full_acc_{j}"], 4) for j in range(steps)],
                "positions": int(counts.positions[0])}

    started = time.monotonic()
    result: dict = {"tau": {"all": tau_of(None)}}
    for window in windows:
        result["tau"][f"first_{window}"] = tau_of(window)
    train_tau = TrainFigures.of(outputs["train"]).tau
    result["train_stage_tau"] = train_tau
    result["cross_check_diff"] = round(result["tau"]["all"]["tau"] - train_tau, 4)

    def runs_of(samples) -> list[tuple]:
        """(id, loss mask, runs) per sample: runs [n] are the drafts in a row the target
        accepts at each anchor, from the same pass that counts tau."""
        _, _, runs = runner.loss(runner.row(samples), train=False, with_runs=True)
        runs, per_sample, start = runs.cpu(), [], 0  # [T]
        for s in samples:
            n = min(len(s.input_ids), cfg.batch_tokens)
            per_sample.append((s, runs[start:start + n]))
            start += n
        return per_sample

    def replay() -> None:
        per_sample = []
        with torch.no_grad():
            drafter.eval()
            for samples in rows:
                per_sample += runner.guarded(lambda samples=samples: runs_of(samples))
        walks = {}
        for window in windows:  # greedy chain decoding of each answer's first `window` tokens
            per = {}
            for sample, runs in per_sample:
                cut = cut_to_window(sample, window)
                n = len(runs)
                per[sample.id] = replay_chain_decoding(runs, cut.loss_mask[:n],
                                                       torch.zeros(n, dtype=torch.long))
            rounds, tokens = sum(r for r, _ in per.values()), sum(t for _, t in per.values())
            walks[f"first_{window}"] = {"acceptance": round(tokens / max(rounds, 1), 4),
                                        "rounds": rounds, "tokens": tokens, "per_sample": per}
        result["walk"] = walks
        result["samples"] = len(per_sample)

    try:  # the tau figures above are kept if the replay fails
        replay()
    except Exception as err:  # noqa: BLE001 - reported in the result and the log
        log.exception("tau by position: the replay failed")
        result["walk_error"] = f"{type(err).__name__}: {err}"
    result["runtime"] = {"attention": runner.attention, "compiled": runner.compiled,
                         "dtype": cfg.dtype}
    result["seconds"] = round(time.monotonic() - started, 1)
    log.info("tau by position: %s; walk %s; %.1fs", {k: v["tau"] for k, v in result["tau"].items()},
             {k: v["acceptance"] for k, v in result.get("walk", {}).items()}, result["seconds"])
    store.close()
    return result


def walk_vs_benchmark(positions: dict, outputs: dict, bench_tokens: int) -> dict:
    """The walk on the benchmark's own prompts (the first prompts of the validation split),
    next to what the benchmark measured on each: rounds and tokens per prompt."""
    from draftsmith.data.merge import read_split

    bench = json.loads((outputs["benchmark"].dir / "report.json").read_text())
    measured = bench["per_prompt"]
    ids = [r["id"] for r in read_split(outputs["merge"], "validation")[: len(measured)]]
    walk = positions["walk"][f"first_{bench_tokens}"]["per_sample"]
    pairs = [(walk[i], m) for i, m in zip(ids, measured, strict=True) if i in walk]
    w_rounds, w_tokens = sum(w[0] for w, _ in pairs), sum(w[1] for w, _ in pairs)
    m_rounds, m_tokens = sum(m["verify_rounds"] for _, m in pairs), \
        sum(m["round_tokens"] for _, m in pairs)
    return {"prompts": len(pairs),
            "walk_acceptance": round(w_tokens / max(w_rounds, 1), 4),
            "measured_acceptance": round(m_tokens / max(m_rounds, 1), 4),
            "same_length": sum(w[1] == m["round_tokens"] for w, m in pairs),
            "per_prompt": [{"walk_rounds": w[0], "walk_tokens": w[1],
                            "rounds": m["verify_rounds"], "tokens": m["round_tokens"]}
                           for w, m in pairs]}


def report(target_figures: dict, outputs: dict, seconds: dict, positions: dict | None,
           bench_tokens: int) -> dict:
    train = outputs["train"].figures
    result = {
        "target": target_figures,
        "data": {"records": outputs["merge"].counts,
                 "generated_tokens": outputs["generate"].counts},
        "drafter": train,
        "stage_seconds": seconds,
    }
    if positions is not None:
        result["tau_by_position"] = {k: v for k, v in positions.items() if k != "walk"}
        result["tau_by_position"]["walk"] = {
            k: {f: v[f] for f in ("acceptance", "rounds", "tokens")}
            for k, v in positions.get("walk", {}).items()}
    if "benchmark" in outputs:
        bench = json.loads((outputs["benchmark"].dir / "report.json").read_text())
        result["benchmark"] = {"max_new_tokens": bench_tokens, "configs": bench["configs"],
                               "summary": bench["summary"], "verdict": bench["verdict"]}
        if positions is not None and "walk" in positions:
            try:  # the benchmark's figures are reported whatever happens here
                walk = walk_vs_benchmark(positions, outputs, bench_tokens)
                result["tau_by_position"]["walk_on_benchmark_prompts"] = {
                    k: v for k, v in walk.items() if k != "per_prompt"}
            except Exception:
                log.exception("the replay on the benchmark's prompts failed")
    return result


def markdown(result: dict) -> str:
    t = result["target"]
    d = result["drafter"]
    steps = sum(1 for k in d if k.startswith("full_acc_"))
    acc = ", ".join(f"{d[f'full_acc_{j}']:.3f}" for j in range(steps))
    cond = ", ".join(f"{d[f'cond_acc_{j}']:.2f}" for j in range(steps))
    lines = [
        "| quantity | value |", "|---|---|",
        f"| target | Llama, {t['parameters'] / 1e6:.1f}M parameters, {t['train_steps']:,} steps "
        f"in {t['train_s']:.0f} s ({t['train_tokens'] / 1e6:.1f}M tokens, "
        f"{t['train_tokens_per_s']:,} tokens/s) |",
        f"| target validation loss (held-out files) | {t['val_loss_initial']} -> "
        f"{t['val_loss_final']} (training loss {t['train_loss_final']}) |",
        f"| data | {json.dumps(result['data']['generated_tokens'])}; "
        f"{json.dumps(result['data']['records'])} |",
        f"| drafter validation full_acc, steps 0-{steps - 1} | {acc} (cond_acc {cond}) |",
        f"| drafter simulated tau (train stage, every answer token) | {d['tau']:.3f} |",
    ]
    pos = result.get("tau_by_position")
    if pos:
        for key, v in pos["tau"].items():
            where = "every answer token" if key == "all" else \
                f"first {key.removeprefix('first_')} answer tokens"
            lines.append(f"| tau, {where} (best drafter re-evaluated) | {v['tau']:.3f} "
                         f"({v['positions']:,} positions; full_acc "
                         f"{', '.join(f'{a:.3f}' for a in v['full_acc'])}) |")
        lines.append(f"| re-evaluated tau - train stage tau | {pos['cross_check_diff']} |")
        for key, v in pos["walk"].items():
            lines.append(f"| chain decoding replayed on the stored answers, first "
                         f"{key.removeprefix('first_')} tokens (validation) | acceptance "
                         f"{v['acceptance']:.3f} ({v['tokens']:,} tokens in {v['rounds']:,} "
                         f"rounds) |")
        if "walk_on_benchmark_prompts" in pos:
            w = pos["walk_on_benchmark_prompts"]
            lines.append(f"| replay on the benchmark's {w['prompts']} prompts vs measured | "
                         f"{w['walk_acceptance']:.3f} vs {w['measured_acceptance']:.3f} (same "
                         f"answer length on {w['same_length']}/{w['prompts']}) |")
    if "benchmark" in result:
        b = result["benchmark"]
        for c in b["configs"]:
            lines.append(
                f"| measured, {c['config']}, {c['prompts']} prompts x {b['max_new_tokens']} "
                f"tokens | acceptance {c['acceptance_length']}, "
                f"{c['speculative_tokens_per_s']} vs {c['greedy_tokens_per_s']} tokens/s "
                f"({c['speedup']}x), identical to greedy {c['identical_outputs']} |")
    stages = ", ".join(f"{k} {v}" for k, v in result["stage_seconds"].items())
    lines.append(f"| stage wall time (s) | target build {t['build_s']} (training "
                 f"{t['train_s']}), {stages} |")
    verdict = result["benchmark"]["verdict"] if "benchmark" in result else "(no benchmark yet)"
    return "\n".join(lines) + f"\n\n{verdict}\n"


def write_reports(out: Path, result: dict) -> None:
    atomic_write_json(out / "quality.json", result)
    (out / "quality.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report-dir", type=Path, help=(
        "also write quality.json, quality.md and raw.json here, updated after every stage "
        "(default: --out)"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check every step on CPU")
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--target-seconds", type=float, help="override the training budget")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--bench-prompts", type=int, help="override the benchmark's prompts")
    parser.add_argument("--no-sweep", action="store_true", help="benchmark the chain only")
    parser.add_argument("--bench-tokens", type=int, help=(
        "override the benchmark's max_new_tokens (256, generate's length, measures acceptance "
        "over the same answer positions as the drafter's simulated tau)"))
    parser.add_argument("--tau-windows", type=int, nargs="*", default=[96], help=(
        "answer lengths to measure tau over besides the benchmark's max_new_tokens"))
    args = parser.parse_args(argv)
    configure_logging()
    size = dict(SMOKE if args.smoke else GPU)
    if args.target_seconds:
        size["target_seconds"] = args.target_seconds
    if args.bench_tokens:
        size["bench_tokens"] = args.bench_tokens
    if args.bench_prompts:
        size["bench_prompts"] = args.bench_prompts
    windows = sorted({size["bench_tokens"], *args.tau_windows}, reverse=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report_dir = args.report_dir or args.out
    report_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    built = build_target(args.out / "target", size, args.device, args.workers)
    prompts = args.out / "prompts.jsonl"
    n_prompts = write_prompts(prompts, built["held_funcs"], size["prompts"])
    log.info("%d held-out prompts", n_prompts)
    config = pipeline_config(args.out, args.out / "target", prompts, size, args.device,
                             args.ttt_steps)
    if args.no_sweep:
        config.benchmark.sweep = []
    from draftsmith.config import TargetConfig

    target = resolve_target(TargetConfig(model=str(args.out / "target")))
    state: dict = {"positions": None}

    def after(stage: str, outputs: dict, seconds: dict) -> None:
        if stage == "train":
            try:  # a figure from the stages is never lost to a bug in this analysis
                state["positions"] = tau_by_position(config, outputs, windows)
                seconds["tau_by_position"] = state["positions"]["seconds"]
            except Exception:
                log.exception("tau by position failed")
        # The raw descriptors first, after every stage: what ran is kept if a later one fails.
        raw = {"target": built["figures"], "seconds": seconds,
               **{k: v.model_dump() for k, v in outputs.items()}}
        if state["positions"] is not None:
            raw["tau_by_position"] = state["positions"]
        atomic_write_json(report_dir / "raw.json", raw)
        if stage in ("train", "benchmark"):
            try:
                result = report(built["figures"], outputs, seconds, state["positions"],
                                size["bench_tokens"])
                result["total_s"] = round(time.monotonic() - started, 1)
                result["device"] = torch.cuda.get_device_name() \
                    if args.device.startswith("cuda") else "cpu"
                write_reports(report_dir, result)
                if report_dir != args.out:
                    write_reports(args.out, result)
                state["result"] = result
            except Exception:
                log.exception("report after %s failed", stage)

    run_stages(config, target, after)
    result = state.get("result")
    if result is None:
        raise SystemExit(f"no report could be built; see the log and {report_dir / 'raw.json'}")
    print(markdown(result))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
