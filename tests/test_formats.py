"""draftsmith.data.formats: every source format becomes the common record; nothing silently lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.data.formats import DataFormatError, Record, detect_format, load_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def roles(record: Record) -> list[str]:
    return [m.role for m in record.messages]


# --- formats and roles -------------------------------------------------------------------------


def test_sharegpt_roles_map_to_common_roles(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [
        {"id": "a", "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Bye"},
            {"from": "gpt", "value": "Bye!"},
        ]},
        {"id": "b", "conversations": [
            {"from": "user", "value": "Q"},
            {"from": "assistant", "value": "A"},
        ]},
        {"id": "c", "conversations": [{"from": "Human", "value": "Q"},
                                      {"from": "GPT", "value": "A"}]},
    ])
    records, stats = load_source("sg", path)
    assert [roles(r) for r in records] == [
        ["system", "user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant"],
    ]
    assert [m.content for m in records[0].messages] == ["Be brief.", "Hi", "Hello", "Bye", "Bye!"]
    assert (stats.read, stats.kept, stats.dropped) == (3, 3, {})
    assert not records[0].needs_answer()


def test_openai_messages(tmp_path):
    path = write_jsonl(tmp_path / "oa.jsonl", [
        {"id": "x", "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
            {"role": "tool", "content": "T"},
            {"role": "user", "content": "U2"},
        ]},
    ])
    (record,), _ = load_source("oa", path, fmt="openai")
    assert roles(record) == ["system", "user", "assistant", "tool", "user"]
    assert [m.content for m in record.messages] == ["S", "U", "A", "T", "U2"]
    assert record.needs_answer()


def test_json_array_file(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}]))
    (record,), stats = load_source("arr", path)
    assert roles(record) == ["user"] and stats.kept == 1


def test_null_system_turn_is_skipped_and_record_kept(tmp_path):
    path = write_jsonl(tmp_path / "traj.jsonl", [
        {"id": "t1", "messages": [
            {"role": "system", "content": None},
            {"role": "user", "content": "Do it"},
            {"role": "assistant", "content": "Done"},
        ]},
        {"id": "t2", "conversations": [
            {"from": "system", "value": None},
            {"from": "human", "value": "Q"},
        ]},
    ])
    records, stats = load_source("traj", path)
    assert [roles(r) for r in records] == [["user", "assistant"], ["user"]]
    assert (stats.kept, stats.dropped) == (2, {})


def test_reasoning_content_is_captured(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [
        {"messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
        ]},
        {"messages": [
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6", "reasoning": "three plus three"},
        ]},
    ])
    records, _ = load_source("r", path)
    assert [r.messages[-1].reasoning for r in records] == ["two plus two", "three plus three"]
    assert records[0].messages[0].reasoning is None


# --- errors ------------------------------------------------------------------------------------


def test_unknown_shape_names_the_keys(tmp_path):
    with pytest.raises(DataFormatError) as err:
        detect_format({"prompt": "p", "response": "r"})
    assert "keys: prompt, response" in str(err.value)
    assert "'conversations'" in str(err.value) and "'messages'" in str(err.value)

    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "i", "output": "o"}])
    with pytest.raises(DataFormatError) as err:
        load_source("alpaca", path)
    message = str(err.value)
    assert "keys: instruction, output" in message
    assert "'alpaca'" in message  # which of many sources is broken
    assert f"{path}:1" in message


def test_every_record_bad_names_source_and_first_record(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "r1", "conversations": [{"from": "narrator", "value": "Once"}]},
        {"id": "r2", "conversations": [{"from": "gpt", "value": "no question"}]},
    ])
    with pytest.raises(DataFormatError) as err:
        load_source("broken-src", path)
    message = str(err.value)
    assert "'broken-src'" in message
    assert "kept 0 of 2 records" in message
    assert f"{path}:1" in message
    assert "unknown role 'narrator'" in message
    assert '"id": "r1"' in message  # the offending record itself


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataFormatError, match=r"'empty'.*kept 0 of 0.*empty"):
        load_source("empty", path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_source("gone", tmp_path / "gone.jsonl")


def test_invalid_json_line_names_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{not json\n')
    with pytest.raises(DataFormatError, match=rf"{path}:2: not valid JSON"):
        load_source("x", path)


def test_stats_count_read_kept_dropped_with_reasons(tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        good,
        {"messages": [{"role": "assistant", "content": "a"}]},  # no user turn
        {"messages": [{"role": "wizard", "content": "x"}]},  # unknown role
        {"messages": [{"role": "user", "content": None}]},  # null user text
        {"messages": []},  # no turns
        {"messages": [{"role": "system", "content": None}]},  # only a null system turn
        {"messages": [{"role": "assistant", "content": "b"}]},  # no user turn again
        good,
    ])
    records, stats = load_source("mixed", path)
    assert stats.source == "mixed"
    assert (stats.read, stats.kept) == (8, 2) and len(records) == 2
    assert stats.dropped == {
        "no user turn": 2,
        "unknown role 'wizard'": 1,
        "user turn has content=None, expected text": 1,
        "no turns": 2,
    }
    assert stats.read == stats.kept + sum(stats.dropped.values())


def test_explicit_format_mismatch_is_dropped_with_a_reason(tmp_path):
    path = write_jsonl(tmp_path / "oa.jsonl", [
        {"messages": [{"role": "user", "content": "q"}]},
        {"conversations": [{"from": "human", "value": "q"}]},
    ])
    records, stats = load_source("oa", path, fmt="openai")
    assert len(records) == 1
    assert (stats.read, stats.kept, sum(stats.dropped.values())) == (2, 1, 1)
    assert any("messages" in reason for reason in stats.dropped)


# --- ids and limits ----------------------------------------------------------------------------


def test_ids_are_prefixed_by_source_name(tmp_path):
    turns = [{"role": "user", "content": "same"}]
    path = write_jsonl(tmp_path / "ids.jsonl", [
        {"id": "given", "messages": turns},
        {"id": 7, "messages": turns},
        {"messages": turns},
        {"messages": [{"role": "user", "content": "other"}]},
    ])
    records, _ = load_source("src", path)
    assert [r.source for r in records] == ["src"] * 4
    assert records[0].id == "src/given"
    assert records[1].id == "src/7"
    assert all(r.id.startswith("src/") for r in records)
    # Records without an id get one from their content: stable and distinct.
    assert records[2].id != records[3].id
    again, _ = load_source("src", path)
    assert [r.id for r in again] == [r.id for r in records]
    other, _ = load_source("other", path)
    assert other[2].id == "other/" + records[2].id.removeprefix("src/")


def test_limit_is_respected(tmp_path):
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(10)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    records, stats = load_source("many", path, limit=3)
    assert [r.id for r in records] == ["many/0", "many/1", "many/2"]
    assert (stats.read, stats.kept) == (3, 3)
    records, stats = load_source("many", path, limit=50)
    assert (len(records), stats.read) == (10, 10)


def test_bundled_demo_data():
    sharegpt, sg_stats = load_source("stdlib-sharegpt", EXAMPLES / "sharegpt.jsonl", "sharegpt")
    openai, oa_stats = load_source("stdlib-openai", EXAMPLES / "openai.jsonl", "openai")
    assert (sg_stats.read, sg_stats.kept, sg_stats.dropped) == (150, 150, {})
    assert (oa_stats.read, oa_stats.kept, oa_stats.dropped) == (150, 150, {})
    assert all(roles(r) == ["system", "user"] for r in sharegpt)
    assert all(roles(r) == ["user"] for r in openai)
    assert sharegpt[0].id == "stdlib-sharegpt/sg-0000"
    assert all(r.needs_answer() for r in sharegpt + openai)


def _mixed_source(tmp_path, good: int, bad: int):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(good)]
    rows += [{"messages": [{"role": "wizard", "content": "x"}]} for _ in range(bad)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_a_drop_rate_above_the_threshold_fails_naming_source_reason_and_record(tmp_path):
    path = _mixed_source(tmp_path, good=90, bad=10)
    with pytest.raises(DataFormatError) as info:
        load_source("agents", path, max_drop_rate=0.05)
    message = str(info.value)
    assert "'agents'" in message and "10 of 100" in message and "10.0%" in message
    assert "unknown role 'wizard'" in message and '"wizard"' in message  # the record itself
    assert "data.max_drop_rate" in message


def test_a_drop_rate_within_the_threshold_keeps_the_source_and_counts_the_drops(tmp_path):
    records, stats = load_source("agents", _mixed_source(tmp_path, good=96, bad=4),
                                 max_drop_rate=0.05)
    assert len(records) == 96 and stats.dropped == {"unknown role 'wizard'": 4}


def test_prompt_only_records_become_a_user_turn_awaiting_an_answer(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "p1", "prompt": "Write a haiku."}) + "\n"
                    + json.dumps({"prompt": "   "}) + "\n")
    records, stats = load_source("prompts", path, max_drop_rate=0.5)
    assert len(records) == 1 and records[0].id == "prompts/p1"
    assert [(m.role, m.content) for m in records[0].messages] == [("user", "Write a haiku.")]
    assert records[0].needs_answer()
    assert stats.dropped == {"prompt='   ', expected non-empty text": 1}
    assert detect_format({"prompt": "x"}) == "prompt"


# --- fixture files: one per format, including the three shapes the seeds lost ----------------

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"


def test_fixture_sharegpt_with_human_and_gpt_speakers():
    records, stats = load_source("sg", FIXTURES / "sharegpt_human_gpt.jsonl")
    assert (stats.read, stats.kept, stats.dropped) == (3, 3, {})
    assert [roles(r) for r in records] == [
        ["system", "user", "assistant", "user", "assistant"], ["user", "assistant"], ["user"]]
    assert records[2].needs_answer() and not records[0].needs_answer()


def test_fixture_openai_messages_with_text_parts():
    records, _ = load_source("oa", FIXTURES / "openai_messages.jsonl")
    assert records[1].messages[0].content == "Part one. Part two."
    assert roles(records[0]) == ["system", "user", "assistant"]


def test_fixture_agent_trajectories_keep_every_assistant_turn_and_tool_turns():
    records, stats = load_source("agent", FIXTURES / "agent_trajectory.jsonl")
    assert (stats.read, stats.kept, stats.dropped) == (2, 2, {})
    openai_style, sharegpt_style = records
    assert roles(openai_style) == ["system", "user", "assistant", "tool", "assistant", "user",
                                   "assistant", "tool", "assistant"]
    call_only = openai_style.messages[2]
    assert call_only.content == "" and call_only.tool_calls[0]["function"]["name"] == "get_weather"
    tool = openai_style.messages[3]
    assert json.loads(tool.content) == {"temp_c": 4, "sky": "rain"}  # structured output as JSON
    assert (tool.tool_call_id, tool.name) == ("call_1", "get_weather")
    assert openai_style.messages[4].reasoning == "The tool said 4 C, rain."
    assert openai_style.messages[6].content == "Let me check."
    assert openai_style.messages[6].tool_calls[0]["id"] == "call_2"
    # ShareGPT agent speakers under a "trajectory" key: the call is the target's own turn.
    assert roles(sharegpt_style) == ["user", "assistant", "tool", "assistant"]
    assert sharegpt_style.messages[1].content.startswith('{"name": "ls"')


def test_fixture_trajectory_with_a_null_system_turn_is_kept_and_noted():
    records, stats = load_source("traj", FIXTURES / "trajectory_null_system.jsonl")
    assert (stats.read, stats.kept, stats.dropped) == (2, 2, {})
    assert stats.notes == {"null system turn left out": 2}
    assert roles(records[0]) == ["user", "assistant", "tool", "assistant"]
    assert roles(records[1]) == ["user", "assistant"]


def test_fixture_prompt_only_needs_answers():
    records, _ = load_source("po", FIXTURES / "prompt_only.jsonl")
    assert all(r.needs_answer() and roles(r) == ["user"] for r in records)


def test_fixture_unknown_shape_fails_showing_the_record():
    path = FIXTURES / "unknown_shape.jsonl"
    with pytest.raises(DataFormatError) as info:
        load_source("alpaca", path)
    message = str(info.value)
    assert f"'alpaca' ({path}:1)" in message
    assert "keys: id, input, instruction, output" in message
    assert '"instruction": "Translate to French"' in message  # the offending record itself
    assert "data.sources[].format" in message


def test_explicit_trajectory_format_reads_openai_and_sharegpt_turns():
    records, _ = load_source("t", FIXTURES / "agent_trajectory.jsonl", fmt="trajectory")
    assert len(records) == 2
    records, _ = load_source("t", FIXTURES / "sharegpt_human_gpt.jsonl", fmt="trajectory")
    assert roles(records[1]) == ["user", "assistant"]


def test_non_text_content_parts_are_dropped_with_a_reason(tmp_path):
    path = write_jsonl(tmp_path / "img.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"messages": [{"role": "user", "content": "ok"}]},
    ])
    _, stats = load_source("img", path, max_drop_rate=0.5)
    assert stats.dropped == {"user turn has non-text content parts ['image_url']": 1}


def test_ids_without_tool_fields_are_unchanged_by_the_agent_fields():
    """Records without an id get one from their content; adding tool fields to the record
    format must not move existing records between splits."""
    from draftsmith.artifacts import hash_json
    from draftsmith.data.formats import to_record

    record = to_record({"messages": [{"role": "user", "content": "q"}]}, "openai", "s")
    legacy = hash_json([{"role": "user", "content": "q", "reasoning": None}])[:16]
    assert record.id == f"s/{legacy}"


# --- Parquet and Hugging Face datasets --------------------------------------------------------


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


PARQUET_ROWS = [
    {"id": "a", "messages": [{"role": "system", "content": None},
                             {"role": "user", "content": "q1"},
                             {"role": "assistant", "content": "a1"}]},
    {"id": "b", "messages": [{"role": "user", "content": "q2"}]},
]


def test_parquet_file_through_datasets(tmp_path):
    path = _parquet(tmp_path / "train.parquet", PARQUET_ROWS)
    records, stats = load_source("pq", path)
    assert [r.id for r in records] == ["pq/a", "pq/b"]
    assert roles(records[0]) == ["user", "assistant"]  # Arrow's null system text: left out
    assert stats.notes == {"null system turn left out": 1}


def test_hugging_face_dataset_directory(tmp_path):
    """A dataset repository laid out as on the hub (data/<split>-*.parquet), read by name
    through datasets.load_dataset, offline."""
    repo = tmp_path / "my-dataset"
    _parquet(repo / "data" / "train-00000-of-00001.parquet", PARQUET_ROWS)
    _parquet(repo / "data" / "test-00000-of-00001.parquet", PARQUET_ROWS[1:])
    records, stats = load_source("hub", hub=str(repo), split="test")
    assert [r.id for r in records] == ["hub/b"] and stats.read == 1
    records, _ = load_source("hub", hub=str(repo))
    assert len(records) == 2


def test_hub_dataset_that_cannot_be_loaded_names_it(tmp_path):
    with pytest.raises(DataFormatError, match=r"hub dataset 'nobody/no-such-dataset'.*access"):
        load_source("hub", hub="nobody/no-such-dataset")


def test_a_source_names_path_or_hub_not_both():
    from draftsmith.config import DataSource

    with pytest.raises(ValueError, match="exactly one of path"):
        DataSource(name="x", path="a.jsonl", hub="owner/name")
    with pytest.raises(ValueError, match="exactly one of path"):
        DataSource(name="x")


# --- turn spellings of agent trajectories ------------------------------------------------------


CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}


@pytest.mark.parametrize("speaker", ["role", "from"])
@pytest.mark.parametrize("text_key", ["text", "content", "value", "parts"])
@pytest.mark.parametrize("list_key", ["trajectory", "messages", "conversations", "turns"])
def test_trajectory_turns_keyed_by_any_text_key_under_either_speaker_spelling(
        tmp_path, speaker, text_key, list_key):
    """{"role", "text"} turns were all dropped ("kept 0 of 20"): the adapter took `content`
    whenever the speaker key was `role`."""
    def turn(who: str, text: str) -> dict:
        value = [{"text": text}] if text_key == "parts" else text
        return {speaker: who, text_key: value}

    path = write_jsonl(tmp_path / "t.jsonl", [{"id": "a", list_key: [
        turn("system", "Be brief."), turn("user", "Weather in Oslo?"),
        turn("assistant", "Rain, 4 C."), turn("user", "Tomorrow?"), turn("assistant", "Sun.")]}])
    records, stats = load_source("t", path)
    assert (stats.read, stats.kept, stats.dropped) == (1, 1, {})
    assert [(m.role, m.content) for m in records[0].messages] == [
        ("system", "Be brief."), ("user", "Weather in Oslo?"), ("assistant", "Rain, 4 C."),
        ("user", "Tomorrow?"), ("assistant", "Sun.")]


def test_explicit_trajectory_format_reads_text_keyed_turns(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"messages": [{"role": "user", "text": "q"}, {"role": "assistant", "text": "a"}]}])
    (record,), _ = load_source("t", path, fmt="trajectory")
    assert [m.content for m in record.messages] == ["q", "a"]


def test_gemini_parts_with_calls_and_responses(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"turns": [
        {"role": "user", "parts": [{"text": "Weather in "}, {"text": "Oslo?"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "get_weather",
                                                      "args": {"city": "Oslo"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "get_weather",
                                                         "response": {"temp_c": 4}}}]},
        {"role": "model", "parts": ["It is 4 C."]},
    ]}])
    (record,), _ = load_source("g", path)
    assert roles(record) == ["user", "assistant", "tool", "assistant"]
    assert record.messages[0].content == "Weather in Oslo?"
    call = record.messages[1]
    assert call.content == "" and call.tool_calls == [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": "{\"city\": \"Oslo\"}"}}]
    tool = record.messages[2]
    assert (json.loads(tool.content), tool.name) == ({"temp_c": 4}, "get_weather")
    assert record.messages[3].content == "It is 4 C."


def test_parts_that_are_not_text_are_dropped_with_a_reason(tmp_path):
    path = write_jsonl(tmp_path / "img.jsonl", [
        {"turns": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png"}}]}]},
        {"turns": [{"role": "user", "parts": [{"text": "ok"}]}]},
    ])
    _, stats = load_source("img", path, max_drop_rate=0.5)
    assert stats.dropped == {"user turn has non-text parts ['inlineData']": 1}


# --- hidden-style cases under every spelling ---------------------------------------------------


@pytest.mark.parametrize(("speaker", "text_key"), [("role", "content"), ("role", "text"),
                                                   ("from", "value"), ("from", "text")])
def test_null_system_text_structured_tool_output_and_call_only_turns(tmp_path, speaker,
                                                                    text_key):
    path = write_jsonl(tmp_path / "h.jsonl", [{"id": "h", "trajectory": [
        {speaker: "system", text_key: None},
        {speaker: "user", text_key: "Weather in Oslo?"},
        {speaker: "assistant", text_key: None, "tool_calls": [CALL]},  # only calls, null text
        {speaker: "tool", "tool_call_id": "c1", "name": "get_weather",
         text_key: {"temp_c": 4, "sky": "rain"}},
        {speaker: "assistant", "tool_calls": [CALL]},  # only calls, no text key at all
        {speaker: "tool", "tool_call_id": "c1", text_key: [{"temp_c": 4}, {"temp_c": 7}]},
        {speaker: "tool", "tool_call_id": "c1", text_key: 4},
        {speaker: "assistant", text_key: "4 C and rain."},
    ]}])
    (record,), stats = load_source("h", path)
    assert (stats.kept, stats.dropped) == (1, {})
    assert stats.notes == {"null system turn left out": 1}
    assert roles(record) == ["user", "assistant", "tool", "assistant", "tool", "tool",
                             "assistant"]
    first_call, weather, second_call, listed, number, answer = record.messages[1:]
    assert first_call.content == "" and first_call.tool_calls == [CALL]
    assert second_call.content == "" and second_call.tool_calls == [CALL]
    assert json.loads(weather.content) == {"temp_c": 4, "sky": "rain"}
    assert (weather.tool_call_id, weather.name) == ("c1", "get_weather")
    # A list of result objects is structured output, not text parts to be flattened to "".
    assert json.loads(listed.content) == [{"temp_c": 4}, {"temp_c": 7}]
    assert number.content == "4" and answer.content == "4 C and rain."


def test_a_tool_turn_with_null_output_is_kept_as_empty_and_noted(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"trajectory": [
        {"role": "user", "content": "Delete tmp."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": None},
        {"role": "assistant", "content": "Done."}]}])
    (record,), stats = load_source("n", path)
    assert roles(record) == ["user", "assistant", "tool", "assistant"]
    assert record.messages[2].content == ""
    assert stats.notes == {"null tool output kept as empty text": 1}


def test_arrow_turns_with_every_text_column_take_the_one_that_is_set(tmp_path):
    """Parquet gives each turn struct every key any turn had, None where it had none."""
    path = _parquet(tmp_path / "mixed.parquet", [{"id": "m", "trajectory": [
        {"role": "user", "content": None, "text": "q", "value": None},
        {"role": "assistant", "content": "a", "text": None, "value": None}]}])
    (record,), _ = load_source("m", path)
    assert [(m.role, m.content) for m in record.messages] == [("user", "q"), ("assistant", "a")]
