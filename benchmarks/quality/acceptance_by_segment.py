"""Where a drafter loses accepted tokens: acceptance by segment (code or prose), on HumanEval's
greedy answers and on held-out training answers.

The sweep's drafters replay about 3.2 over held-out training answers and measure about 2.9 on
HumanEval. answer_shape.py showed that HumanEval's answers hold more prose; asking the training
prompts to explain their code (sweep.py --starts-instruction) did not raise HumanEval's figure.
This script tells the two candidate causes apart, on the CPU: the target (float32) answers the
HumanEval prompts greedily as the sweep's evaluation does, the drafter replays those answers and
held-out training answers (records past --held-out-from, which the sweep never trains on), and
every verify round is counted under the segment of the first token it drafts.
- the same code and prose figures on both sets, with different shares: the answers' shape;
- lower figures on HumanEval within a segment: the prompts' content.

    python benchmarks/quality/acceptance_by_segment.py --drafter /tmp/drafters/eagle3.1-48000-e6 \
        --answers benchmarks/results/quality_scale/answers/smollm2_48k_2026-12-04.jsonl.xz \
        --out benchmarks/results/quality_scale/acceptance_by_segment.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent))

from answer_shape import code_spans, read_answers  # noqa: E402

DRAFTS = 3


def token_segments(tokenizer, output: list[int]) -> list[str]:
    """'code' or 'prose' for each output token, placed by its last character (as
    answer_shape.shape places them): fenced blocks, their fences included, are code."""
    pieces = [tokenizer.decode([token]) for token in output]
    spans = code_spans("".join(pieces))
    segments, end = [], 0
    for piece in pieces:
        end += len(piece)
        last = end - 1
        segments.append("code" if any(a <= last < b for a, b in spans) else "prose")
    return segments


def count_rounds(round_tokens: list[int], segments: list[str]) -> dict[str, dict[str, int]]:
    """Rounds and tokens by the segment of each round's first drafted token. The first output
    token is the prefill's, so round r drafts from output index 1 + the tokens before it."""
    counts = {s: {"rounds": 0, "tokens": 0} for s in ("code", "prose")}
    at = 1
    for produced in round_tokens:
        segment = segments[min(at, len(segments) - 1)]
        counts[segment]["rounds"] += 1
        counts[segment]["tokens"] += produced
        at += produced
    return counts


def summarize(name: str, counts: list[dict[str, dict[str, int]]]) -> dict:
    row: dict = {"set": name, "answers": len(counts)}
    rounds = sum(c[s]["rounds"] for c in counts for s in c)
    tokens = sum(c[s]["tokens"] for c in counts for s in c)
    row["acceptance"] = round(tokens / rounds, 4)
    row["rounds"] = rounds
    for segment in ("code", "prose"):
        r = sum(c[segment]["rounds"] for c in counts)
        t = sum(c[segment]["tokens"] for c in counts)
        row[f"{segment}_rounds_share"] = round(r / rounds, 4)
        row[f"{segment}_acceptance"] = round(t / r, 4) if r else None
    return row


def cpu_engine(target_name: str, drafter: Path):
    """(tokenizer, engine): the float32 target on the CPU, with the drafter drafting DRAFTS
    tokens a round, as the sweep's evaluation decodes."""
    from draftsmith.config import TargetConfig
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine
    from draftsmith.target import load_target_model, load_tokenizer, resolve_target

    target = resolve_target(TargetConfig(model=target_name))
    model = load_target_model(target.path, "cpu", "float32")
    return load_tokenizer(target), EmbeddedSpeculativeEngine.load(model, drafter,
                                                                  num_steps=DRAFTS)


def held_out_training(path: Path, start: int, limit: int, tokenizer,
                      max_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(source, prompt ids, answer ids cut at max_tokens) of records start.. of the answers
    file, in its order (the sweep trains on the first N; the rest it never sees)."""
    from draftsmith.serve.deploy import prompt_ids

    records = read_answers(path, start + limit)[start:]
    if len(records) < limit:
        raise SystemExit(f"--answers {path}: {len(records)} records after --held-out-from "
                         f"{start}, {limit} wanted; lower --held-out-from or --training")
    out = []
    for record in records:
        answer = next(m["content"] for m in record["messages"] if m["role"] == "assistant")
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:max_tokens]
        out.append((record["id"].split("/", 1)[0],
                    prompt_ids(tokenizer, json.dumps(record["messages"])), ids))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True, help="an exported drafter dir")
    parser.add_argument("--answers", type=Path, required=True,
                        help="the answers the drafter's sweep trained on (.jsonl or .jsonl.xz)")
    parser.add_argument("--held-out-from", type=int, default=48000,
                        help="the first record the sweep did not train on (its size)")
    parser.add_argument("--training", type=int, default=96, help="held-out answers replayed")
    parser.add_argument("--prompts", type=int, default=48, help="HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from draftsmith.bench.benchmark import held_out_prompts, plain_decoding
    from draftsmith.config import BenchmarkConfig

    started = time.monotonic()
    tokenizer, engine = cpu_engine(args.target, args.drafter)
    bench = BenchmarkConfig(prompts_builtin="humaneval", num_prompts=args.prompts,
                            max_new_tokens=args.max_new_tokens, warmup_prompts=0)
    prompts = held_out_prompts(bench, None, tokenizer)
    greedy = plain_decoding(engine.runner, prompts, bench, tokenizer.eos_token_id)
    sets: dict[str, list[tuple[list[int], list[int]]]] = {
        "humaneval (greedy, float32)": [(p, g.tokens) for p, g in zip(prompts, greedy,
                                                                      strict=True)]}
    for source, prompt, answer in held_out_training(args.answers, args.held_out_from,
                                                    args.training, tokenizer,
                                                    args.max_new_tokens):
        sets.setdefault(f"held-out training: {source}", []).append((prompt, answer))
    rows = []
    for name, pairs in sets.items():
        counts = []
        for prompt, output in pairs:
            replay = engine.replay(prompt, output)
            counts.append(count_rounds(replay.round_tokens, token_segments(tokenizer, output)))
        rows.append(summarize(name, counts))
        print(json.dumps(rows[-1]), f"({time.monotonic() - started:.0f} s)", flush=True)
    engine.runner.close()
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/quality/acceptance_by_segment.py " + " ".join(
                sys.argv[1:]),
            "drafter": str(args.drafter), "draft_steps": DRAFTS, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
