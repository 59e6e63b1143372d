"""Tokenising answers for the merge stage: in one process and over a pool of workers.

    python benchmarks/merge_tokenize.py --answers ANSWERS.jsonl[.xz] --records 8000 \
        --workers 0 2 --out benchmarks/results/merge_tokenize/cpu.jsonl

Prints one JSON line per variant (records/s) and checks that every variant gives the same
rows as the first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import lzma
import os
import time
from pathlib import Path

from draftsmith.config import TargetConfig
from draftsmith.data.formats import Record
from draftsmith.data.tokenize import tokenize_records
from draftsmith.target import load_tokenizer, resolve_target


def read_answers(path: Path, limit: int) -> list[Record]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        return [Record.model_validate({**json.loads(line), "source": "answers"})
                for line in itertools.islice(f, limit)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=Path, required=True)
    parser.add_argument("--records", type=int, default=8000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--target", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_target(TargetConfig(model=args.target)))
    records = read_answers(args.answers, args.records)
    reference = None
    lines = []
    for workers in args.workers:
        started = time.perf_counter()
        rows = tokenize_records(tokenizer, records, workers=workers)
        seconds = time.perf_counter() - started
        reference = reference if reference is not None else rows
        line = {"workers": workers, "records": len(records), "seconds": round(seconds, 2),
                "records_per_s": round(len(records) / seconds, 1),
                "identical_rows": rows == reference, "cores": os.cpu_count()}
        print(json.dumps(line), flush=True)
        lines.append(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
