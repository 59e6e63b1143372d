"""Chat-template tokenisation with an assistant-only loss mask."""

from __future__ import annotations

from draftsmith.data.formats import Record


class TemplateError(ValueError):
    pass


def _render(tokenizer, messages: list[dict[str, str]], **kwargs) -> dict:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def tokenize_record(tokenizer, record: Record) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): the mask is 1 on the tokens of assistant turns only.

    Templates that mark assistant text with `{% generation %}` give the mask directly. For the
    others, each assistant turn's tokens are found by rendering the conversation up to that turn
    with and without it (less the whitespace the template adds after the turn's end token); a
    template that re-tokenises earlier turns differently is an error.
    """
    messages = [m.model_dump(include={"role", "content"}) for m in record.messages]
    if "{% generation %}" in (tokenizer.chat_template or ""):
        out = _render(tokenizer, messages, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    ids = list(_render(tokenizer, messages)["input_ids"])
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = list(_render(tokenizer, messages[:turn], add_generation_prompt=True)["input_ids"])
        through = list(_render(tokenizer, messages[: turn + 1])["input_ids"])
        if ids[: len(through)] != through or through[: len(before)] != before:
            raise TemplateError(
                f"record {record.id}: the chat template does not render turn {turn} as a prefix "
                "of the full conversation, so the assistant tokens cannot be located; add "
                "{% generation %} markers to the template"
            )
        # What the template writes after the turn's end token (ChatML's "\n") is not the
        # assistant's: leave trailing whitespace-only tokens out, as {% generation %} does.
        end = len(through)
        while end > len(before) and not tokenizer.decode(through[end - 1 : end]).strip():
            end -= 1
        for pos in range(len(before), end):
            mask[pos] = 1
    return ids, mask
