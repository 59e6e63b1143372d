"""draftsmith.data.tokenize: the loss mask covers exactly the assistant turns (and their end)."""

from __future__ import annotations

import copy

import pytest

from draftsmith.data.formats import Message, Record
from draftsmith.data.tokenize import tokenize_record

END = "<|im_end|>"

CONVERSATIONS = [
    # (roles and texts); assistant texts start with a non-space so no token straddles the header.
    [("system", "You write Python."), ("user", "Complete def f(x):"),
     ("assistant", "return x + 1"), ("user", "And g?"),
     ("assistant", "def g(y):\n    return y * 2\n")],
    [("user", "Hi"), ("assistant", "Hello there."), ("user", "Bye"), ("assistant", "Bye!"),
     ("user", "One more?")],
    [("user", "Only a question")],
    [("user", "q"), ("assistant", "x"), ("tool", "result: 3"), ("assistant", "It is 3.")],
]


def make_record(turns, index: int = 0) -> Record:
    return Record(id=f"t/{index}", source="t",
                  messages=[Message(role=role, content=text) for role, text in turns])


def masked_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


@pytest.fixture(scope="module")
def plain_tokenizer(random_target_tokenizer):
    """The same tokenizer with the {% generation %} markers taken out: the fallback path."""
    tokenizer = copy.deepcopy(random_target_tokenizer)
    template = tokenizer.chat_template
    assert "{% generation %}" in template and "{% endgeneration %}" in template
    tokenizer.chat_template = template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    return tokenizer


def check_mask(tokenizer, turns, index):
    record = make_record(turns, index)
    ids, mask = tokenize_record(tokenizer, record)
    assert len(ids) == len(mask)
    assert set(mask) <= {0, 1}
    # The ids are exactly the chat-template rendering of the conversation.
    rendered = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in turns],
                                             tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(rendered)
    decoded = [tokenizer.decode(span, skip_special_tokens=False)
               for span in masked_spans(ids, mask)]
    assert decoded == [text + END for role, text in turns if role == "assistant"]
    return ids, mask


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_generation_tag_mask_is_assistant_text_and_end_token(random_target_tokenizer, index):
    assert "{% generation %}" in random_target_tokenizer.chat_template
    check_mask(random_target_tokenizer, CONVERSATIONS[index], index)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_fallback_path_gives_the_same_mask(random_target_tokenizer, plain_tokenizer, index):
    turns = CONVERSATIONS[index]
    with_tags = check_mask(random_target_tokenizer, turns, index)
    without_tags = check_mask(plain_tokenizer, turns, index)
    assert without_tags == with_tags


def test_mask_is_not_just_the_tail(random_target_tokenizer):
    """Multi-turn: the first assistant turn is masked too, and user text never is."""
    turns = CONVERSATIONS[0]
    ids, mask = tokenize_record(random_target_tokenizer, make_record(turns))
    end_id = random_target_tokenizer.convert_tokens_to_ids(END)
    masked_ends = [i for i, (t, m) in enumerate(zip(ids, mask, strict=True)) if m and t == end_id]
    all_ends = [i for i, t in enumerate(ids) if t == end_id]
    assert len(all_ends) == 5 and masked_ends == [all_ends[2], all_ends[4]]
    unmasked = random_target_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "Complete def f(x):" in unmasked and "return x + 1" not in unmasked


def test_fallback_refuses_a_template_that_rewrites_earlier_turns(plain_tokenizer):
    from draftsmith.data.tokenize import TemplateError

    tokenizer = copy.deepcopy(plain_tokenizer)
    # Marks the last message, so a prefix of the conversation renders differently.
    tokenizer.chat_template = (
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if loop.last %}LAST {% endif -%}{{ m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    record = make_record([("user", "q"), ("assistant", "a"), ("user", "q2")], 9)
    with pytest.raises(TemplateError, match=r"record t/9: .*turn 1.*\{% generation %\}"):
        tokenize_record(tokenizer, record)


def test_a_pool_of_workers_gives_the_rows_of_one_process(plain_tokenizer):
    """The merge stage tokenises large sets over worker processes: same rows, same order, and
    a template error raised in a worker still names the record."""
    from draftsmith.data.tokenize import TemplateError, tokenize_records

    records = [make_record(turns, i) for i, turns in enumerate(CONVERSATIONS * 3)]
    in_process = tokenize_records(plain_tokenizer, records, workers=0)
    assert in_process == [tokenize_record(plain_tokenizer, r) for r in records]
    assert tokenize_records(plain_tokenizer, records, workers=2) == in_process

    tokenizer = copy.deepcopy(plain_tokenizer)
    tokenizer.chat_template = (
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if loop.last %}LAST {% endif -%}{{ m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    bad = [make_record([("user", "no answer")], 98),
           make_record([("user", "q"), ("assistant", "a"), ("user", "q2")], 99)]
    with pytest.raises(TemplateError, match=r"record t/99: .*turn 1"):
        tokenize_records(tokenizer, bad, workers=2)


def test_only_large_sets_on_several_cores_use_a_pool(monkeypatch):
    from draftsmith.data import tokenize

    monkeypatch.setattr(tokenize.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert tokenize.pool_workers(tokenize.POOL_MIN_RECORDS - 1) == 0
    assert tokenize.pool_workers(50_000) == 16
    monkeypatch.setattr(tokenize.os, "sched_getaffinity", lambda pid: {0, 1})
    assert tokenize.pool_workers(50_000) == 0  # CI's two cores: no pool


# --- reasoning and tool calls -----------------------------------------------------------------

NATIVE_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' -%}{% generation %}"
    "{%- if m.get('reasoning_content') %}{{ '<think>' + m['reasoning_content'] + '</think>' }}"
    "{%- endif -%}{{ m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}{{ '[call ' + c['function']['name'] + ']' }}"
    "{%- endfor -%}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ m['content'] + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def agent_record() -> Record:
    return Record.model_validate({"id": "a/1", "source": "a", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Rain.", "reasoning": "the tool said rain"}]})


def decoded_masked(tokenizer, record):
    ids, mask = tokenize_record(tokenizer, record)
    return [tokenizer.decode(s, skip_special_tokens=False) for s in masked_spans(ids, mask)]


def test_reasoning_and_tool_calls_without_template_support_become_tagged_text(
        random_target_tokenizer):
    assert "reasoning_content" not in random_target_tokenizer.chat_template
    assert decoded_masked(random_target_tokenizer, agent_record()) == [
        '\n<tool_call>\n{"name": "get_weather", "arguments": "{}"}\n</tool_call>' + END,
        "<think>\nthe tool said rain\n</think>\n\nRain." + END]


def test_reasoning_and_tool_calls_go_through_a_template_that_renders_them(
        random_target_tokenizer):
    tokenizer = copy.deepcopy(random_target_tokenizer)
    tokenizer.chat_template = NATIVE_TEMPLATE
    assert decoded_masked(tokenizer, agent_record()) == [
        "[call get_weather]" + END, "<think>the tool said rain</think>Rain." + END]
