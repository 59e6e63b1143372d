"""draftsmith.data.merge: dedup (exact and near-exact), truncation counts, per-source stats,
the special-token check, draft-vocab coverage next to the data, and the loss-mask round trip
(decoding the masked tokens of every stored row gives back exactly its assistant turns)."""

from __future__ import annotations

import json
import shutil

import pytest

from draftsmith.artifacts import finish_stage, plan_stage, stage_output
from draftsmith.config import MergeConfig, TargetConfig
from draftsmith.data.formats import Record, load_source
from draftsmith.data.merge import COVERAGE_FILE, read_split, run_merge
from draftsmith.data.tokenize import THINK_CLOSE, THINK_OPEN, TemplateError
from tests.test_formats import FIXTURES
from tests.test_tokenize import END, masked_spans


def generated(tmp_path, records: list[Record]):
    """A finished generate output holding these records (what merge reads)."""
    plan = plan_stage(tmp_path, "generate", {"records": [r.id for r in records]}, [])
    with stage_output(plan) as out:
        (out / "records.jsonl").write_text(
            "".join(r.model_dump_json(exclude_none=True) + "\n" for r in records))
    return finish_stage(plan, counts={"records": len(records)})


def record(source: str, i: int, user: str, answer: str, **assistant) -> Record:
    return Record.model_validate({"id": f"{source}/{i}", "source": source, "messages": [
        {"role": "user", "content": user}, {"role": "assistant", "content": answer,
                                            **assistant}]})


def merge(tmp_path, records, target, **cfg):
    cfg = MergeConfig(**{"max_length": 256, "validation_fraction": 0.3, "draft_vocab_size": 64,
                         **cfg})
    gen = generated(tmp_path, records)
    return run_merge(cfg, gen, target, plan_stage(tmp_path, "merge", cfg, [gen]))


def expected_assistant_texts(tokenizer, rec: Record) -> list[str]:
    from draftsmith.data.tokenize import template_messages

    return [m["content"] + END for m in template_messages(tokenizer, rec)
            if m["role"] == "assistant"]


def test_loss_mask_round_trip_over_every_stored_row(tmp_path, random_target,
                                                    random_target_tokenizer):
    """Multi-turn chats, agent trajectories with tool calls and tool turns, reasoning: every
    row merge writes decodes, on its masked tokens, to exactly its assistant turns."""
    records = []
    for name in ("sharegpt_human_gpt", "openai_messages", "agent_trajectory",
                 "trajectory_null_system"):
        loaded, _ = load_source(name, FIXTURES / f"{name}.jsonl")
        records += [r for r in loaded if not r.needs_answer()]
    records.append(record("r", 0, "2+2?", "4", reasoning="two and two"))
    merged = merge(tmp_path, records, random_target, validation_fraction=0.0, max_length=1024)
    assert merged.counts["truncated"] == 0
    rows = read_split(merged, "train")
    assert len(rows) == len(records) == 9
    by_id = {r.id: r for r in records}
    for row in rows:
        rec = by_id[row["id"]]
        decoded = [random_target_tokenizer.decode(span, skip_special_tokens=False)
                   for span in masked_spans(row["input_ids"], row["loss_mask"])]
        assert decoded == expected_assistant_texts(random_target_tokenizer, rec), row["id"]
    trajectory = next(r for r in rows if r["id"] == "agent_trajectory/tr1")
    decoded = [random_target_tokenizer.decode(span, skip_special_tokens=False)
               for span in masked_spans(trajectory["input_ids"], trajectory["loss_mask"])]
    assert len(decoded) == 4  # every assistant turn of the trajectory is trained on
    assert decoded[0].startswith("\n<tool_call>\n") and "get_weather" in decoded[0]
    assert decoded[1] == f"{THINK_OPEN}The tool said 4 C, rain.{THINK_CLOSE}" \
                         f"It is 4 C and raining in Oslo.{END}"
    unmasked = random_target_tokenizer.decode(
        [t for t, m in zip(trajectory["input_ids"], trajectory["loss_mask"], strict=True)
         if not m])
    assert "rain" in unmasked and "sunny, 7 C" in unmasked  # tool output: context only


