"""How the target's answers to HumanEval differ in shape from its answers to the training prompts.

The drafters replay 3.2 over held-out training answers and measure 2.9 on HumanEval's greedy
outputs. This script measures what differs, on the CPU: the target (float32, greedy, batch 1,
as the sweep's evaluation decodes) answers the HumanEval prompts, and the same shape figures
are taken over the kept training answers, cut at the same number of tokens.

    python benchmarks/quality/answer_shape.py \
        --answers benchmarks/results/quality_scale/answers/smollm2_48k_2026-12-04.jsonl.xz \
        --out benchmarks/results/quality_scale/answer_shape.json

Figures per set (shares are of answer tokens unless named otherwise):
- code: tokens inside ``` fences; prose: the rest (fence lines count as code)
- prose_before / prose_after: tokens before the first fence and after the last one
- starts_with_fence: share of answers whose first line opens a fence
- echoes_prompt_code: share of answers that repeat the prompt's `def` line
"""

from __future__ import annotations

import argparse
import itertools
import json
import lzma
import time
from pathlib import Path

import torch

from draftsmith.config import TargetConfig
from draftsmith.data.packaged import (
    PYTHON_FUNCTION_STARTS,
    humaneval_rows,
    packaged_code_prompts,
)
from draftsmith.target import load_tokenizer, resolve_target

FENCE = "```"


def read_answers(path: Path, limit: int) -> list[dict]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in itertools.islice(f, limit)]


def signature_line(prompt: str) -> str:
    """The first `def` line of a prompt's ```python block (HumanEval's start with imports)."""
    inside = prompt.split(FENCE + "python\n", 1)[-1]
    lines = [line.strip() for line in inside.splitlines() if line.strip()]
    return next((line for line in lines if line.startswith(("def ", "async def "))),
                lines[0] if lines else "")


def code_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each fenced block, its fences included (an unclosed one runs on)."""
    fences, at = [], text.find(FENCE)
    while at >= 0:
        fences.append(at)
        at = text.find(FENCE, at + len(FENCE))
    spans = []
    for i in range(0, len(fences), 2):
        end = fences[i + 1] + len(FENCE) if i + 1 < len(fences) else len(text)
        spans.append((fences[i], end))
    return spans


def shape(tokenizer, prompt: str, answer: str, max_tokens: int) -> dict:
    """Token counts of one answer, cut at max_tokens, by where each token falls. A token is
    placed by its last character, so one that completes a fence is code."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:max_tokens]
    pieces = [tokenizer.decode([token]) for token in ids]
    spans = code_spans("".join(pieces))
    counts = {"tokens": len(ids), "code": 0, "prose_before": 0, "prose_after": 0,
              "prose_between": 0}
    end = 0
    for piece in pieces:
        end += len(piece)
        last = end - 1
        if any(a <= last < b for a, b in spans):
            counts["code"] += 1
        elif not spans or last < spans[0][0]:
            counts["prose_before"] += 1
        elif last >= spans[-1][1]:
            counts["prose_after"] += 1
        else:
            counts["prose_between"] += 1
    head = signature_line(prompt)
    counts["starts_with_fence"] = answer.lstrip().startswith(FENCE)
    counts["echoes_prompt_code"] = bool(head) and head in answer
    return counts


def summarize(name: str, shapes: list[dict]) -> dict:
    tokens = sum(s["tokens"] for s in shapes)
    prose = sum(s["prose_before"] + s["prose_after"] + s["prose_between"] for s in shapes)
    return {
        "set": name, "answers": len(shapes), "tokens": tokens,
        "mean_tokens": round(tokens / len(shapes), 1),
        "code_share": round(sum(s["code"] for s in shapes) / tokens, 3),
        "prose_share": round(prose / tokens, 3),
        "prose_before_share": round(sum(s["prose_before"] for s in shapes) / tokens, 3),
        "prose_after_share": round(sum(s["prose_after"] for s in shapes) / tokens, 3),
        "answers_with_prose": round(sum(
            s["prose_before"] + s["prose_after"] + s["prose_between"] > 0 for s in shapes)
            / len(shapes), 3),
        "starts_with_fence": round(sum(s["starts_with_fence"] for s in shapes) / len(shapes), 3),
        "echoes_prompt_code": round(sum(s["echoes_prompt_code"] for s in shapes) / len(shapes),
                                    3),
    }


def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int,
                   label: str) -> list[tuple[str, str]]:
    """(prompt, greedy answer) of each prompt: batch 1, as the sweep decodes."""
    out = []
    started = time.monotonic()
    for index, prompt in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]  # [1, T]
        with torch.inference_mode():
            generated = model.generate(ids, max_new_tokens=max_new_tokens,
                                       do_sample=False)  # [1, T + new]
        out.append((prompt, tokenizer.decode(generated[0, ids.shape[1]:],
                                             skip_special_tokens=True)))
        print(f"{label} {index + 1}/{len(prompts)}, {time.monotonic() - started:.0f} s",
              flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=Path, required=True)
    parser.add_argument("--training-answers", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--instruction", help="also answer python-function-starts prompts "
                        "asked with this instruction (data.sources[].instruction)")
    parser.add_argument("--instruction-prompts", type=int, default=24)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    target = resolve_target(TargetConfig(model=args.target))
    tokenizer = load_tokenizer(target)

    def text_of(record: dict, role: str) -> str:
        return next(m["content"] for m in record["messages"] if m["role"] == role)

    training = read_answers(args.answers, args.training_answers)
    sets = {"training: python-functions": [], "training: python-function-starts": []}
    for record in training:
        key = f"training: {record['id'].split('/', 1)[0]}"
        sets[key].append(shape(tokenizer, text_of(record, "user"), text_of(record, "assistant"),
                               args.max_new_tokens))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    humaneval = greedy_answers(
        model, tokenizer,
        [row["prompt"] for _, row in itertools.islice(humaneval_rows(), args.prompts)],
        args.max_new_tokens, "humaneval")
    sets["humaneval (greedy, float32)"] = [shape(tokenizer, p, a, args.max_new_tokens)
                                           for p, a in humaneval]
    instructed = []
    if args.instruction:
        starts = packaged_code_prompts(PYTHON_FUNCTION_STARTS, args.instruction_prompts,
                                       args.instruction)
        instructed = greedy_answers(model, tokenizer, [p for _, p in starts],
                                    args.max_new_tokens, "instructed")
        sets["python-function-starts, --instruction"] = [
            shape(tokenizer, p, a, args.max_new_tokens) for p, a in instructed]
    rows = [summarize(name, shapes) for name, shapes in sets.items() if shapes]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/quality/answer_shape.py --answers "
                       f"{args.answers} --training-answers {args.training_answers} "
                       f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}"
                       + (f" --instruction {json.dumps(args.instruction)} --instruction-"
                          f"prompts {args.instruction_prompts}" if args.instruction else ""),
            "rows": rows,
            "instruction": args.instruction,
            "humaneval_answers": [{"prompt": p, "answer": a} for p, a in humaneval],
            "instructed_answers": [{"prompt": p, "answer": a} for p, a in instructed]},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
