"""The answers journal of a generate run: what was asked, what came back, and what failed.

Every backend (an OpenAI-compatible endpoint, a `vllm serve` of the target, transformers in
process) asks with the same `Request` and journals the same `Answer`. Each answer is one JSON
line, appended and fsynced as it arrives, so a crashed or retried run reads back what was
answered and asks only for the rest.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.diskspace import append_line

log = logging.getLogger(__name__)

ANSWERS_FILE = "answers.jsonl"
ERRORS_FILE = "errors.jsonl"


def adopt_journal(directory: Path, earlier_name: Path) -> Path:
    """`directory`, taking over a journal kept under `earlier_name` (the name an older
    draftsmith gave the same settings) when only that one exists, so upgrading asks nothing
    again. Another host may rename it first; then its new name is there."""
    if directory.exists() or earlier_name == directory or not earlier_name.is_dir():
        return directory
    try:
        earlier_name.rename(directory)
    except OSError:
        if not directory.exists():
            raise
    log.info("journal %s: taken over from %s (named with the settings of an older draftsmith)",
             directory, earlier_name)
    return directory


@dataclass
class Request:
    key: str  # the journal key: record id and prompt, hashed
    record_id: str
    messages: list[dict[str, Any]]
    prompt_tokens: int  # counted with the target's tokenizer, to pick the partition


@dataclass
class Answer:
    key: str
    record_id: str
    content: str
    reasoning: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None


# Why a request failed, as errors.jsonl and generation.json count it.
CAUSES = ("malformed_reply", "http_status", "timeout", "connection", "prompt_too_long")


@dataclass
class Failure:
    key: str
    record_id: str
    error: str
    attempts: int
    retryable: bool
    cause: str = "http_status"  # one of CAUSES (journals written before it: HTTP errors)


class Journal:
    """Answers and failures of one generate run, in a directory that outlives a crashed attempt.

    One JSON line per answer, flushed and fsynced before the next is written: a kill loses at
    most the line being written, which is ignored (and cut off) on the next read.

    `writer` names this process's own files (`answers.<writer>.jsonl`): the hosts of a
    generate spread over several hosts each append to their own file only, never to one file
    together, and every reader sees the answers of all of them."""

    def __init__(self, directory: str | Path, writer: str | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        suffix = f".{writer}" if writer else ""
        self.answers_path = self.dir / ANSWERS_FILE.replace(".jsonl", f"{suffix}.jsonl")
        self.errors_path = self.dir / ERRORS_FILE.replace(".jsonl", f"{suffix}.jsonl")

    def answer_files(self) -> list[Path]:
        """This writer's file first, then the others' (other hosts, earlier spread runs)."""
        others = sorted(p for p in self.dir.glob("answers*.jsonl") if p != self.answers_path)
        return [self.answers_path, *others]

    def answers(self) -> dict[str, Answer]:
        out: dict[str, Answer] = {}
        for path in self.answer_files():
            if path.is_file():
                self.read_answers(path, out, own=path == self.answers_path)
        return out

    def read_answers(self, path: Path, out: dict[str, Answer], own: bool) -> None:
        """Add the answers of one journal file to `out` (the first answer of a key wins).
        own: this writer's file, whose torn last line is cut off."""
        good_bytes = 0
        with open(path, "rb") as f:
            for raw in f:
                try:
                    answer = Answer(**json.loads(raw))
                except (json.JSONDecodeError, TypeError):
                    break  # a line torn by a crash: everything after it is untrusted
                out.setdefault(answer.key, answer)
                good_bytes += len(raw)
        # Only this writer's own file is cut: another host may be writing the end of its own.
        if own and good_bytes < path.stat().st_size:
            log.warning("journal %s: cutting off a partial last line left by a crash", path)
            with open(path, "rb+") as f:
                f.truncate(good_bytes)
                os.fsync(f.fileno())

    def failures(self) -> list[Failure]:
        if not self.errors_path.is_file():
            return []
        out = []
        for line in self.errors_path.read_text().splitlines():
            try:
                out.append(Failure(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue  # torn by a crash: that request is still unanswered, so retried
        return out

    def _append(self, path: Path, obj: Any) -> None:
        # A full disk: DiskFullError naming the journal, and the torn line taken back.
        append_line(path, json.dumps(obj, ensure_ascii=False) + "\n")

    def add_answer(self, answer: Answer) -> None:
        self._append(self.answers_path, asdict(answer))

    def start_attempt(self) -> None:
        """Failures are per attempt: a new attempt retries them, so the old list goes."""
        self.errors_path.unlink(missing_ok=True)

    def add_failure(self, failure: Failure) -> None:
        self._append(self.errors_path, asdict(failure))


@dataclass
class RunTotals:
    """This attempt's figures (the stage adds the journal's earlier answers to its totals)."""

    answered: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    with_reasoning: int = 0
    retries: int = 0
    seconds: float = 0.0
    per_partition: dict[str, dict[str, int]] = field(default_factory=dict)
