"""The generate stage's output as merge reads it: one common record per JSON line."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from draftsmith.artifacts import Descriptor
from draftsmith.data.formats import Record

RECORDS_FILE = "records.jsonl"


def write_records(directory: Path, records: Iterable[Record]) -> None:
    """The records into `directory`/records.jsonl, unset fields left out."""
    with open(directory / RECORDS_FILE, "w") as f:
        for record in records:
            f.write(record.model_dump_json(exclude_none=True) + "\n")


def read_records(generated: Descriptor) -> list[Record]:
    with open(generated.dir / RECORDS_FILE) as f:
        return [Record.model_validate_json(line) for line in f]
