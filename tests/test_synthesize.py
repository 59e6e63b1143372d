"""Prompts the target writes itself: the plan, the filters, the journal and its resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from draftsmith.artifacts import plan_stage
from draftsmith.config import (
    ConfigError,
    DataConfig,
    GenerateConfig,
    SynthesizeConfig,
    TargetConfig,
    parse_config,
)
from draftsmith.generate import synthesize
from draftsmith.generate.synthesize import (
    FREE,
    is_repetitive,
    plan_writings,
    read_journal,
    select_prompts,
    user_turn_start,
    write_prompts,
)


def test_the_plan_is_fixed_by_the_settings():
    cfg = SynthesizeConfig(prompts=3000, free_share=0.3, task_types={"chat": 2, "math": 1})
    writings = plan_writings(cfg)
    assert writings == plan_writings(cfg)  # the same prompts to write, every time
    assert writings != plan_writings(cfg.model_copy(update={"seed": 1}))
    kinds = Counter(w.task_type for w in writings)
    assert 800 < kinds[FREE] < 1000 and set(kinds) == {FREE, "chat", "math"}
    assert 1.7 < kinds["chat"] / kinds["math"] < 2.3
    assert all(w.opener == "" for w in writings if w.task_type == FREE)
    # openers that name a topic are used only when there are topics
    assert not any("{topic}" in w.opener or w.opener == "Explain volcanoes" for w in writings)
    topical = plan_writings(SynthesizeConfig(prompts=400, free_share=0.0, topics=["volcanoes"],
                                             task_types={"explanation": 1}))
    assert {"Explain volcanoes", "How does volcanoes work"} <= {w.opener for w in topical}


def test_task_types_are_checked():
    with pytest.raises(ValueError, match=r"unknown types \['poetry'\]"):
        SynthesizeConfig(prompts=10, task_types={"poetry": 1})
    cfg = SynthesizeConfig(prompts=50, free_share=0, task_types={"poetry": 1},
                           openers={"poetry": ["Write a sonnet about"]})
    assert {w.opener for w in plan_writings(cfg)} == {"Write a sonnet about"}
    with pytest.raises(ConfigError, match="give exactly one of path"):
        parse_config({"data": {"sources": [{"name": "w", "path": "a.jsonl",
                                            "synthesize": {"prompts": 5}}]}})


def test_the_user_turn_starts_where_its_text_goes(random_target_tokenizer):
    tokenizer = random_target_tokenizer
    start = user_turn_start(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "How are tides made?"}],
                                         tokenize=False, add_generation_prompt=False)
    assert text.startswith(start + "How are tides made?") and start


def test_filters():
    def entry(i, text, finish="stop"):
        return {"index": i, "text": text, "finish_reason": finish, "task_type": "chat"}

    entries = [entry(0, "What is the best way to learn to swim as an adult?"),
               entry(1, "Explain how tides work and why there are two a day", finish="length"),
               entry(2, "Hi?"),
               entry(3, "what is the best way to learn to swim, as an adult"),
               entry(4, "go go go go go go go go go go go go go go go"),
               entry(5, "Write a poem about the sea, the sea, the sea, the sea.")]
    kept, dropped = select_prompts(entries, min_chars=16)
    assert [e["index"] for e in kept] == [0]
    assert dropped == {"unfinished (no end of turn within max_prompt_tokens)": 1,
                       "too short": 1, "duplicate": 1, "repetitive": 2}
    assert not is_repetitive("Plan a three day trip to Rome with a museum each day.")


def test_a_resumed_journal_holds_what_an_uninterrupted_run_writes(tmp_path, random_target,
                                                                  random_target_model,
                                                                  random_target_tokenizer):
    from draftsmith.generate.transformers_backend import TransformersGenerator

    cfg = SynthesizeConfig(prompts=24, max_prompt_tokens=12)
    writings = plan_writings(cfg)
    start = random_target_tokenizer(user_turn_start(random_target_tokenizer),
                                    add_special_tokens=False)["input_ids"]

    def generator():
        return TransformersGenerator(random_target_model, random_target_tokenizer,
                                     max_new_tokens=12, temperature=1.0, top_p=0.95, seed=0)

    whole = tmp_path / "whole" / "written.jsonl"
    write_prompts(writings, whole, generator(), start, batch_size=8, seed=0)
    cut = tmp_path / "cut" / "written.jsonl"
    write_prompts(writings[:8], cut, generator(), start, batch_size=8, seed=0)  # batch 0 only
    with open(cut, "a") as f:
        f.write('{"index": 8, "text": "torn by a cra')  # the crash, mid-line
    # Rerun with generate.batch_size lowered (after an out-of-memory error, say): the journal
    # goes on in the batch size it was begun with, or the same indices would get other prompts.
    batch_size = synthesize.writing_batch_size(cut, configured=4)
    assert batch_size == 8
    write_prompts(writings, cut, generator(), start, batch_size=batch_size, seed=0)
    assert read_journal(cut) == read_journal(whole) and len(read_journal(whole)) == 24
    texts = [e["text"] for e in read_journal(whole).values()]
    assert len(set(texts)) > 12  # sampled: batches differ


def test_the_generate_stage_writes_then_answers_and_reuses_the_journal(
        tmp_path, tiny_target_cache, monkeypatch):
    """On the demo's trained tiny target, which ends its turns (a random one seldom does)."""
    from draftsmith.data.records import read_records
    from draftsmith.generate.stage import run_generate
    from draftsmith.target import resolve_target

    source = {"name": "self-written", "synthesize": {"prompts": 16, "max_prompt_tokens": 32}}
    data = DataConfig(sources=[source])
    gen = GenerateConfig(max_new_tokens=4, batch_size=8)
    target = TargetConfig(model="builtin:tiny")
    tiny = resolve_target(target)
    out = run_generate(gen, data, target, tiny, plan_stage(tmp_path, "generate", {}, [tiny]))
    stats = json.loads((out.dir / "stats.json").read_text())[0]
    assert stats["read"] == 16 and stats["kept"] + sum(stats["dropped"].values()) == 16
    assert stats["kept"] >= 4
    records = read_records(out)
    assert len(records) == stats["kept"] == out.counts["generated"]
    assert all(r.source == "self-written" and [m.role for m in r.messages] ==
               ["user", "assistant"] for r in records)
    journal = next((tmp_path / "generate" / "prompts").glob("self-written-*/written.jsonl"))
    assert len(read_journal(journal)) == 16

    # A second run (a retry, a new answer setting) writes nothing: the journal has it all.
    def no_writing(*args, **kwargs):
        raise AssertionError("the target wrote prompts the journal already held")

    monkeypatch.setattr(synthesize, "_write_with_target", no_writing)
    again = run_generate(gen.model_copy(update={"max_new_tokens": 5}), data, target, tiny,
                         plan_stage(tmp_path, "generate", {"n": 5}, [tiny]))
    assert [r.messages[0].content for r in read_records(again)] == [
        r.messages[0].content for r in records]


