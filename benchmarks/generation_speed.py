"""In-process generation speed: transformers' `generate` with the dynamic cache (the old path)
against the static cache with the compiled decode step (`generate.cache: static`), on the same
real prompts, in one process.

Each variant answers the same prompts (python-functions, chat-templated, sorted by length as
the generate stage sorts them) greedily and prints one JSON line: tokens/s (completion tokens
over wall time: for a static-cache variant, of a second pass over the same prompts once every
shape has compiled; for a dynamic one, of every batch after the first; and with the compiles),
the share of answers identical to the reference variant's (same prompts, same dtype), and
what ran. A float32 pair checks that the static path decodes exactly what the dynamic one
does; bfloat16 pairs report the share (batch-dependent kernels can break near-ties).

    python benchmarks/generation_speed.py --out benchmarks/results/generation_speed/h200.jsonl
    python benchmarks/generation_speed.py --smoke --out /tmp/gen.jsonl     # CPU, tiny target
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from draftsmith.config import TargetConfig  # noqa: E402
from draftsmith.data.packaged import python_function_prompts  # noqa: E402
from draftsmith.generate.transformers_backend import TransformersGenerator  # noqa: E402
from draftsmith.target import load_target_model, load_tokenizer, resolve_target  # noqa: E402

log = logging.getLogger("generation_speed")

# (variant, cache, dtype, batch, prompts, reference variant)
GPU_VARIANTS = [
    ("dynamic-bf16-b512", "dynamic", "bfloat16", 512, 2048, None),
    # Twice the rows a step: generate's own per-step work is shared by twice the tokens. The
    # same 12,288 prompts as the b2048 run after it, so the two compare at the same lengths.
    ("static-bf16-b4096", "static", "bfloat16", 4096, 12288, "dynamic-bf16-b512"),
    ("static-bf16-b2048-12k", "static", "bfloat16", 2048, 12288, "dynamic-bf16-b512"),
    # The decode step's attention as compiled matmuls (1.5x SDPA alone: decode_attention.py):
    # the same prompts as the run above; and the float32 identity with the old path.
    ("static-bf16-b2048-12k-matmul", "static", "bfloat16", 2048, 12288, "dynamic-bf16-b512"),
    ("static-bf16-b2048", "static", "bfloat16", 2048, 8192, "dynamic-bf16-b512"),
    ("dynamic-fp32-b256", "dynamic", "float32", 256, 512, None),
    ("static-fp32-b256", "static", "float32", 256, 512, "dynamic-fp32-b256"),
    ("static-fp32-b256-matmul", "static", "float32", 256, 512, "dynamic-fp32-b256"),
    # Flex attention: compiled, torch's split-KV decoding kernel.
    ("static-bf16-b2048-12k-flex", "static", "bfloat16", 2048, 12288, "dynamic-bf16-b512"),
    ("static-bf16-b4096-12k-flex", "static", "bfloat16", 4096, 12288, "dynamic-bf16-b512"),
    ("static-fp32-b256-flex", "static", "float32", 256, 512, "dynamic-fp32-b256"),
    # The matmul step with the prefill compiled apart (compile_prefill): the prefill was about
    # a third of a batch's GPU time, eager (h200_2026-12-03_profile.log).
    ("static-bf16-b2048-12k-prefill", "static", "bfloat16", 2048, 12288, "dynamic-bf16-b512"),
    ("static-fp32-b256-prefill", "static", "float32", 256, 512, "dynamic-fp32-b256"),
    # A cache length per batch (cache_lengths="batch"): batches of short prompts attend over a
    # short cache. A compile per length: timed on the second pass.
    ("static-bf16-b2048-12k-buckets", "static", "bfloat16", 2048, 12288, "dynamic-bf16-b512"),
    ("static-bf16-b2048-12k-buckets-prefill", "static", "bfloat16", 2048, 12288,
     "dynamic-bf16-b512"),
    ("static-fp32-b256-buckets", "static", "float32", 256, 512, "dynamic-fp32-b256"),
    ("static-fp32-b256-buckets-prefill", "static", "float32", 256, 512, "dynamic-fp32-b256"),
    # bf16 answers depend on the batch even on the old path: its own share, for comparison.
    ("dynamic-bf16-b256", "dynamic", "bfloat16", 256, 1024, "dynamic-bf16-b512"),
]
SMOKE_VARIANTS = [
    ("dynamic-fp32-b8", "dynamic", "float32", 8, 24, None),
    ("static-fp32-b8", "static", "float32", 8, 24, "dynamic-fp32-b8"),
    ("static-fp32-b8-matmul", "static", "float32", 8, 24, "dynamic-fp32-b8"),
    ("static-fp32-b8-flex", "static", "float32", 8, 24, "dynamic-fp32-b8"),
    ("static-fp32-b8-prefill", "static", "float32", 8, 24, "dynamic-fp32-b8"),
    ("static-fp32-b8-buckets-prefill", "static", "float32", 8, 24, "dynamic-fp32-b8"),
]
ATTENTIONS = ("matmul", "flex")  # a variant named ...-matmul or ...-flex decodes with it
# ...-prefill: the prefill compiled apart; ...-buckets: a cache length per batch. Both decode
# with the matmul step unless the name says otherwise.


def variant_settings(name: str) -> dict:
    """The generator's settings that a variant's name spells."""
    parts = name.split("-")
    prefill, buckets = "prefill" in parts, "buckets" in parts
    attention = next((p for p in parts if p in ATTENTIONS),
                     "matmul" if prefill or buckets else "sdpa")
    return {"decode_attention": attention, "compile_prefill": prefill,
            "cache_lengths": "batch" if buckets else "stage"}


class EagerFallback(RuntimeError):
    """The compiled decode step failed and the generator went on in eager mode: not the
    variant asked for, so it is recorded as failed rather than timed."""


def sorted_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` python-functions prompts, chat-templated, in the stage's order (by length, so
    similar lengths share a batch)."""
    conversations = [[{"role": "user", "content": p}]
                     for _, p in python_function_prompts(count)]
    return sorted((tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False) for c in conversations),
                  key=len)


