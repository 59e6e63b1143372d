"""Prompts the target writes itself: a data source (`synthesize:`) for users whose own prompts
are few, or cover one kind of request only.

The target is shown its chat template up to the start of a user turn and continues it, sampled,
so it writes what it expects a user to ask:
- free (Magpie, arXiv 2406.08464): from the bare user turn, with nothing else;
- guided: from an opener of a task type ("Write a short poem about", "Solve this math
  problem:"), optionally naming one of the user's topics, so the prompts cover chat, writing,
  explanation, code, math and reasoning in the weights asked for.
The turn ends where the target ends it (its end-of-turn token). Unfinished, too short and
repetitive prompts are dropped, and duplicates after case and punctuation are folded; each
reason is counted in the source's stats. The kept prompts are prompt-only records that
generate then answers greedily, like every other prompt, and merge keeps them apart from every
evaluation set (draftsmith/data/overlap.py).

The target writes where generate answers: in this process (backend transformers), through
the vLLM server generate starts (backend vllm), or through your OpenAI-compatible server
(backend openai: its /v1/completions, with the template's token ids as the prompt, so SGLang
and vLLM write from exactly the text the in-process path does).

Every prompt to write is fixed by the settings before any is written (its type, opener and
topic, from `seed`). In process, batch b is sampled with seed + b; over HTTP each prompt i
carries its own seed (seed * 1,000,003 + i). Either way a run resumed from the journal writes
what an uninterrupted run on the same machine writes. The journal
(`<run_root>/generate/prompts/<source>-<settings>/written.jsonl`) is appended a batch at a time
and fsynced; like the answer journals it survives the stage's retries and later runs. It keeps
the batch size it was begun with (`batches.json`) and goes on in that one, so a run whose
generate.batch_size was lowered after an out-of-memory error keeps every prompt written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.artifacts import atomic_write_json
from draftsmith.diskspace import append_line
from draftsmith.progress import Progress

if TYPE_CHECKING:
    from draftsmith.artifacts import Descriptor, StagePlan
    from draftsmith.config import DataSource, GenerateConfig, SynthesizeConfig, TargetConfig
    from draftsmith.data.formats import Record, SourceStats
    from draftsmith.generate.target_server import TargetServer

log = logging.getLogger(__name__)

PROMPTS_DIR = "prompts"
WRITTEN_FILE = "written.jsonl"
BATCHES_FILE = "batches.json"  # beside the journal: the batch size its prompts are sampled in
FREE = "free"
TOPIC = "{topic}"
# Openers end without a space: the target writes the space-led word after them itself, as
# its tokenizer spells it (an opener ending in " " makes most continuations start oddly).
OPENERS: dict[str, tuple[str, ...]] = {
    "chat": (
        "Can you help me", "I need some advice", "How do I", "What are some good",
        "Do you have any tips for", "What do you think about", "Can you recommend",
        "I'm planning", "What should I do if", "Tell me about {topic}",
        "Give me some tips on {topic}"),
    "writing": (
        "Write a short poem about", "Write an email to", "Write a short story about",
        "Write a letter to", "Write a product description for", "Write a blog post about",
        "Write a speech", "Rewrite the following", "Write a short poem about {topic}",
        "Write a story about {topic}"),
    "explanation": (
        "Explain", "Why do", "How does", "What is the difference between", "What causes",
        "Describe how", "What is", "Explain to a child", "Explain {topic}",
        "How does {topic} work"),
    "code": (
        "Write a Python function that", "Write a Python program that", "How do I use Python to",
        "Write a function that", "What does this Python code do", "Fix the bug in this code",
        "Write a SQL query that", "Write a JavaScript function that",
        "Write a Python function about {topic}"),
    "math": (
        "Solve this math problem:", "Solve this word problem:", "Calculate", "A store sells",
        "How many", "What is the probability", "Solve for x:", "If a car",
        "Write a math word problem about {topic} and solve it"),
    "reasoning": (
        "Solve this riddle:", "Which is", "What comes next in the sequence", "Is it true that",
        "If all", "Compare the pros and cons of", "Think step by step:",
        "What are the pros and cons of {topic}"),
}


@dataclass(frozen=True)
class Writing:
    """One prompt to write: its task type (or `free`), and the start of the user turn."""

    index: int
    task_type: str
    opener: str  # the user turn's first words, given to the target ("" when free)


def openers_for(cfg: SynthesizeConfig) -> dict[str, tuple[str, ...]]:
    """Each task type's openers (builtin plus the user's); openers with a topic only when
    there are topics."""
    merged = {t: tuple(OPENERS.get(t, ())) + tuple(cfg.openers.get(t, ()))
              for t in set(OPENERS) | set(cfg.openers)}
    return {t: tuple(o.rstrip() for o in ops if cfg.topics or TOPIC not in o)
            for t, ops in merged.items()}


def plan_writings(cfg: SynthesizeConfig) -> list[Writing]:
    """The prompts to write, fixed by the settings (and `seed`) before any is written."""
    rng = random.Random(cfg.seed)
    openers = openers_for(cfg)
    weighted = [(t, w) for t, w in sorted(cfg.task_types.items()) if w > 0 and openers.get(t)]
    if cfg.free_share < 1 and not weighted:
        from draftsmith.config import ConfigError

        raise ConfigError(f"synthesize.task_types={cfg.task_types}: no type with a positive "
                          "weight has an opener (openers with {topic} need synthesize.topics)")
    types, weights = [t for t, _ in weighted], [w for _, w in weighted]
    out = []
    for index in range(cfg.prompts):
        if rng.random() < cfg.free_share:
            out.append(Writing(index, FREE, ""))
            continue
        task_type = rng.choices(types, weights)[0]
        opener = rng.choice(openers[task_type])
        if TOPIC in opener:
            opener = opener.replace(TOPIC, rng.choice(cfg.topics))
        out.append(Writing(index, task_type, opener))
    return out


def user_turn_start(tokenizer) -> str:
    """The chat template's text up to where a user turn's content begins (its default system
    turn included, as every prompt is rendered): what the target continues."""
    mark = "\x00draftsmith-user-turn\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=False)
    if mark not in text:
        from draftsmith.errors import InputError

        raise InputError("synthesize: the target's chat template does not show a user turn's "
                         "text as it is given, so the start of a user turn cannot be found; "
                         "write prompts into a file instead")
    return text.split(mark)[0]


# --------------------------------------------------------------------------- the journal


def record_id(source_name: str, entry: dict) -> str:
    """A kept prompt's record id: its index and its text's hash, so that a prompt written again
    differently (other settings, another journal) is another record."""
    digest = hashlib.sha256(entry["text"].encode()).hexdigest()[:8]
    return f"{source_name}/{entry['index']:07d}-{digest}"


def journal_path(plan: StagePlan, source: DataSource, cfg: GenerateConfig, target: Descriptor,
                 dtype: str) -> Path:
    """Beside the stage directories (a retry clears the stage directory), named after the
    source and everything that decides what is written: the synthesis settings, the dtype it
    is sampled in, and the target. The batch size is the journal's own (`writing_batch_size`).
    """
    from draftsmith.artifacts import hash_json
    from draftsmith.config import key_settings, slug
    from draftsmith.generate.journal import adopt_journal

    def name(**batch) -> Path:
        settings = hash_json({"synthesize": key_settings(source.synthesize), **batch,
                              "dtype": dtype, "target": target.fingerprint})[:12]
        return plan.dir.parent / PROMPTS_DIR / f"{slug(source.name)}-{settings}"

    directory, earlier = name(), name(batch_size=cfg.batch_size)
    if not directory.exists() and earlier.is_dir() and not (earlier / BATCHES_FILE).exists():
        atomic_write_json(earlier / BATCHES_FILE, {"batch_size": cfg.batch_size})
    return adopt_journal(directory, earlier) / WRITTEN_FILE


def writing_batch_size(journal: Path, configured: int) -> int:
    """The batch size the journal's prompts are sampled in: the one it was begun with (batch b
    is sampled with seed + b, so another size would write other prompts for the same
    indices), else `configured`."""
    recorded = journal.parent / BATCHES_FILE
    if recorded.is_file():
        return int(json.loads(recorded.read_text())["batch_size"])
    return configured


def read_journal(path: Path) -> dict[int, dict]:
    """index -> written entry; a line torn by a crash (the last one) is ignored, and its batch
    is written again."""
    entries: dict[int, dict] = {}
    if not path.is_file():
        return entries
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            entries[entry["index"]] = entry
    return entries


def drop_torn_tail(path: Path) -> None:
    """Cut a last line that a crash left without its newline, so that the next batch starts
    on a line of its own."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)


