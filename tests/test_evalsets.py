"""The evaluation suite's prompt sets: fixed dev and test parts, and the sets of your own."""

from __future__ import annotations

import json

import pytest

from draftsmith.config import BenchmarkConfig, ConfigError, parse_config
from draftsmith.data.evalsets import (
    EvalSetError,
    eval_set_fingerprint,
    load_eval_set,
    part,
)


@pytest.mark.parametrize("name", ["chat", "math"])
def test_written_sets_have_fixed_parts(name):
    prompts = load_eval_set(name)
    assert len(prompts) == 120
    assert len({p.id for p in prompts}) == 120
    assert len({p.text for p in prompts}) == 120  # no prompt twice
    assert [p.split for p in prompts[:6]] == ["dev", "test", "test", "dev", "test", "test"]
    assert len(part(prompts, "dev")) == 40 and len(part(prompts, "test")) == 80
    assert all(p.messages[0]["role"] == "user" and len(p.text) > 10 for p in prompts)
    # every read gives the same parts
    assert [p.split for p in load_eval_set(name)] == [p.split for p in prompts]


def test_code_set_is_humaneval_with_spent_problems_held_back():
    prompts = load_eval_set("code")
    assert len(prompts) == 164
    dev, test = part(prompts, "dev"), part(prompts, "test")
    assert [p.id for p in dev[:2]] == ["HumanEval-48", "HumanEval-49"]
    assert dev[-1].id == "HumanEval-81" and len(dev) == 34
    assert test[0].id == "HumanEval-82" and test[-1].id == "HumanEval-163" and len(test) == 82
    spent = [p for p in prompts if p.split == "spent"]
    assert [p.id for p in spent] == [f"HumanEval-{i}" for i in range(48)]
    first = prompts[0]
    assert first.entry_point == "has_close_elements"
    assert "def has_close_elements" in first.text and first.reference.startswith(
        first.text.split("```python\n", 1)[1].split("```")[0].rstrip()[:40])
    assert part(prompts, "test", limit=5) == test[:5]


def test_a_set_of_your_own(tmp_path):
    path = tmp_path / "support.jsonl"
    rows = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"question {i}?"},
                                         {"role": "assistant", "content": "an answer"}]}
            for i in range(40)]
    rows[0]["split"] = "test"
    rows[1]["split"] = "dev"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_eval_set("support", str(path), dev_fraction=0.5)
    assert prompts[0].split == "test" and prompts[1].split == "dev"
    assert all(len(p.messages) == 1 for p in prompts)  # the answer is left for the target
    placed = [p.split for p in prompts[2:]]
    assert 5 < placed.count("dev") < 33  # by id hash, about half
    # adding a record moves no other between the parts
    path.write_text(path.read_text() + json.dumps({"id": "new", "prompt": "another?"}) + "\n")
    again = load_eval_set("support", str(path), dev_fraction=0.5)
    assert [p.split for p in again[:40]] == [p.split for p in prompts]
    assert eval_set_fingerprint("support", str(path), 0.5) != eval_set_fingerprint(
        "support", str(path), 0.3)


def test_a_bad_set_names_the_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "hi there", "split": "train"}) + "\n")
    with pytest.raises(EvalSetError, match=r"bad.jsonl:1.*split='train'.*dev or test"):
        load_eval_set("bad", str(path))
    with pytest.raises(EvalSetError, match="no builtin set has that name"):
        load_eval_set("poetry")


def test_suite_config():
    cfg = BenchmarkConfig(suite=["chat", {"name": "mine", "path": "x.jsonl"}])
    assert [s.name for s in cfg.suite] == ["chat", "mine"] and cfg.splits == ["test"]
    base = {"data": {"sources": [{"name": "a", "path": "a.jsonl"}]}}
    with pytest.raises(ConfigError, match="suite names its own prompt sets"):
        parse_config({**base, "benchmark": {"suite": ["chat"], "prompts_builtin": "humaneval"}})
    with pytest.raises(ConfigError, match=r"\['chat'\] more than once"):
        parse_config({**base, "benchmark": {"suite": ["chat", "chat"]}})
