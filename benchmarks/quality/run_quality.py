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
tokens/s with and without speculation and the wall time of each stage.

On one H200 (see the README for the exact command and the figures):
    python benchmarks/quality/run_quality.py --out /tmp/quality --device cuda
A CPU smoke run of every step, in about two minutes:
    python benchmarks/quality/run_quality.py --out /tmp/quality-smoke --smoke
"""

from __future__ import annotations

import argparse
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
from draftsmith.logs import configure_logging
from draftsmith.plan import stage_plan
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


def run_stages(config: PipelineConfig, target: Descriptor) -> tuple[dict, dict]:
    """The pipeline's engine functions in order (what the Prefect flow's tasks call)."""
    from draftsmith.bench.benchmark import run_benchmark
    from draftsmith.data.merge import run_merge
    from draftsmith.export.fix_keys import run_fix_keys
    from draftsmith.extract.stage import run_extract
    from draftsmith.generate.stage import run_generate
    from draftsmith.serve.deploy import run_deploy
    from draftsmith.train.trainer import run_train

    c = config
    calls = {
        "generate": lambda o, p: run_generate(c.generate, c.data, c.target, target, p),
        "merge": lambda o, p: run_merge(c.merge, o["generate"], target, p),
        "extract": lambda o, p: run_extract(c.extract, c.target, o["merge"], target, p),
        "train": lambda o, p: run_train(c.train, o["extract"], o["merge"], target, p),
        "fix_keys": lambda o, p: run_fix_keys(c.fix_keys, c.target, o["train"], target, p),
        "deploy": lambda o, p: run_deploy(c.deploy, c.target, o["fix_keys"], o["merge"],
                                          target, p),
        "benchmark": lambda o, p: run_benchmark(c.benchmark, c.target, o["deploy"], o["merge"],
                                                target, p, c.deploy),
    }
    outputs: dict[str, Descriptor] = {"target": target}
    seconds = {}
    for stage, call in calls.items():
        started = time.monotonic()
        outputs[stage] = call(outputs, stage_plan(config, stage, outputs))
        seconds[stage] = round(time.monotonic() - started, 1)
        log.info("stage %s done in %.1fs", stage, seconds[stage])
    return outputs, seconds


def report(target_figures: dict, outputs: dict, seconds: dict) -> dict:
    train = outputs["train"].figures
    bench = json.loads((outputs["benchmark"].dir / "report.json").read_text())
    configs = bench["configs"]
    return {
        "target": target_figures,
        "data": {"records": outputs["merge"].counts,
                 "generated_tokens": outputs["generate"].counts},
        "drafter": {k: train.get(k) for k in ("best_validation", "validation", "steps",
                                               "tokens_per_s") if k in train} or train,
        "benchmark": {"configs": configs, "summary": bench["summary"], "verdict": bench["verdict"]},
        "stage_seconds": seconds,
    }


def markdown(result: dict) -> str:
    t = result["target"]
    lines = [
        "| quantity | value |", "|---|---|",
        f"| target | Llama, {t['parameters'] / 1e6:.0f}M parameters, trained {t['train_s']:.0f} s "
        f"({t['train_tokens'] / 1e6:.1f}M tokens, {t['train_tokens_per_s']:,} tokens/s) |",
        f"| target validation loss | {t['val_loss_initial']} -> {t['val_loss_final']} |",
        f"| drafter (train stage figures) | {json.dumps(result['drafter'])} |",
    ]
    for c in result["benchmark"]["configs"]:
        lines.append(
            f"| {c['config']} | acceptance {c['acceptance_length']}, "
            f"{c['speculative_tokens_per_s']} vs {c['greedy_tokens_per_s']} tokens/s "
            f"({c['speedup']}x), identical to greedy {c['identical_outputs']} |")
    stages = ", ".join(f"{k} {v}" for k, v in result["stage_seconds"].items())
    lines.append(f"| stage wall time (s) | target build {t['build_s']}, {stages} |")
    return "\n".join(lines) + f"\n\n{result['benchmark']['verdict']}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
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
    args = parser.parse_args(argv)
    configure_logging()
    size = dict(SMOKE if args.smoke else GPU)
    if args.target_seconds:
        size["target_seconds"] = args.target_seconds
    if args.bench_tokens:
        size["bench_tokens"] = args.bench_tokens
    if args.bench_prompts:
        size["bench_prompts"] = args.bench_prompts
    args.out.mkdir(parents=True, exist_ok=True)
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
    outputs, seconds = run_stages(config, target)
    # The raw descriptors first: a figure is never lost to a bug in the report below.
    atomic_write_json(args.out / "raw.json", {"target": built["figures"], "seconds": seconds,
                                              **{k: v.model_dump() for k, v in outputs.items()}})
    result = report(built["figures"], outputs, seconds)
    result["total_s"] = round(time.monotonic() - started, 1)
    result["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    atomic_write_json(args.out / "quality.json", result)
    (args.out / "quality.md").write_text(markdown(result))
    print(markdown(result))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
