"""Prompt sets drawn from the training sources' own distribution but never trained on, to tell
a distribution gap from a hard task: is the chat set short because its prompts differ from the
training prompts, or because chat answers are hard to draft whatever the prompts?

- one set per task type of the prompts the target wrote (self-written), from the kept prompts
  after the first SEEN (the `data.sources.self-written.limit` of the drafter measured: the
  source keeps its prompts in writing order and a limit takes the first ones);
- `evals-unseen`: the evals package's chat prompts after the first EVALS_SEEN of its
  round-robin order (the recipe's `chat-sets` limit), unseen by every drafter of the recipe.

    python benchmarks/general/heldout_sets.py JOURNALS_DIR OUT_DIR --seen 20000 \\
        --evals-seen 12000 --per-set 20 --config examples/smollm2-h200.yaml \\
        --journal self-written-b177052c662e

JOURNALS_DIR is generate's journal folder (h200_run.sh `journals`: generate/prompts). The kept
prompts are the source's own: its journal read and filtered by the product's functions, with
the recipe's synthesize settings (--config). Each set is OUT_DIR/NAME.jsonl, every record in
the dev part; measure them with `draftsmith run CONFIG --set deploy.drafter=DRAFTER_DIR --set
"benchmark.suite=[{name: NAME, path: OUT_DIR/NAME.jsonl}, ...]" --set "benchmark.splits=[dev]"`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.artifacts import atomic_write_bytes
from draftsmith.config import load_config
from draftsmith.data.packaged import evals_rows
from draftsmith.generate.journal import Journal
from draftsmith.generate.synthesize import read_journal, record_id, select_prompts


def spread(items: list, count: int) -> list:
    """`count` items evenly spaced over the list (a fixed choice, no seed to report)."""
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


def trained_prompts(journals: Path, source: str, min_chars: int,
                    journal: str | None = None) -> list[dict]:
    """The source's kept prompts, as the product keeps them (`select_prompts`: index order, a
    limit takes the first ones), from a prompts journal whose every answered prompt (an
    answers journal's record ids carry the text's hash) is among them: a journal of other
    settings holds other texts at the same indices. `journal` names the prompts journal's
    folder when several qualify (runs of other settings kept beside the recipe's)."""
    answers = {path.name: {a.record_id for a in Journal(path).answers().values()}
               for path in journals.glob(f"answers/{source}-*") if path.is_dir()}
    prompts = sorted(journals.glob(f"prompts/{journal or source + '-*'}/written.jsonl"))
    if not answers or not prompts:
        raise SystemExit(f"{journals}: no prompts and answers journals of {source} "
                         f"(prompts/{journal or source + '-*'}, answers/{source}-*)")
    matched = {}
    for path in prompts:
        kept, _ = select_prompts(list(read_journal(path).values()), min_chars)
        ids = {record_id(source, entry) for entry in kept}
        answered = [name for name, done in answers.items() if done <= ids]
        if answered:
            matched[path.parent.name] = (kept, answered)
    if len(matched) != 1:
        found = "; ".join(f"{name} (answered in {', '.join(a)})"
                          for name, (_, a) in matched.items()) or "none"
        raise SystemExit(f"{journals}: {len(matched)} prompts journals of {source} hold the "
                         f"prompts an answers journal answered: {found}; name the recipe's "
                         "with --journal")
    return next(iter(matched.values()))[0]


def self_written_unseen(journals: Path, source: str, seen: int, min_chars: int,
                        journal: str | None = None) -> dict[str, list[dict]]:
    """The kept prompts after the first `seen`, by task type: {type: [journal entry]}."""
    by_type: dict[str, list[dict]] = {}
    for entry in trained_prompts(journals, source, min_chars, journal)[seen:]:
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
    parser.add_argument("--config", type=Path, default=Path("examples/smollm2-h200.yaml"),
                        help="the recipe: its self-written source's synthesize settings")
    parser.add_argument("--source", default="self-written")
    parser.add_argument("--journal", help="the recipe's prompts journal folder, e.g. "
                        "self-written-b177052c662e, when the journals hold several")
    args = parser.parse_args(argv)
    source = next(s for s in load_config(args.config).data.sources if s.name == args.source)
    sets = {f"written-{kind}": [as_record(f"self-written/{e['index']:07d}",
                                          [{"role": "user", "content": e["text"]}])
                                for e in spread(entries, args.per_set)]
            for kind, entries in sorted(self_written_unseen(
                args.journals, args.source, args.seen, source.synthesize.min_prompt_chars,
                args.journal).items())}
    sets["evals-unseen"] = [as_record(row["id"], row["messages"])
                            for row in evals_unseen(args.evals_seen, args.per_set)]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in sets.items():
        atomic_write_bytes(args.out / f"{name}.jsonl",
                           "".join(json.dumps(r) + "\n" for r in records).encode())
        print(f"{name}: {len(records)} prompts -> {args.out / name}.jsonl")


if __name__ == "__main__":
    main()