def answer_all(generator: TransformersGenerator, prompts: list[list[int]],
               batch: int) -> tuple[list[list[int]], list[float]]:
    """Answers (completion token ids) and each batch's wall time, in the stage's order."""
    answers: list[list[int]] = []
    batch_seconds = []
    for start in range(0, len(prompts), batch):
        began = time.perf_counter()
        completions = generator.complete_tokens(prompts[start:start + batch])
        if generator.model.device.type == "cuda":
            torch.cuda.synchronize()
        batch_seconds.append(time.perf_counter() - began)
        if generator.cache == "static" and generator.model.device.type == "cuda" \
                and not generator.compiled:
            raise EagerFallback("the compiled decode step failed (see the warning above)")
        answers += [c.token_ids for c in completions]
        log.info("%s: batch %d, %.1f s", generator.cache, len(batch_seconds), batch_seconds[-1])
    return answers, batch_seconds


def run_variant(model, tokenizer, prompts: list[list[int]], cache: str, batch: int,
                max_new_tokens: int, decode_attention: str = "sdpa",
                compile_prefill: bool = False,
                cache_lengths: str = "stage") -> tuple[list[list[int]], dict]:
    """Answers (completion token ids) and timings. A static cache compiles once per shape,
    and a length per batch means a shape per length, so its figure is a second pass over the
    same prompts; a dynamic cache compiles nothing, and its first batch is left out."""
    generator = TransformersGenerator(model, tokenizer, max_new_tokens=max_new_tokens,
                                      temperature=0.0, top_p=1.0, seed=0, cache=cache,
                                      batch_size=batch,
                                      longest_prompt=max(len(p) for p in prompts),
                                      decode_attention=decode_attention,
                                      compile_prefill=compile_prefill,
                                      cache_lengths=cache_lengths)
    answers, first_pass_s = answer_all(generator, prompts, batch)
    tokens = [len(a) for a in answers]
    per_batch = [sum(tokens[i:i + batch]) for i in range(0, len(tokens), batch)]
    if cache == "static":
        again, timed_s = answer_all(generator, prompts, batch)
        if again != answers:  # greedy and the same shapes: a difference is a bug
            raise RuntimeError("the second pass answered differently from the first")
        timed_tokens, timing = sum(tokens), "second pass"
    else:
        timed_tokens, timed_s = sum(per_batch[1:] or per_batch), first_pass_s[1:] or first_pass_s
        timing = "batches after the first"
    return answers, {
        "tokens_per_s": round(timed_tokens / sum(timed_s), 1), "timed": timing,
        "tokens_per_s_with_first_batch": round(sum(per_batch) / sum(first_pass_s), 1),
        "first_batch_s": round(first_pass_s[0], 1), "seconds": round(sum(first_pass_s), 1),
        "batch_seconds": [round(s, 2) for s in timed_s],
        "cache_lengths": sorted(set(generator.cache_lengths_made)) or None,
        "completion_tokens": sum(tokens), "batches": len(first_pass_s),
        "ended_turn": sum(bool(a) and a[-1] == tokenizer.eos_token_id for a in answers),
        "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
        if model.device.type == "cuda" else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL, one line per variant")
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny target, 2 variants")
    parser.add_argument("--target", help="default: SmolLM2 (builtin:tiny with --smoke)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--only", nargs="*", help="variant names to run, in this order (a "
                        "reference variant must come before the variants compared with it)")
    parser.add_argument("--deadline-s", type=float, default=1e9,
                        help="start no variant after this many seconds")
    parser.add_argument("--done", type=Path, help="a file written when every variant ran")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.monotonic()
    device = "cpu" if args.smoke else "cuda"
    target = resolve_target(TargetConfig(model=args.target or (
        "builtin:tiny" if args.smoke else "builtin:smollm2-135m-instruct")))
    tokenizer = load_tokenizer(target)
    variants = SMOKE_VARIANTS if args.smoke else GPU_VARIANTS
    if args.only:  # in the order given: a deadline cuts the last ones
        by_name = {v[0]: v for v in variants}
        unknown = [name for name in args.only if name not in by_name]
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: not a variant; the variants are "
                         f"{', '.join(by_name)}")
        variants = [by_name[name] for name in args.only]
    most = max(v[4] for v in variants)
    prompts = sorted_prompts(tokenizer, most)
    answers: dict[str, list] = {}
    models: dict[str, torch.nn.Module] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, cache, dtype, batch, count, reference in variants:
        if time.monotonic() - started > args.deadline_s:
            log.info("past --deadline-s: %s not run", name)
            break
        # Every count-prompt sample spreads over the whole length range.
        sample = prompts[::max(1, len(prompts) // count)][:count]
        settings = variant_settings(name)
        attention = settings["decode_attention"]
        # A model per dtype, cache and attention. generate keeps the model's compiled decode
        # step, so a variant after another on the same model compiles only shapes that are
        # new to it (its first-pass figures are then not comparable; the timed pass is).
        key = f"{dtype}-{cache}-{attention}"
        if key not in models:
            models[key] = load_target_model(target.path, device, dtype)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            answers[name], figures = run_variant(models[key], tokenizer, sample, cache, batch,
                                                 args.max_new_tokens, **settings)
        except (torch.OutOfMemoryError, EagerFallback) as err:  # recorded; the others run
            message = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
            log.warning("%s: %s", name, message)
            models.pop(key)  # a fallen-back model stays eager; the memory goes back
            torch.cuda.empty_cache()
            row = {"variant": name, "decode_attention": attention, "batch": batch,
                   "prompts": len(sample), "tokens_per_s": None, "identical_greedy": None,
                   "error": "out of memory" if isinstance(err, torch.OutOfMemoryError)
                   else message}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            continue
        identical = None
        if reference in answers:
            theirs = answers[reference]
            shared = min(len(theirs), len(answers[name]))
            ref_sample = prompts[::max(1, len(prompts) // len(theirs))][:len(theirs)]
            index = {tuple(p): i for i, p in enumerate(ref_sample)}
            same = [answers[name][i] == theirs[index[tuple(p)]]
                    for i, p in enumerate(sample[:shared]) if tuple(p) in index]
            identical = {"identical": sum(same), "compared": len(same)}
        row = {"variant": name, "cache": cache, **settings, "dtype": dtype, "batch": batch,
               "prompts": len(sample), "max_new_tokens": args.max_new_tokens,
               **figures, "reference": reference,
               "identical_greedy": None if identical is None else
               identical["identical"] == identical["compared"],
               "identical_share": identical, "device": torch.cuda.get_device_name()
               if device == "cuda" else "cpu", "torch": torch.__version__,
               "transformers": __import__("transformers").__version__}
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    log.info("done in %.0f s", time.monotonic() - started)
    if args.done:
        args.done.parent.mkdir(parents=True, exist_ok=True)
        args.done.write_text(json.dumps({"variants": list(answers)}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
