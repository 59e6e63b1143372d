"""draftsmith.generate.journal: a line torn by a crash is dropped and cut off, and the hosts of
a spread generate append to their own files and read each other's."""

from __future__ import annotations

import json

from draftsmith.generate.journal import Answer, Journal


def answer(i: int) -> Answer:
    return Answer(key=f"k{i}", record_id=f"r/{i}", content=f"a{i}", reasoning=None,
                  prompt_tokens=3, completion_tokens=2, finish_reason="stop")


def test_journal_drops_a_line_torn_by_a_crash_and_appends_after_it(tmp_path):
    journal = Journal(tmp_path / "j")
    for i in range(3):
        journal.add_answer(answer(i))
    with open(journal.answers_path, "a") as f:
        f.write('{"key": "k3", "record_id": "r/3", "cont')  # killed mid-write
    assert list(journal.answers()) == ["k0", "k1", "k2"]
    journal.add_answer(answer(3))  # the next attempt appends to a clean file
    assert list(Journal(tmp_path / "j").answers()) == ["k0", "k1", "k2", "k3"]
    lines = journal.answers_path.read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["k0", "k1", "k2", "k3"]


def test_hosts_append_to_their_own_journal_files_and_read_each_others(tmp_path):
    """Generate spread over hosts: each writer appends to answers.<writer>.jsonl only; every
    reader sees all answers. A torn line in another host's file is not cut (that host may be
    writing it), only skipped."""
    a, b = Journal(tmp_path / "j", writer="run-0"), Journal(tmp_path / "j", writer="run-1")
    a.add_answer(answer(0))
    b.add_answer(answer(1))
    with open(b.answers_path, "a") as f:
        f.write('{"key": "k2", "rec')  # host b mid-write
    size = b.answers_path.stat().st_size
    assert sorted(a.answers()) == ["k0", "k1"]
    assert b.answers_path.stat().st_size == size  # a does not cut b's file
    assert sorted(Journal(tmp_path / "j").answers()) == ["k0", "k1"]  # one host's reader too
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == [
        "answers.run-0.jsonl", "answers.run-1.jsonl"]
    b.answers()  # b's own file: its torn line is cut
    assert b.answers_path.stat().st_size < size