def _written_and_answered(tmp_path):
    """A self-written source on the demo's tiny target, written and answered once: the
    settings and the records."""
    from draftsmith.data.records import read_records
    from draftsmith.generate.stage import run_generate
    from draftsmith.target import resolve_target

    source = {"name": "self-written", "synthesize": {"prompts": 16, "max_prompt_tokens": 32}}
    data = DataConfig(sources=[source])
    target = TargetConfig(model="builtin:tiny")
    tiny = resolve_target(target)
    gen = GenerateConfig(max_new_tokens=4, batch_size=8)
    first = read_records(run_generate(gen, data, target, tiny,
                                      plan_stage(tmp_path, "generate", {"run": 1}, [tiny])))
    return data, target, tiny, gen, first


def _generate_asking_nothing(monkeypatch, tmp_path, gen, data, target, tiny):
    """The records of a rerun that fails if the target is asked to write or answer."""
    from draftsmith.data.records import read_records
    from draftsmith.generate import stage
    from draftsmith.generate.stage import run_generate

    def asked(*args, **kwargs):
        raise AssertionError("the journals held this already")

    monkeypatch.setattr(synthesize, "_write_with_target", asked)
    monkeypatch.setattr(stage, "_answer_with_transformers", asked)
    return read_records(run_generate(gen, data, target, tiny,
                                     plan_stage(tmp_path, "generate", {"run": 2}, [tiny])))


def test_a_smaller_batch_size_after_an_out_of_memory_error_keeps_every_prompt_and_answer(
        tmp_path, tiny_target_cache, monkeypatch):
    """The out-of-memory error tells the user to lower generate.batch_size: what the journals
    hold (written prompts, answers) must survive that, or hours of GPU work are asked again."""
    from draftsmith.generate.stage import run_generate

    data, target, tiny, gen, first = _written_and_answered(tmp_path)
    smaller = gen.model_copy(update={"batch_size": 3, "cache_lengths": "batch"})
    again = _generate_asking_nothing(monkeypatch, tmp_path, smaller, data, target, tiny)
    assert [r.messages for r in again] == [r.messages for r in first]

    # What decides an answer still starts a journal of its own.
    monkeypatch.undo()
    longer = smaller.model_copy(update={"max_new_tokens": 6})
    answers = tmp_path / "generate" / "answers"
    before = {p.name for p in answers.iterdir()}
    run_generate(longer, data, target, tiny, plan_stage(tmp_path, "generate", {"n": 6}, [tiny]))
    assert len({p.name for p in answers.iterdir()} - before) == 1


def test_journals_named_by_an_older_draftsmith_are_taken_over(tmp_path, tiny_target_cache,
                                                               monkeypatch):
    """Journals were named with every generate setting, the batch size among them; after an
    upgrade, a run with the same settings finds them under that name and asks nothing."""
    from draftsmith.artifacts import hash_json
    from draftsmith.config import key_settings

    data, target, tiny, gen, first = _written_and_answered(tmp_path)
    root = tmp_path / "generate"
    [prompts] = (root / "prompts").iterdir()
    [answers] = (root / "answers").iterdir()
    (prompts / synthesize.BATCHES_FILE).unlink()  # older journals had none
    older_prompts = hash_json({"synthesize": key_settings(data.sources[0].synthesize),
                               "batch_size": 8, "dtype": "float32",
                               "target": tiny.fingerprint})[:12]
    older_answers = hash_json({"generate": key_settings(gen), "target": tiny.fingerprint,
                               "target_dtype": "float32"})[:12]
    prompts.rename(root / "prompts" / f"self-written-{older_prompts}")
    answers.rename(root / "answers" / f"self-written-{older_answers}")

    again = _generate_asking_nothing(monkeypatch, tmp_path, gen, data, target, tiny)
    assert [r.messages for r in again] == [r.messages for r in first]
    assert [p.name for p in (root / "prompts").iterdir()] == [prompts.name]
    assert [p.name for p in (root / "answers").iterdir()] == [answers.name]
    assert json.loads((prompts / synthesize.BATCHES_FILE).read_text()) == {"batch_size": 8}