def journal_so_far(path: Path) -> dict[int, dict]:
    """What the journal holds, after cutting a line a crash tore."""
    drop_torn_tail(path)
    return read_journal(path)


def opener_token_ids(tokenizer, writings: list[Writing]) -> dict[str, list[int]]:
    return {w.opener: tokenizer(w.opener, add_special_tokens=False)["input_ids"]
            if w.opener else [] for w in writings}


def append_batch(path: Path, entries: list[dict]) -> None:
    """One fsynced append per batch; a full disk takes the batch back whole and names the
    journal (draftsmith/diskspace.py), so the rerun writes that batch again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    append_line(path, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))


# --------------------------------------------------------------------------- writing


def write_prompts(writings: list[Writing], journal: Path, generator, start_ids: list[int],
                  batch_size: int, seed: int) -> dict[int, dict]:
    """Every writing not in the journal yet, a batch at a time (batch b sampled with
    seed + b), appended to the journal; returns the whole journal."""
    done = journal_so_far(journal)
    if not (journal.parent / BATCHES_FILE).exists():
        atomic_write_json(journal.parent / BATCHES_FILE, {"batch_size": batch_size})
    batches = [writings[i:i + batch_size] for i in range(0, len(writings), batch_size)]
    todo = [(b, batch) for b, batch in enumerate(batches)
            if any(w.index not in done for w in batch)]
    if len(batches) > len(todo):
        log.info("synthesize: %d of %d batches written before (journal %s)",
                 len(batches) - len(todo), len(batches), journal)
    if not todo:
        return done
    opener_ids = opener_token_ids(generator.tokenizer, writings)
    generator.longest_prompt = len(start_ids) + max(map(len, opener_ids.values()), default=0)
    progress = Progress("synthesize", total=sum(len(b) for _, b in todo), unit="prompt")
    for b, batch in todo:
        generator.generator_seed = seed + b
        completions = generator.complete_tokens([start_ids + opener_ids[w.opener]
                                                 for w in batch])
        entries = [{"index": w.index, "task_type": w.task_type, "opener": w.opener,
                    "text": join_opener(w.opener, c.text), "finish_reason": c.finish_reason,
                    "tokens": c.completion_tokens} for w, c in zip(batch, completions, strict=True)]
        append_batch(journal, entries)
        done.update((e["index"], e) for e in entries)
        progress.update(len(batch))
    progress.close()
    return done


def join_opener(opener: str, continuation: str) -> str:
    """The user turn: the opener and what the target wrote after it."""
    if not opener:
        return continuation.strip()
    glue = "" if not continuation or continuation[0].isspace() or continuation[0] in ",.:;?!" \
        else " "
    return (opener + glue + continuation).strip()


def write_over_http(writings: list[Writing], journal: Path, url: str, model: str,
                    api_key: str | None, start_ids: list[int], tokenizer,
                    synth: SynthesizeConfig, concurrency: int, timeout_s: float,
                    max_retries: int, backoff_initial_s: float = 1.0,
                    backoff_max_s: float = 60.0) -> dict[int, dict]:
    """Every writing not in the journal yet, through an OpenAI-compatible /v1/completions
    (`url` is the API's base, .../v1), `concurrency` at a time; journaled in chunks of a few
    times `concurrency`. A request that still fails after its retries fails the stage: the
    journal keeps what was written, and a rerun asks only for the rest."""
    import asyncio

    import httpx
    from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

    from draftsmith.generate.openai_client import (
        EndpointError,
        HTTPStatusFailure,
        MalformedReply,
        _Backoff,
        _describe,
        _retry_after,
        _retryable,
    )

    done = journal_so_far(journal)
    todo = [w for w in writings if w.index not in done]
    if len(todo) < len(writings):
        log.info("synthesize: %d of %d prompts written before (journal %s)",
                 len(writings) - len(todo), len(writings), journal)
    if not todo:
        return done
    opener_ids = opener_token_ids(tokenizer, todo)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url.rstrip("/") + "/completions"
    backoff = _Backoff(backoff_initial_s, backoff_max_s)

    async def write_one(client: httpx.AsyncClient, writing: Writing) -> dict:
        body = {"model": model, "prompt": start_ids + opener_ids[writing.opener],
                "max_tokens": synth.max_prompt_tokens, "temperature": synth.temperature,
                "top_p": synth.top_p, "seed": synth.seed * 1_000_003 + writing.index,
                "stream": False}
        retrying = AsyncRetrying(stop=stop_after_attempt(max_retries + 1), wait=backoff,
                                 retry=retry_if_exception(_retryable), reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    response = await client.post(endpoint, json=body, headers=headers)
                    if response.status_code != 200:
                        raise HTTPStatusFailure(response.status_code, response.text,
                                                _retry_after(response.headers))
                    try:
                        choice = response.json()["choices"][0]
                        text, finish = choice["text"], choice.get("finish_reason")
                        tokens = response.json().get("usage", {}).get("completion_tokens")
                    except (ValueError, KeyError, IndexError, TypeError):
                        raise MalformedReply("no choices[0].text in the completion") from None
        except (HTTPStatusFailure, MalformedReply, httpx.HTTPError) as err:
            raise EndpointError(
                f"synthesize: prompt {writing.index} failed after {max_retries + 1} attempts "
                f"at {endpoint}: {_describe(err)[:300]}. The {len(done)} prompts written so "
                f"far are kept in {journal}; running the stage again writes only the rest"
            ) from None
        return {"index": writing.index, "task_type": writing.task_type,
                "opener": writing.opener, "text": join_opener(writing.opener, text),
                "finish_reason": "stop" if finish == "stop" else finish or "length",
                "tokens": tokens}

    async def write_all() -> None:
        chunk = max(4 * concurrency, 64)
        progress = Progress("synthesize", total=len(todo), unit="prompt")
        limits = httpx.Limits(max_connections=concurrency,
                              max_keepalive_connections=concurrency)
        gate = asyncio.Semaphore(concurrency)

        async def gated(client: httpx.AsyncClient, writing: Writing) -> dict:
            async with gate:
                return await write_one(client, writing)

        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            for start in range(0, len(todo), chunk):
                part = todo[start:start + chunk]
                entries = await asyncio.gather(*(gated(client, w) for w in part))
                append_batch(journal, list(entries))  # durable before it counts as done
                done.update((e["index"], e) for e in entries)
                progress.update(len(part))
        progress.close()

    from draftsmith.generate.target_server import run_async

    run_async(write_all())
    return done


# --------------------------------------------------------------------------- filtering


_WORD = re.compile(r"\w+")


def folded(text: str) -> str:
    """Case, punctuation and spacing folded: the key two copies of one prompt share."""
    return " ".join(_WORD.findall(text.lower()))


def is_repetitive(text: str) -> bool:
    """A loop the sampling fell into: few distinct words, or a 4-word run said 3+ times."""
    words = _WORD.findall(text.lower())
    if len(words) >= 12 and len(set(words)) / len(words) < 0.4:
        return True
    runs = Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3))
    return bool(runs) and max(runs.values()) >= 3


def select_prompts(entries: list[dict], min_chars: int) -> tuple[list[dict], Counter[str]]:
    """The usable prompts, in index order, and the count of each reason to drop one."""
    dropped: Counter[str] = Counter()
    seen: set[str] = set()
    kept = []
    for entry in sorted(entries, key=lambda e: e["index"]):
        text = entry["text"]
        if entry["finish_reason"] != "stop":
            dropped["unfinished (no end of turn within max_prompt_tokens)"] += 1
        elif len(text) < min_chars:
            dropped["too short"] += 1
        elif is_repetitive(text):
            dropped["repetitive"] += 1
        elif folded(text) in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(folded(text))
            kept.append(entry)
    return kept, dropped


# --------------------------------------------------------------------------- the source


def synthesized_source(source: DataSource, cfg: GenerateConfig, target_cfg: TargetConfig,
                       target: Descriptor, plan: StagePlan, api_key: str | None = None,
                       backoff_initial_s: float = 1.0, backoff_max_s: float = 60.0,
                       server: TargetServer | None = None) -> tuple[list[Record], SourceStats]:
    """The source's prompts: written by the target (what the journal lacks) where generate
    answers, filtered, as prompt-only records; and its stats (written, kept, dropped by
    reason, per task type). api_key: a Prefect Secret's value (backend openai); server: the
    stage's vLLM server of the target (backend vllm)."""
    from draftsmith.data.formats import Message, Record, SourceStats

    synth = source.synthesize
    dtype = target_cfg.dtype if cfg.dtype == "auto" else cfg.dtype
    journal = journal_path(plan, source, cfg, target, dtype)
    writings = plan_writings(synth)
    entries = read_journal(journal)
    if any(w.index not in entries for w in writings):
        if cfg.backend == "transformers":
            entries = _write_with_target(writings, journal, cfg, target_cfg, target, dtype,
                                         synth)
        else:
            entries = _write_with_server(writings, journal, cfg, target, synth, api_key,
                                         backoff_initial_s, backoff_max_s, server)
    kept, dropped = select_prompts([entries[w.index] for w in writings],
                                   synth.min_prompt_chars)
    if source.limit is not None:
        kept = kept[:source.limit]
    records = [Record(id=record_id(source.name, e), source=source.name,
                      messages=[Message(role="user", content=e["text"])])
               for e in kept]
    by_type = Counter(e["task_type"] for e in kept)
    stats = SourceStats(source=source.name, read=len(writings), kept=len(records),
                        dropped=dict(dropped),
                        notes={f"kept {t}": n for t, n in sorted(by_type.items())})
    log.info("synthesize %s: %d written, %d kept (%s), dropped %s", source.name, len(writings),
             len(records), dict(sorted(by_type.items())), dict(dropped) or "none")
    if not records:
        from draftsmith.data.formats import DataFormatError

        raise DataFormatError(
            f"data.sources[{source.name}].synthesize: none of the {len(writings)} prompts the "
            f"target wrote was kept (dropped: {dict(dropped)}); raise "
            "synthesize.max_prompt_tokens if most were unfinished, or check the target's chat "
            "template")
    return records, stats


def _write_with_target(writings: list[Writing], journal: Path, cfg: GenerateConfig,
                       target_cfg: TargetConfig, target: Descriptor, dtype: str,
                       synth: SynthesizeConfig) -> dict[int, dict]:
    import gc

    import torch

    from draftsmith.generate.transformers_backend import TransformersGenerator, resolve_cache
    from draftsmith.target import load_target_model, load_tokenizer

    tokenizer = load_tokenizer(target)
    model = load_target_model(target.path, target_cfg.device, dtype)
    start_ids = tokenizer(user_turn_start(tokenizer), add_special_tokens=False)["input_ids"]
    batch_size = writing_batch_size(journal, cfg.batch_size)
    generator = TransformersGenerator(
        model, tokenizer, max_new_tokens=synth.max_prompt_tokens,
        temperature=synth.temperature, top_p=synth.top_p, seed=synth.seed,
        cache=resolve_cache(cfg.cache, model.device), batch_size=batch_size,
        cache_lengths=cfg.cache_lengths)
    log.info("synthesize: the target writes %d prompts (%s), batches of %d%s, journal %s",
             len(writings), dict(sorted(Counter(w.task_type for w in writings).items())),
             batch_size, "" if batch_size == cfg.batch_size else
             f" (the journal's, begun with them; generate.batch_size is {cfg.batch_size})",
             journal)
    try:
        return write_prompts(writings, journal, generator, start_ids, batch_size, synth.seed)
    finally:
        del generator, model  # the answering pass loads the target again
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _write_with_server(writings: list[Writing], journal: Path, cfg: GenerateConfig,
                       target: Descriptor, synth: SynthesizeConfig, api_key: str | None,
                       backoff_initial_s: float, backoff_max_s: float,
                       server: TargetServer | None) -> dict[int, dict]:
    """Through the endpoint generate answers with: your server (openai), or the stage's
    `vllm serve` of the target (vllm)."""
    from draftsmith.target import load_tokenizer

    tokenizer = load_tokenizer(target)
    start_ids = tokenizer(user_turn_start(tokenizer), add_special_tokens=False)["input_ids"]
    log.info("synthesize: %s writes %d prompts (%s), journal %s", cfg.backend, len(writings),
             dict(sorted(Counter(w.task_type for w in writings).items())), journal)
    if cfg.backend == "openai":
        from draftsmith.generate.openai_client import resolve_api_key

        endpoint, concurrency = cfg.endpoint, cfg.endpoint.partitions[0].concurrency
        api_key = resolve_api_key(endpoint, api_key)
    else:
        if server is None:
            raise ValueError("generate.backend=vllm writes prompts through the stage's server")
        endpoint, concurrency, api_key = server.endpoint(), cfg.vllm.concurrency, None
    return write_over_http(writings, journal, endpoint.base_url, endpoint.model, api_key,
                           start_ids, tokenizer, synth, concurrency, endpoint.timeout_s,
                           endpoint.max_retries, backoff_initial_s, backoff_max_s)
