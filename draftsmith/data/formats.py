"""Dataset adapters: every supported source format becomes the common record.

Common record: {"id", "source", "messages": [{"role", "content", "reasoning"?, "tool_calls"?,
"tool_call_id"?, "name"?}]} with roles system / user / assistant / tool. Turns may say their
speaker under `role` or `from` and their text under `content`, `text`, `value` or `parts`, in
every format. Nothing is dropped silently: each adapter reports what it read, kept and dropped
(with reasons), and a source that keeps nothing is an error.

Sources: local JSON / JSONL files are read here, line by line, so an error names the file's
line and a large file is not first converted into a second Arrow copy in the datasets cache;
Parquet files and Hugging Face datasets (hub names or local dataset directories) are read with
`datasets`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from draftsmith.artifacts import hash_json
from draftsmith.errors import InputError, MissingFileError

Role = Literal["system", "user", "assistant", "tool"]

# ShareGPT speakers and OpenAI roles seen in the wild -> common role.
_ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "function_call": "assistant",  # ShareGPT agent sets: the target's own call, trainable
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_response": "tool",
    "tool_response": "tool",
}
# Keys of the turn list, by format; "trajectory" accepts every spelling seen in agent sets.
_TURN_LISTS = {"sharegpt": ("conversations",), "openai": ("messages",),
               "trajectory": ("messages", "conversations", "trajectory", "conversation", "turns")}
# Keys a turn's speaker and text go under, in the order each format prefers them. Every format
# reads every spelling: agent sets mix OpenAI roles with ShareGPT lists, Gemini `parts`, and
# `text` (as some trajectory exporters write it).
_SPEAKER_KEYS = ("role", "from")
_TEXT_KEYS = {"sharegpt": ("value", "content", "text", "parts"),
              "openai": ("content", "text", "value", "parts"),
              "trajectory": ("content", "text", "value", "parts")}


class Message(BaseModel):
    role: Role
    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns of agent trajectories
    tool_call_id: str | None = None  # tool turns: which call this answers
    name: str | None = None  # tool turns: the tool's name


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
    dropped: dict[str, int] = {}  # reason -> records
    # Kept records that were changed on the way in (e.g. a null system turn left out).
    notes: dict[str, int] = {}


class DataFormatError(InputError, ValueError):
    pass


def detect_format(row: dict[str, Any]) -> str:
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "openai"
    if {"trajectory", "conversation", "turns"} & row.keys():
        return "trajectory"
    # Prompt-only, not prompt/response pairs: an answer field would be silently ignored.
    if "prompt" in row and not {"response", "completion", "output", "answer"} & row.keys():
        return "prompt"
    raise DataFormatError(
        "unknown record shape (keys: " + ", ".join(sorted(row)) + "); expected 'conversations' "
        "(ShareGPT), 'messages' (OpenAI), 'trajectory' / 'conversation' / 'turns' (agent "
        "trajectories) or 'prompt' (prompt-only). Set data.sources[].format or convert the file."
    )


_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


def _is_content_parts(value: Any) -> bool:
    """OpenAI content parts: a list of objects that each say their type (or carry text)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(p, dict) and ("type" in p or "text" in p) for p in value))


def _text(value: Any, role: str, text_key: str) -> str:
    """Turn text: a string, or OpenAI content parts of type text (joined)."""
    if isinstance(value, str):
        return value
    if _is_content_parts(value):
        kinds = {part.get("type", "text") for part in value}
        if kinds <= _TEXT_PART_TYPES:
            return "".join(str(part.get("text", "")) for part in value)
        if role != "tool":
            raise DataFormatError(f"{role} turn has non-text content parts "
                                  f"{sorted(kinds - _TEXT_PART_TYPES)}")
    if role == "tool" and isinstance(value, (dict, list, int, float, bool)):
        return json.dumps(value, ensure_ascii=False)  # structured tool output, kept as context
    raise DataFormatError(f"{role} turn has {text_key}={value!r:.80}, expected text")


def _parts(parts: Any, role: str) -> tuple[str, list[dict[str, Any]], Any]:
    """Gemini-style parts: (text, tool calls, a function response's content or None)."""
    if not isinstance(parts, list):
        raise DataFormatError(f"{role} turn has parts={parts!r:.80}, expected a list")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    responses: list[Any] = []
    other: set[str] = set()
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif not isinstance(part, dict):
            raise DataFormatError(f"{role} turn has a part {part!r:.80}, expected an object")
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(call := part.get("functionCall", part.get("function_call")), dict):
            calls.append({"type": "function", "function": {
                "name": call.get("name"),
                "arguments": json.dumps(call.get("args", call.get("arguments", {})),
                                        ensure_ascii=False)}})
        elif isinstance(reply := part.get("functionResponse", part.get("function_response")),
                        dict):
            responses.append(reply)
        else:
            other |= set(part) - {"thought", "thoughtSignature"}
    if other:
        raise DataFormatError(f"{role} turn has non-text parts {sorted(other)}")
    return "".join(texts), calls, responses or None


