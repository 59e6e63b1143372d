"""Would exercises the target writes itself be HumanEval-like training prompts? A probe on the CPU.

acceptance_by_segment.py found the drafters weaker on HumanEval than on held-out training
answers within code and within prose: the training prompts are library functions, HumanEval's
are small algorithmic exercises. Before building a prompt source of such exercises, this probe
checks that they are hard for today's drafter in the same way:
1. the target (float32) writes one exercise per topic, sampled: a function signature and a
   docstring, in a code block;
2. each exercise's signature and docstring become a prompt in the python-functions form
   (`completion_prompt`), which the target answers greedily, as the evaluation decodes;
3. the drafter replays those answers, counted by segment as acceptance_by_segment.py counts.
Acceptance near HumanEval's (2.88) says such prompts carry what the training set lacks; near
the held-out training answers' (3.07-3.12) says they do not.

    python benchmarks/quality/exercise_probe.py --drafter DRAFTER_DIR \
        --out benchmarks/results/quality_scale/exercise_probe.json
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

from acceptance_by_segment import (  # noqa: E402
    count_rounds,
    cpu_engine,
    summarize,
    token_segments,
)
from exercises import EXERCISE, TOPICS, exercise_head  # noqa: E402

# The probe's topics: the first 48 of the exercise source's.
PROBE_TOPICS = 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True, help="an exported drafter dir")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from draftsmith.data.packaged import completion_prompt
    from draftsmith.serve.deploy import prompt_ids
    from draftsmith.serve.embedded import Sampling, plain_generate

    started = time.monotonic()
    tokenizer, engine = cpu_engine(args.target, args.drafter)
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return prompt_ids(tokenizer, json.dumps([{"role": "user", "content": text}]))

    exercises, counts = [], []
    for seed, topic in enumerate(TOPICS[:PROBE_TOPICS]):
        written = plain_generate(engine.runner, ids(EXERCISE.format(topic=topic)), 160, eos,
                                 Sampling(args.temperature, seed=seed))
        head = exercise_head(tokenizer.decode(written.tokens, skip_special_tokens=True))
        if head is None:
            exercises.append({"topic": topic, "head": None})
            continue
        prompt = ids(completion_prompt(head))
        answer = plain_generate(engine.runner, prompt, args.max_new_tokens, eos).tokens
        replay = engine.replay(prompt, answer)
        counts.append(count_rounds(replay.round_tokens, token_segments(tokenizer, answer)))
        exercises.append({"topic": topic, "head": head,
                          "answer": tokenizer.decode(answer, skip_special_tokens=True)})
        print(f"{topic}: {sum(replay.round_tokens) / max(len(replay.round_tokens), 1):.2f} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    engine.runner.close()
    row = summarize("target-written exercises (greedy, float32)", counts)
    row["topics"], row["usable"] = PROBE_TOPICS, len(counts)
    print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/quality/exercise_probe.py " + " ".join(sys.argv[1:]),
            "exercise_instruction": EXERCISE, "temperature": args.temperature,
            "row": row, "exercises": exercises}, indent=1) + "\n")


if __name__ == "__main__":
    main()
