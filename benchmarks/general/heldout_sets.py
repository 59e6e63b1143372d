"""Prompt sets drawn from the training sources' own distribution but never trained on, to tell
a distribution gap from a hard task: is the chat set short because its prompts differ from the
training prompts, or because chat answers are hard to draft whatever the prompts?

- one set per task type of the prompts the target wrote (self-written), from the kept prompts
  after the first SEEN (the `data.sources.self-written.limit` of the drafter measured: the
  source keeps its prompts in writing order and a limit takes the first ones);
- `evals-unseen`: the evals package's chat prompts after the first EVALS_SEEN of its
  round-robin order (the recipe's `chat-sets` limit), unseen by every drafter of the recipe.

    python benchmarks/general/heldout_sets.py JOURNALS_DIR OUT_DIR --seen 20000 \\
        --evals-seen 12000 --per-set 20

JOURNALS_DIR is generate's journal folder (h200_run.sh `journals`: generate/prompts and
generate/answers). Each set is OUT_DIR/NAME.jsonl, every record in the dev part; measure them
with `summary.py embedded-drafter ... --sets NAME=OUT_DIR/NAME.jsonl`.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from draftsmith.artifacts import atomic_write_bytes
from draftsmith.data.packaged import evals_rows

_INDEX = re.compile(r"^self-written/(\d+)-")


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as lines:  # text may hold U+2028, which splitlines splits
        return [json.loads(line) for line in lines if line.strip()]


def spread(items: list, count: int) -> list:
    """`count` items evenly spaced over the list (a fixed choice, no seed to report)."""
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


def self_written_unseen(journals: Path, seen: int) -> dict[str, list[dict]]:
    """The kept prompts after the first `seen`, by task type: {type: [journal entry]}."""
    written = {}
    for path in journals.glob("prompts/self-written-*/written.jsonl"):
        for entry in _jsonl(path):
            written[entry["index"]] = entry
    kept = set()
    for path in journals.glob("answers/self-written-*/answers.jsonl"):
        for entry in _jsonl(path):
            match = _INDEX.match(entry["record_id"])
            if match:
                kept.add(int(match.group(1)))
    if not kept:
        raise SystemExit(f"{journals}: no self-written answers journal (answers/self-written-*)")
    by_type: dict[str, list[dict]] = {}
    for index in sorted(kept)[seen:]:
        entry = written[index]
        by_type.setdefault(entry["task_type"], []).append(entry)
    return by_type


def evals_unseen(seen: int, count: int) -> list[dict]:
    """evals chat prompts after the first `seen` of the source's order (at most 4 per set)."""
    trained = {row["id"] for _, row in evals_rows(seen)}
    rows = [row for _, row in evals_rows(seen * 2) if row["id"] not in trained]
    return spread(rows, count)


def as_record(record_id: str, messages: list[dict]) -> dict:
    return {"id": record_id, "messages": messages, "split": "dev"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("journals", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seen", type=int, required=True,
                        help="self-written prompts the drafter trained on (its source limit)")
    parser.add_argument("--evals-seen", type=int, default=12000)
    parser.add_argument("--per-set", type=int, default=20)
    args = parser.parse_args(argv)
    sets = {f"written-{kind}": [as_record(f"self-written/{e['index']:07d}",
                                          [{"role": "user", "content": e["text"]}])
                                for e in spread(entries, args.per_set)]
            for kind, entries in sorted(self_written_unseen(args.journals, args.seen).items())}
    sets["evals-unseen"] = [as_record(row["id"], row["messages"])
                            for row in evals_unseen(args.evals_seen, args.per_set)]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in sets.items():
        atomic_write_bytes(args.out / f"{name}.jsonl",
                           "".join(json.dumps(r) + "\n" for r in records).encode())
        print(f"{name}: {len(records)} prompts -> {args.out / name}.jsonl")


if __name__ == "__main__":
    main()