def _text_key(turn: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """The first key that holds something; else the first present (its value is null)."""
    present = [k for k in keys if k in turn]
    return next((k for k in present if turn[k] is not None), present[0] if present else None)


def _tool_calls(turn: dict[str, Any]) -> list[dict[str, Any]] | None:
    calls = turn.get("tool_calls")
    if calls is None and isinstance(turn.get("function_call"), dict):  # legacy OpenAI
        calls = [{"type": "function", "function": turn["function_call"]}]
    if calls is None:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise DataFormatError(f"tool_calls={calls!r:.80}, expected a list of objects")
    return calls or None


def _normalise(turns: Any, text_keys: tuple[str, ...], notes: Counter[str]) -> list[Message]:
    if not isinstance(turns, list):
        raise DataFormatError(f"turns are {type(turns).__name__}, expected a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise DataFormatError(f"turn {turn!r:.80} is not an object")
        rkey = next((k for k in _SPEAKER_KEYS if turn.get(k) is not None), "role")
        raw_role = str(turn.get(rkey, "")).lower()
        role = _ROLE_ALIASES.get(raw_role)
        if role is None:
            raise DataFormatError(f"unknown role {turn.get(rkey)!r}" + (
                "" if rkey in turn else f" (no {' or '.join(_SPEAKER_KEYS)} key)"))
        tkey = _text_key(turn, text_keys)
        value = turn.get(tkey) if tkey else None
        calls = _tool_calls(turn) if role == "assistant" else None
        name = turn.get("name")
        if tkey == "parts" and value is not None:
            value, part_calls, responses = _parts(value, role)
            if part_calls and role == "assistant":
                calls = [*(calls or []), *part_calls]
            elif part_calls:
                raise DataFormatError(f"{role} turn has function calls; only the assistant's "
                                      "turns call tools")
            if responses:  # Gemini sends tool results as parts of a user (or function) turn
                role = "tool"
                value = json.dumps(responses[0].get("response") if len(responses) == 1
                                   else [r.get("response") for r in responses],
                                   ensure_ascii=False)
                name = name or responses[0].get("name")
        if value is None and role == "system":
            notes["null system turn left out"] += 1
            continue  # trajectories with an empty system turn: the turn carries nothing
        if value is None and calls:
            value = ""  # an assistant turn that only calls tools
        if value is None and role == "tool":
            notes["null tool output kept as empty text"] += 1
            value = ""  # the tool returned nothing; the turn still answers its call
        if value is None and tkey is None:
            raise DataFormatError(f"{role} turn has no text (none of the keys "
                                  f"{', '.join(text_keys)})")
        text = _text(value, role, tkey or text_keys[0])
        reasoning = turn.get("reasoning_content") or turn.get("reasoning")
        tool_call_id = turn.get("tool_call_id")
        messages.append(Message(
            role=role, content=text, reasoning=reasoning if isinstance(reasoning, str) else None,
            tool_calls=calls,
            tool_call_id=str(tool_call_id) if role == "tool" and tool_call_id else None,
            name=str(name) if role == "tool" and name else None))
    if not messages:
        raise DataFormatError("no turns")
    if not any(m.role == "user" for m in messages):
        raise DataFormatError("no user turn")
    return messages


def to_record(row: dict[str, Any], fmt: str, source: str,
              notes: Counter[str] | None = None) -> Record:
    notes = Counter() if notes is None else notes
    if fmt == "sharegpt":
        messages = _normalise(row["conversations"], _TEXT_KEYS["sharegpt"], notes)
    elif fmt == "openai":
        messages = _normalise(row["messages"], _TEXT_KEYS["openai"], notes)
    elif fmt == "trajectory":
        key = next((k for k in _TURN_LISTS["trajectory"] if k in row), None)
        if key is None:
            raise DataFormatError("no turn list (expected one of "
                                  + ", ".join(_TURN_LISTS["trajectory"]) + ")")
        messages = _normalise(row[key], _TEXT_KEYS["trajectory"], notes)
    elif fmt == "prompt":  # prompt-only sets: the target answers them in generate
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataFormatError(f"prompt={prompt!r}, expected non-empty text")
        messages = [Message(role="user", content=prompt)]
    else:
        raise DataFormatError(f"unsupported format {fmt!r}")
    record_id = str(row.get("id") or hash_json([_identity(m) for m in messages])[:16])
    return Record(id=f"{source}/{record_id}", source=source, messages=messages)


def read_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line or index, row) from a JSONL file, a JSON array or a Parquet file."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: data file not found; check data.sources[].path "
                               "(relative paths are read from the config file's directory)")
    if path.suffix in (".parquet", ".arrow"):
        import datasets

        builder = "parquet" if path.suffix == ".parquet" else "arrow"
        yield from _dataset_rows(datasets.load_dataset(builder, data_files=str(path),
                                                       split="train"))
        return
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(rows, list):
            raise DataFormatError(f"{path}: expected a JSON array of records")
        yield from enumerate(rows, start=1)
        return
    # Line by line: a large file is never held in memory whole, and a reader that stops early
    # (a `limit`, `draftsmith validate`) reads only what it needs.
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataFormatError(f"{path}:{lineno}: not valid JSON: {err}") from None


