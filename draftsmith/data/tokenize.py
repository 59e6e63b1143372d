"""Chat-template tokenisation with an assistant-only loss mask.

Reasoning (`reasoning_content` / `reasoning` of an assistant turn) is put back where the target
writes it: through the template when the template renders `reasoning_content` itself, otherwise
as `<think>...</think>` before the answer. Tool calls likewise go through the template when it
renders `tool_calls`, otherwise as `<tool_call>` blocks after the turn's text, so the call the
target made stays part of what the drafter learns.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from draftsmith.data.formats import Record
from draftsmith.errors import InputError

THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


class TemplateError(InputError, ValueError):
    pass


def template_messages(tokenizer, record: Record) -> list[dict[str, Any]]:
    """The record's turns as the target's chat template takes them."""
    template = tokenizer.chat_template or ""
    native_reasoning = "reasoning_content" in template
    native_tools = "tool_calls" in template
    out = []
    for m in record.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.reasoning:
            if native_reasoning:
                message["reasoning_content"] = m.reasoning
            else:
                message["content"] = f"{THINK_OPEN}{m.reasoning}{THINK_CLOSE}{m.content}"
        if m.tool_calls:
            if native_tools:
                message["tool_calls"] = m.tool_calls
            else:
                message["content"] += "".join(
                    "\n<tool_call>\n" + json.dumps(call.get("function", call),
                                                   ensure_ascii=False) + "\n</tool_call>"
                    for call in m.tool_calls)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def _render(tokenizer, messages: list[dict[str, str]], **kwargs) -> dict:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def tokenize_record(tokenizer, record: Record) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): the mask is 1 on the tokens of assistant turns only.

    Templates that mark assistant text with `{% generation %}` give the mask directly. For the
    others, each assistant turn's tokens are found by rendering the conversation up to that turn
    with and without it (less the whitespace the template adds after the turn's end token); a
    template that re-tokenises earlier turns differently is an error.
    """
    messages = template_messages(tokenizer, record)
    if "{% generation %}" in (tokenizer.chat_template or ""):
        out = _render(tokenizer, messages, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    ids = list(_render(tokenizer, messages)["input_ids"])
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = list(_render(tokenizer, messages[:turn], add_generation_prompt=True)["input_ids"])
        through = ids if turn == len(messages) - 1 else \
            list(_render(tokenizer, messages[: turn + 1])["input_ids"])
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


# Below this many records the pool's start (a spawned interpreter per worker, importing
# transformers) costs more than it saves.
POOL_MIN_RECORDS = 4096
_worker_tokenizer = None


def _start_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _tokenize_in_worker(record: Record) -> tuple[list[int], list[int]]:
    return tokenize_record(_worker_tokenizer, record)


def pool_workers(records: int) -> int:
    """Worker processes for tokenising this many records: one per usable core (at most 16)
    for large sets, none (in process) for small ones."""
    if records < POOL_MIN_RECORDS:
        return 0
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return min(16, cores) if cores > 2 else 0


def tokenize_records(tokenizer, records: list[Record], workers: int | None = None
                     ) -> list[tuple[list[int], list[int]]]:
    """tokenize_record over many records, in order. Records are independent, so large sets
    are split over worker processes (`pool_workers`); the rows are the same either way."""
    workers = pool_workers(len(records)) if workers is None else workers
    if workers <= 1:
        return [tokenize_record(tokenizer, record) for record in records]
    chunk = max(1, min(512, len(records) // (workers * 4)))
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(tokenizer,)) as pool:
        return list(pool.map(_tokenize_in_worker, records, chunksize=chunk))


def generation_stop_ids(tokenizer, model_dir: str | Path | None = None) -> list[int]:
    """Token ids that end generation: the tokenizer's eos and the model's generation config."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = Path(model_dir) / "generation_config.json" if model_dir else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    return sorted(ids)


def check_special_tokens(tokenizer, model_dir: str | Path | None = None) -> dict[str, Any]:
    """Check that the token the chat template writes to end an assistant turn is one of the
    tokenizer's special tokens (not text split into pieces), and say whether generation stops
    on it. A template written for another tokenizer fails here, before anything is trained on
    turns that never end."""
    probe_text = "probe answer"
    probe = Record(id="probe", source="probe", messages=[
        {"role": "user", "content": "probe question"},
        {"role": "assistant", "content": probe_text}])
    ids, mask = tokenize_record(tokenizer, probe)
    masked = [t for t, m in zip(ids, mask, strict=True) if m]
    # The first masked token after the answer's text is the end-of-turn marker.
    end_at = next((k for k in range(1, len(masked) + 1)
                   if probe_text in tokenizer.decode(masked[:k], skip_special_tokens=False)),
                  None)
    if end_at is None or end_at >= len(masked):
        raise TemplateError(
            "the chat template writes nothing after an assistant turn's text inside the "
            "assistant tokens, so a turn never ends; the template must close assistant turns "
            "with an end-of-turn token (e.g. <|im_end|>, <|eot_id|>)")
    end_id = masked[end_at]
    end_token = tokenizer.convert_ids_to_tokens(end_id)
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(t, "special", False)}
    if end_id not in special:
        raise TemplateError(
            f"the chat template ends assistant turns with {end_token!r} (id {end_id}), which the "
            f"tokenizer does not report as a special token (its special tokens: "
            f"{sorted(tokenizer.all_special_tokens)}): the template and the tokenizer disagree, "
            "so the end-of-turn marker is tokenised as text. Use the template that came with "
            "this tokenizer, or add the marker to the tokenizer's special tokens")
    stop_ids = generation_stop_ids(tokenizer, model_dir)
    return {"end_of_turn_id": end_id, "end_of_turn_token": end_token,
            "generation_stop_ids": stop_ids, "stops_generation": end_id in stop_ids}
