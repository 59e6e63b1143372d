"""Decontamination against the evaluation suite: what each check sees, and what merge does."""

from __future__ import annotations

import json

import pytest

from draftsmith.artifacts import plan_stage
from draftsmith.config import MergeConfig
from draftsmith.data.evalsets import load_eval_set
from draftsmith.data.formats import Message, Record
from draftsmith.data.overlap import (
    OverlapError,
    decontaminate,
    defined_names,
    normalized_name,
)
from draftsmith.data.packaged import completion_prompt, humaneval_problems, python_function_prompts


def record(rid: str, prompt: str, answer: str = "Sure, here it is.", source: str = "s") -> Record:
    return Record(id=rid, source=source, messages=[Message(role="user", content=prompt),
                                                   Message(role="assistant", content=answer)])


@pytest.fixture(scope="module")
def suite():
    return {name: load_eval_set(name) for name in ("chat", "code", "math")}


def test_names_are_compared_after_folding_case_underscores_and_camel_case():
    assert {normalized_name(n) for n in ("has_close_elements", "hasCloseElements",
                                         "HasCloseElements", "HAS_CLOSE_ELEMENTS")} == {
        "hascloseelements"}
    assert defined_names("x = 1\ndef hasCloseElements(a):\n  pass\nasync def _go():") == {
        "hascloseelements", "go"}


def test_each_check_and_the_records_it_leaves_alone(suite):
    he = humaneval_problems()
    chat_prompt = load_eval_set("chat")[1].text
    words = chat_prompt.split()
    records = [
        record("exact", chat_prompt.upper() + "  "),  # case and spacing folded
        # a paraphrase that keeps a 13-token run of the evaluation prompt
        record("prompt-run", "Please, " + " ".join(words) + " Thanks a lot!"),
        # an answer that writes HumanEval/0's canonical solution
        record("answer-run", "Write a function that finds close numbers.",
               "```python\n" + he[0]["prompt"] + he[0]["canonical_solution"] + "```"),
        # a function named like an entry point, in another spelling
        record("name", "Write a function.", "def hasCloseElements(xs, t):\n    return False"),
        record("clean", "What is a good name for a cat?", "Whiskers is a classic name."),
        # a list of numbers, as many answers and HumanEval's examples write one, is no copy
        record("numbers", "Sum a list.", "sum_list([1, 2, 3, 4, 5, 6, 7]) == 28 and "
               "print([1, 2, 3, 4, 5])"),
    ]
    kept, reports = decontaminate(records, suite)
    assert [r.id for r in kept] == ["clean", "numbers"]
    by_set = {r["set"]: r for r in reports}
    assert by_set["chat"]["prompt_exact"] == 1 and by_set["chat"]["prompt_ngram"] == 2
    code = by_set["code"]
    assert code["answer_ngram"] == 1 and code["entry_point_name"] == 2
    assert code["records_flagged"] == 2 and code["eval_prompts"] == 164
    example = {e["record"]: e["matches"] for e in code["examples"]}
    assert example["name"] == {"entry_point_name": "HumanEval-0"}
    assert by_set["math"]["records_flagged"] == 0 and by_set["math"]["ngram"] == 13


def test_prompts_asked_like_humaneval_are_not_flagged_for_the_shared_instruction(suite):
    """python-functions prompts share HumanEval's instruction (13-grams in every HumanEval
    prompt): the set's template says nothing about one prompt."""
    records = [record(i, p) for i, p in python_function_prompts(200)]
    kept, reports = decontaminate(records, {"code": suite["code"]})
    # Only a function of an entry point's name is flagged (`base64.encode`, HumanEval/93's
    # `encode`); its 13-grams shared with that prompt run into the name.
    flagged = {e["record"]: e["matches"] for e in reports[0]["examples"]}
    assert all("entry_point_name" in m for m in flagged.values())
    assert reports[0]["records_flagged"] == reports[0]["entry_point_name"] == 200 - len(kept)
    assert len(kept) >= 190


def test_fail_names_the_records(suite):
    problem = humaneval_problems()[3]
    records = [record("copy", completion_prompt(problem["prompt"]))]
    with pytest.raises(OverlapError, match=r"1 of 1 training records.*copy \(prompt_exact"):
        decontaminate(records, suite, action="fail")


def test_merge_drops_and_reports_per_set(tmp_path, random_target, suite):
    from draftsmith.artifacts import Descriptor, finish_stage, stage_output
    from draftsmith.data.merge import DECONTAMINATION_FILE, run_merge

    chat = load_eval_set("chat")[0].text
    records = [record("a", chat, "It happens when light bends.", source="mine"),
               record("b", "Tell me about the moon.", "The moon orbits the Earth.",
                      source="mine"),
               record("c", "What is rain?", "Water falling from clouds.", source="other")]
    generate = plan_stage(tmp_path, "generate", {}, [random_target])
    with stage_output(generate) as out:
        (out / "records.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in records))
    generated: Descriptor = finish_stage(generate, counts={"records": 3})
    merged = run_merge(MergeConfig(max_length=64, validation_fraction=0.0, draft_vocab_size=64),
                       generated, random_target, plan_stage(tmp_path, "merge", {}, [generated]),
                       eval_sets=suite)
    assert merged.counts["train_records"] == 2 and merged.counts["decontaminated"] == 1
    stats = json.loads((merged.dir / "stats.json").read_text())
    assert stats["mine"]["decontaminated"] == 1 and "decontaminated" not in stats["other"]
    report = json.loads((merged.dir / DECONTAMINATION_FILE).read_text())
    assert [r["set"] for r in report] == ["chat", "code", "math"]
    assert report[0]["records_flagged"] == 1 and report[0]["examples"][0]["record"] == "a"
    assert merged.figures["decontamination"][0] == {
        "set": "chat", "eval_prompts": 120, "records_flagged": 1, "prompt_exact": 1,
        "prompt_ngram": 1, "answer_ngram": 0, "entry_point_name": 0}