def peek_rows(path: str | Path, n: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The first `n` rows of a local file, reading no more of it than that (Parquet through
    pyarrow directly: datasets would first convert the whole file)."""
    path = Path(path)
    if path.suffix == ".parquet" and path.is_file():
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
        rows = batch.to_pylist() if batch is not None else []
        yield from ((i, {k: v for k, v in row.items() if v is not None})
                    for i, row in enumerate(rows, start=1))
        return
    for count, item in enumerate(read_rows(path)):
        if count >= n:
            return
        yield item


def read_hub_rows(name: str, config: str | None = None, split: str = "train",
                  revision: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based index, row) of a Hugging Face dataset: a hub name or a local dataset directory."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split, revision=revision)
    except (FileNotFoundError, ValueError, ConnectionError,
            datasets.exceptions.DatasetNotFoundError) as err:
        raise DataFormatError(
            f"hub dataset {name!r} (config {config!r}, split {split!r}) could not be loaded: "
            f"{err}. Check the name, the split, that you have access (HF_TOKEN) and, offline "
            "(HF_HUB_OFFLINE=1), that it is in the local datasets cache") from None
    yield from _dataset_rows(dataset)


def _dataset_rows(dataset) -> Iterator[tuple[int, dict[str, Any]]]:
    # Arrow gives every row every column, None where a row had none: drop those so format
    # detection sees the keys the record really has.
    for index, row in enumerate(dataset, start=1):
        yield index, {k: v for k, v in row.items() if v is not None}


def load_source(
    name: str, path: str | Path | None = None, fmt: str = "auto", limit: int | None = None,
    max_drop_rate: float = 1.0, *, hub: str | None = None, hub_config: str | None = None,
    split: str = "train", revision: str | None = None, builtin: str | None = None,
    instruction: str | None = None, rows: Iterator[tuple[int, dict[str, Any]]] | None = None,
) -> tuple[list[Record], SourceStats]:
    """Read one source (a local file `path`, a Hugging Face dataset `hub`, or a prompt set a
    package ships, `builtin`). Fails when it keeps nothing or drops more than `max_drop_rate`
    of what it read, naming the reason and showing a dropped record. `rows` replaces the
    reading (e.g. the first few, from `peek_rows`)."""
    if sum(x is not None for x in (path, hub, builtin)) != 1:
        raise ValueError(f"data source {name!r}: give exactly one of path, hub or builtin")
    if builtin is not None:
        where = f"builtin:{builtin}"
    elif path is not None:
        where = str(path)
    else:
        where = f"hub:{hub}[{split}]"
    if rows is None:
        if builtin is not None:
            from draftsmith.data.packaged import builtin_rows

            rows = builtin_rows(builtin, limit, instruction)
        elif path is not None:
            rows = read_rows(path)
        else:
            rows = read_hub_rows(hub, hub_config, split, revision)
    stats = SourceStats(source=name)
    dropped: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    records: list[Record] = []
    first_error: str | None = None
    for lineno, row in rows:
        if limit is not None and stats.read >= limit:
            break
        stats.read += 1
        if not isinstance(row, dict):
            raise DataFormatError(f"{where}:{lineno}: expected a JSON object, got {row!r:.200}")
        try:
            row_format = detect_format(row) if fmt == "auto" else fmt
        except DataFormatError as err:  # say which of many sources (and which line) it is
            raise DataFormatError(f"data source {name!r} ({where}:{lineno}): {err}; record: "
                                  f"{_show(row)}") from None
        try:
            records.append(to_record(row, row_format, name, notes))
        except (DataFormatError, KeyError) as err:
            if isinstance(err, KeyError):
                err = DataFormatError(f"missing field {err}")
            dropped[str(err)] += 1
            first_error = first_error or f"{where}:{lineno}: {err}; record: {_show(row)}"
    stats.kept = len(records)
    stats.dropped = dict(dropped)
    stats.notes = dict(notes)
    if not records:
        raise DataFormatError(
            f"data source {name!r} ({where}) kept 0 of {stats.read} records. "
            f"First problem: {first_error or 'the file is empty'}"
        )
    drop_rate = 1 - stats.kept / stats.read
    if drop_rate > max_drop_rate:
        reason, count = max(dropped.items(), key=lambda item: item[1])
        raise DataFormatError(
            f"data source {name!r} ({where}) dropped {stats.read - stats.kept} of {stats.read} "
            f"records ({100 * drop_rate:.1f}% > data.max_drop_rate={max_drop_rate}); most "
            f"common reason ({count}x): {reason}. First dropped: {first_error}. Fix the data, "
            "or raise data.max_drop_rate if these records are meant to go"
        )
    return records, stats


def _identity(message: Message) -> dict[str, Any]:
    # The fields ids were first derived from, plus the agent fields only where present, so
    # ids of records without tool turns stay what they were.
    return {**message.model_dump(include={"role", "content", "reasoning"}),
            **message.model_dump(include={"tool_calls", "tool_call_id", "name"},
                                 exclude_none=True)}


def _show(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False, default=str)[:300]
