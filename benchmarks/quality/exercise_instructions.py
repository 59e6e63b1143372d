"""Which instruction makes the target write exercises with doctest examples, as HumanEval's are?

46% of HumanEval's prompts hold doctest examples (`>>>`), 2% of the exercises that SmolLM2
writes with exercises.py's instruction. This script asks SmolLM2 (float32, on the CPU, sampled
at temperature 0.8) for one exercise on each of 48 topics (TOPICS[48:96], which the exercise
probe did not use) with each instruction below, and counts the usable ones (`exercise_head`),
those with a doctest, and their distinct function names (an instruction that shows an example
can make the target copy it). Then two ways to add examples to the exercises of exercises.py's
instruction, greedily: a second turn that asks for them, and the answer started for the target
up to the first doctest's call (`with_examples`).

    python benchmarks/quality/exercise_instructions.py \
        --out benchmarks/results/quality_scale/exercise_instructions.json
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

from exercises import (  # noqa: E402
    DOCTEST,
    EXERCISE,
    TOPICS,
    exercise_head,
    function_name,
    with_examples,
    written_exercises,
)

SHOWN = '''def count_evens(numbers: list) -> int:
    """Return how many numbers in the list are even.

    >>> count_evens([1, 2, 4])
    2
    >>> count_evens([])
    0
    """'''
INSTRUCTIONS = {
    "exercises.py": EXERCISE,
    "asked for doctests": (
        "Write a short Python programming exercise about {topic}. Give only a function "
        "signature and a docstring that states the task and shows two examples as doctests "
        "(lines starting with >>>), in a code block."),
    "one example shown": (
        "Here is a Python programming exercise:\n\n```python\n" + SHOWN + "\n```\n\nWrite a "
        "new short exercise about {topic} in the same form: only a function signature and a "
        "docstring with two examples."),
}
SECOND_TURN = ("Add two examples to the docstring of this function, as doctests (lines starting "
               "with >>> and the expected result below each). Answer with the function "
               "signature and the new docstring only, in a code block.\n\n```python\n{head}\n```")


def counted(heads: list[str], written: int, started: float) -> dict:
    names = [function_name(h) for h in heads]
    return {"written": written, "usable": len(heads),
            "with_doctest": sum(bool(DOCTEST.search(h)) for h in heads),
            "distinct_names": len(set(names)),
            "mean_chars": round(sum(map(len, heads)) / max(len(heads), 1), 1),
            "seconds": round(time.monotonic() - started, 1), "heads": heads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from draftsmith.config import TargetConfig
    from draftsmith.generate.transformers_backend import TransformersGenerator
    from draftsmith.target import load_target_model, load_tokenizer, resolve_target

    torch.set_num_threads(2)
    target = resolve_target(TargetConfig(model=args.target))
    model, tokenizer = load_target_model(target.path, "cpu", "float32"), load_tokenizer(target)
    sampled = TransformersGenerator(model, tokenizer, max_new_tokens=192, temperature=0.8,
                                    top_p=1.0, seed=0, cache="dynamic", batch_size=24)
    rows = {}

    def report(name: str, row: dict) -> None:
        rows[name] = row
        print(name, {k: v for k, v in row.items() if k not in ("heads", "instruction")},
              flush=True)

    for name, instruction in INSTRUCTIONS.items():
        started = time.monotonic()
        requests = [(topic, instruction.format(topic=topic)) for topic in TOPICS[48:96]]
        heads = [h for _, text in written_exercises(sampled, requests, 24)
                 if (h := exercise_head(text))]
        report(name, {"instruction": instruction, **counted(heads, len(requests), started)})

    first = rows["exercises.py"]["heads"]
    greedy = TransformersGenerator(model, tokenizer, max_new_tokens=256, temperature=0.0,
                                   top_p=1.0, seed=0, cache="dynamic", batch_size=24)
    started = time.monotonic()
    answers = greedy.complete([[{"role": "user", "content": SECOND_TURN.format(head=h)}]
                               for h in first])
    heads = [h for a in answers if (h := exercise_head(a.text))]
    report("exercises.py, then a second turn", {"instruction": SECOND_TURN,
                                                **counted(heads, len(first), started)})
    started = time.monotonic()
    greedy.max_new_tokens = 80
    report("exercises.py, then the answer started (with_examples)",
           counted(with_examples(greedy, first, 24), len(first), started))
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/quality/exercise_instructions.py "
                       + " ".join(sys.argv[1:]), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
