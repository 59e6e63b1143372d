"""Dataset adapters: every supported source format becomes the common record.

Common record: {"id", "source", "messages": [{"role", "content", "reasoning"?}]} with roles
system / user / assistant / tool. Nothing is dropped silently: each adapter reports what it
read, kept and dropped (with reasons), and a source that keeps nothing is an error.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from draftsmith.artifacts import hash_json

Role = Literal["system", "user", "assistant", "tool"]

# ShareGPT speakers and OpenAI roles seen in the wild -> common role.
_ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class Message(BaseModel):
    role: Role
    content: str
    reasoning: str | None = None


class Record(BaseModel):
    id: str
    source: str
    messages: list[Message] = Field(..., min_length=1)

    def needs_answer(self) -> bool:
        return self.messages[-1].role != "assistant"


class SourceStats(BaseModel):
    source: str
    read: int = 0
    kept: int = 0
    dropped: dict[str, int] = {}


class DataFormatError(ValueError):
    pass


def detect_format(row: dict[str, Any]) -> str:
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "openai"
    # Prompt-only, not prompt/response pairs: an answer field would be silently ignored.
    if "prompt" in row and not {"response", "completion", "output", "answer"} & row.keys():
        return "prompt"
    raise DataFormatError(
        "unknown record shape (keys: " + ", ".join(sorted(row)) + "); expected 'conversations' "
        "(ShareGPT), 'messages' (OpenAI) or 'prompt' (prompt-only). Set data.sources[].format "
        "or convert the file."
    )


def _normalise(turns: list[dict[str, Any]], role_key: str, text_key: str) -> list[Message]:
    messages = []
    for turn in turns:
        raw_role = str(turn.get(role_key, "")).lower()
        role = _ROLE_ALIASES.get(raw_role)
        if role is None:
            raise DataFormatError(f"unknown role {turn.get(role_key)!r}")
        text = turn.get(text_key)
        if text is None and role == "system":
            continue  # trajectories with an empty system turn: the turn carries nothing
        if not isinstance(text, str):
            raise DataFormatError(f"{role} turn has {text_key}={text!r}, expected text")
        reasoning = turn.get("reasoning_content") or turn.get("reasoning")
        messages.append(Message(role=role, content=text, reasoning=reasoning))
    if not messages:
        raise DataFormatError("no turns")
    if not any(m.role == "user" for m in messages):
        raise DataFormatError("no user turn")
    return messages


def to_record(row: dict[str, Any], fmt: str, source: str) -> Record:
    if fmt == "sharegpt":
        messages = _normalise(row["conversations"], "from", "value")
    elif fmt == "openai":
        messages = _normalise(row["messages"], "role", "content")
    elif fmt == "prompt":  # prompt-only sets: the target answers them in generate
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataFormatError(f"prompt={prompt!r}, expected non-empty text")
        messages = [Message(role="user", content=prompt)]
    else:
        raise DataFormatError(f"unsupported format {fmt!r}")
    record_id = str(row.get("id") or hash_json([m.model_dump() for m in messages])[:16])
    return Record(id=f"{source}/{record_id}", source=source, messages=messages)


def read_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line or index, row) from a JSONL file or a JSON array."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file not found")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise DataFormatError(f"{path}: expected a JSON array of records")
        yield from enumerate(rows, start=1)
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{path}:{lineno}: not valid JSON: {err}") from None


def load_source(
    name: str, path: str | Path, fmt: str = "auto", limit: int | None = None,
    max_drop_rate: float = 1.0,
) -> tuple[list[Record], SourceStats]:
    """Read one source. Fails when it keeps nothing or drops more than `max_drop_rate` of
    what it read, naming the reason and showing a dropped record."""
    stats = SourceStats(source=name)
    dropped: Counter[str] = Counter()
    records: list[Record] = []
    first_error: str | None = None
    for lineno, row in read_rows(path):
        if limit is not None and stats.read >= limit:
            break
        stats.read += 1
        if not isinstance(row, dict):
            raise DataFormatError(f"{path}:{lineno}: expected a JSON object, got {row!r:.200}")
        try:
            row_format = detect_format(row) if fmt == "auto" else fmt
        except DataFormatError as err:  # say which of many sources (and which line) it is
            raise DataFormatError(f"data source {name!r} ({path}:{lineno}): {err}; record: "
                                  f"{json.dumps(row)[:300]}") from None
        try:
            records.append(to_record(row, row_format, name))
        except (DataFormatError, KeyError) as err:
            if isinstance(err, KeyError):
                err = DataFormatError(f"missing field {err}")
            dropped[str(err)] += 1
            first_error = first_error or f"{path}:{lineno}: {err}; record: {json.dumps(row)[:300]}"
    stats.kept = len(records)
    stats.dropped = dict(dropped)
    if not records:
        raise DataFormatError(
            f"data source {name!r} ({path}) kept 0 of {stats.read} records. "
            f"First problem: {first_error or 'the file is empty'}"
        )
    drop_rate = 1 - stats.kept / stats.read
    if drop_rate > max_drop_rate:
        reason, count = max(dropped.items(), key=lambda item: item[1])
        raise DataFormatError(
            f"data source {name!r} ({path}) dropped {stats.read - stats.kept} of {stats.read} "
            f"records ({100 * drop_rate:.1f}% > data.max_drop_rate={max_drop_rate}); most "
            f"common reason ({count}x): {reason}. First dropped: {first_error}. Fix the data, "
            "or raise data.max_drop_rate if these records are meant to go"
        )
    return records, stats