def test_exact_and_near_exact_duplicates_are_counted_per_source(tmp_path, random_target):
    records = [
        record("a", 0, "What is a list?", "An ordered collection."),
        record("a", 1, "What is a list?", "An ordered collection."),  # exact copy
        record("b", 0, "what is a  list", "An ordered collection"),  # near: case, space, "?"
        record("b", 1, "What is a tuple?", "An immutable sequence."),
    ]
    merged = merge(tmp_path, records, random_target)
    stats = json.loads((merged.dir / "stats.json").read_text())
    assert stats["a"]["exact_duplicates"] == 1 and "near_duplicates" not in stats["a"]
    assert stats["b"]["near_duplicates"] == 1
    assert (stats["a"]["read"], stats["a"]["records"]) == (2, 1)
    assert (stats["b"]["read"], stats["b"]["records"]) == (2, 1)
    assert merged.counts["exact_duplicates"] == 1 and merged.counts["near_duplicates"] == 1

    kept_near = merge(tmp_path / "no-near", records, random_target, near_dedup=False)
    assert kept_near.counts["near_duplicates"] == 0
    assert kept_near.counts["train_records"] + kept_near.counts["validation_records"] == 3


def test_per_source_stats_truncation_and_coverage_file(tmp_path, random_target):
    long_answer = "def f(x):\n    return x\n" * 40
    records = [record("short", i, f"q{i}", f"answer {i}") for i in range(6)]
    records += [record("long", i, f"long q{i}", long_answer + str(i)) for i in range(3)]
    merged = merge(tmp_path, records, random_target, max_length=64)
    stats = json.loads((merged.dir / "stats.json").read_text())
    assert stats["long"]["truncated"] == 3 and "truncated" not in stats["short"]
    assert merged.counts["truncated"] == 3
    for name, n in (("short", 6), ("long", 3)):
        s = stats[name]
        assert s["records"] == s.get("train_records", 0) + s.get("validation_records", 0) == n
        assert s["mean_length"] == pytest.approx(s["tokens"] / n, abs=0.1)
        assert 0 < s["masked_tokens"] < s["tokens"]
        assert 0.0 < s["draft_vocab_coverage"] <= 1.0
    assert stats["long"]["mean_length"] == 64.0
    coverage = json.loads((merged.dir / COVERAGE_FILE).read_text())
    assert coverage["draft_vocab_size"] == 64
    assert coverage["coverage_train"] == pytest.approx(merged.figures["draft_vocab_coverage"],
                                                       abs=1e-4)
    assert coverage["train_masked_tokens"] == merged.counts["train_masked_tokens"]
    assert set(coverage["coverage_per_source"]) == {"short", "long"}
    assert merged.counts["validation_tokens"] == sum(
        len(r["input_ids"]) for r in read_split(merged, "validation"))
    assert merged.figures["end_of_turn_token"] == "<|im_end|>"


def test_full_draft_vocab_covers_every_masked_token(tmp_path, random_target):
    records = [record("s", i, f"q{i}", f"answer number {i}") for i in range(5)]
    merged = merge(tmp_path, records, random_target, validation_fraction=0.0,
                   draft_vocab_size=random_target.figures["vocab_size"])
    assert json.loads((merged.dir / COVERAGE_FILE).read_text())["coverage_train"] == 1.0


@pytest.fixture()
def mismatched_target(random_target_dir, tmp_path):
    """The random target with a template written for another tokenizer: it ends turns with
    <|eot_id|>, which this tokenizer does not have."""
    from draftsmith.target import resolve_target

    copy = tmp_path / "mismatched"
    shutil.copytree(random_target_dir, copy)
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").write_text(template.replace("<|im_end|>", "<|eot_id|>"))
    return resolve_target(TargetConfig(model=str(copy)))


def test_template_and_tokenizer_that_disagree_on_end_of_turn_fail_clearly(
        tmp_path, mismatched_target):
    records = [record("s", i, f"q{i}", f"a{i}") for i in range(3)]
    with pytest.raises(TemplateError) as info:
        merge(tmp_path, records, mismatched_target)
    message = str(info.value)
    assert "'<'" in message and "not report as a special token" in message
    assert "<|im_end|>" in message  # lists the tokenizer's real special tokens


def test_special_token_check_reports_the_end_of_turn_and_stop_ids(random_target,
                                                                  random_target_tokenizer):
    from draftsmith.data.tokenize import check_special_tokens

    report = check_special_tokens(random_target_tokenizer, random_target.path)
    end_id = random_target_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert report == {"end_of_turn_id": end_id, "end_of_turn_token": "<|im_end|>",
                      "generation_stop_ids": [end_id], "stops_generation": True}
