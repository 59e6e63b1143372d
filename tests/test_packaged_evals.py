"""The `openai-evals` builtin source: chat prompts read from the evals package's registry
(installed with --no-deps by the test command, as the docs tell users to)."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest

from draftsmith.config import DataSource
from draftsmith.data import packaged
from draftsmith.data.formats import load_source
from draftsmith.data.packaged import (
    EVALS_MAX_PROMPT_CHARS,
    OPENAI_EVALS,
    PackagedSourceError,
    builtin_fingerprint,
    check_installed,
    evals_prompt,
    evals_rows,
)


def set_of(row: dict) -> str:
    return row["id"].rsplit(":", 1)[0]


def test_a_limit_takes_every_set_in_turn_and_is_the_same_each_time():
    rows = [row for _, row in evals_rows(600)]
    assert len(rows) == 600
    assert rows == [row for _, row in evals_rows(600)]
    assert len({row["id"] for row in rows}) == 600
    sets = Counter(set_of(row) for row in rows)
    # 660 set files, about 500 with chat prompts: the first round takes one from each, and no
    # set gives a second prompt before every set gave its first.
    assert len(sets) >= 450, len(sets)
    first_round = [set_of(row) for row in rows[:len(sets)]]
    assert len(set(first_round)) == len(sets)
    assert max(sets.values()) == 2
    for row in rows:
        turns = row["messages"]
        assert turns[-1]["role"] == "user"
        assert {t["role"] for t in turns} <= {"system", "user", "assistant"}
        assert sum(len(t["content"]) for t in turns) <= EVALS_MAX_PROMPT_CHARS


def test_a_large_limit_reads_deeper_into_the_long_sets():
    rows = [row for _, row in evals_rows(3000)]
    assert len(rows) == 3000
    sets = Counter(set_of(row) for row in rows)
    assert max(sets.values()) > 3000 // len(sets)  # short sets ran out; long ones gave more


def test_the_records_are_prompts_the_target_answers():
    records, stats = load_source("general", builtin=OPENAI_EVALS, limit=40)
    assert stats.read == stats.kept == 40 and len(records) == 40
    for record in records:
        assert record.source == "general" and record.id.startswith("general/")
        assert record.needs_answer() and record.messages[-1].role == "user"


def test_only_text_conversations_that_end_with_the_user_are_prompts():
    system = {"role": "system", "content": "Answer in one word."}
    user = {"role": "user", "content": "What colour is the sky?"}
    assert evals_prompt({"input": [system, user], "ideal": "Blue"}) == [system, user]
    assert evals_prompt({"input": "a bare string"}) is None
    assert evals_prompt({"input": [system, user, {"role": "assistant", "content": "Blue"}]}) \
        is None
    assert evals_prompt({"input": [{"role": "user", "content": [{"type": "image_url"}]}]}) \
        is None
    assert evals_prompt({"input": [{"role": "user", "content": "x" * (EVALS_MAX_PROMPT_CHARS
                                                                      + 1)}]}) is None


def test_the_key_follows_the_limit():
    assert builtin_fingerprint(OPENAI_EVALS, 100) == builtin_fingerprint(OPENAI_EVALS, 100)
    assert builtin_fingerprint(OPENAI_EVALS, 100) != builtin_fingerprint(OPENAI_EVALS, 200)
    assert builtin_fingerprint(OPENAI_EVALS, 100).startswith("evals-3.0.1.post1-")


def test_not_installed_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name == "evals" else real(name, *a))
    with pytest.raises(PackagedSourceError, match="pip install --no-deps evals==3.0.1.post1"):
        check_installed(OPENAI_EVALS)


def test_the_config_takes_it_as_a_builtin():
    source = DataSource.model_validate({"name": "general", "builtin": OPENAI_EVALS,
                                        "limit": 2000})
    assert source.builtin == OPENAI_EVALS
    assert json.loads(source.model_dump_json())["builtin"] == "openai-evals"
