"""Stage `generate`: read every source, answer the prompts that need an answer with the target.

The drafter can only learn the target's own distribution, so prompt-only records are answered
by the target itself (and with `regenerate: all`, every record's last answer is replaced).

Answers are journaled per source (`<run_root>/generate/answers/<source>-<settings>/`), keyed
by the record and its prompt, and kept after the stage finishes: a run whose data changed asks
only for the prompts no journal holds, so an unchanged source is not answered again and a grown
one only for its new records. The journal's name covers the settings that decide what an answer
is and the target, so new such settings or a new target answer everything again; settings
that only decide how fast answers come (ANSWER_SPEED_SETTINGS) keep it.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, hash_json, stage_output
from draftsmith.config import (
    DataConfig,
    DataSource,
    EndpointConfig,
    GenerateConfig,
    TargetConfig,
    key_settings,
    slug,
)
from draftsmith.data.formats import Message, Record, SourceStats, load_source
from draftsmith.data.records import write_records
from draftsmith.errors import ConfigValueError, WorkerCrashError
from draftsmith.generate.journal import (
    ERRORS_FILE,
    Answer,
    Journal,
    Request,
    RunTotals,
    adopt_journal,
)
from draftsmith.generate.openai_client import (
    EndpointError,
    GenerateInputError,
    OpenAIRegenerator,
    cost_usd,
    resolve_api_key,
)
from draftsmith.generate.target_server import TargetServer, run_async
from draftsmith.hosts import HostPart, range_bounds
from draftsmith.progress import Progress

log = logging.getLogger(__name__)

GENERATION_FILE = "generation.json"


def _prompt_part(record: Record, mode: str) -> list[Message] | None:
    """The turns to send to the target, or None when the record is kept as it is."""
    if mode == "none":
        return None
    if record.needs_answer():
        return record.messages
    if mode == "all":
        return record.messages[:-1]
    return None


ANSWERS_DIR = "answers"

# Generate settings that decide how fast the target answers, not what an answer is. They stay
# in the stage's cache key, but a journal survives them: lowering batch_size after an
# out-of-memory error, as that error advises, asks none of the answers again. (In bfloat16 a
# batch of another shape can flip a near tie; either answer is the target's own.)
ANSWER_SPEED_SETTINGS = frozenset({"batch_size", "cache", "cache_lengths", "compile_prefill"})


def journal_dir(plan: StagePlan, cfg: GenerateConfig, source: DataSource,
                target: Descriptor, target_dtype: str = "float32") -> Path:
    """The answer journal of one source: beside the stage directories, not in them (a retry
    clears the stage directory, and the answers of a 55-hour run must survive that), named
    after the source, the settings that decide what an answer is, and the target."""
    settings = key_settings(cfg)
    answer_settings = {k: v for k, v in settings.items() if k not in ANSWER_SPEED_SETTINGS}
    root = plan.dir.parent / ANSWERS_DIR
    name = hash_json({"generate": answer_settings, "target": target.fingerprint,
                      "target_dtype": target_dtype})[:12]
    before_speed_settings_left_out = hash_json({
        "generate": settings, "target": target.fingerprint, "target_dtype": target_dtype})[:12]
    return adopt_journal(root / f"{slug(source.name)}-{name}",
                         root / f"{slug(source.name)}-{before_speed_settings_left_out}")


class SourceJournals:
    """The journals of a run's sources behind one journal's interface: each answer and failure
    goes to the journal of the source whose record asked."""

    def __init__(self, journals: dict[str, Journal], root: Path):
        self.journals = journals  # source name -> its journal
        self.dir = root
        self.source_of: dict[str, str] = {}  # request key -> source name

    def answers(self) -> dict[str, Answer]:
        return {k: a for j in self.journals.values() for k, a in j.answers().items()}

    def failures(self) -> list:
        return [f for j in self.journals.values() for f in j.failures()]

    def add_answer(self, answer: Answer) -> None:
        self.journals[self.source_of[answer.key]].add_answer(answer)

    def add_failure(self, failure) -> None:
        self.journals[self.source_of[failure.key]].add_failure(failure)

    def start_attempt(self) -> None:
        for journal in self.journals.values():
            journal.start_attempt()

    def errors_text(self) -> str:
        return "".join(j.errors_path.read_text() for j in self.journals.values()
                       if j.errors_path.is_file())


def load_data_source(source: DataSource, max_drop_rate: float) -> tuple[list[Record], SourceStats]:
    return load_source(source.name, source.path, source.format, source.limit, max_drop_rate,
                       hub=source.hub, hub_config=source.hub_config, split=source.split,
                       revision=source.revision, builtin=source.builtin,
                       instruction=source.instruction)


def _wire_messages(prompt: list[Message]) -> list[dict]:
    # Earlier turns' reasoning is not part of what the target is shown again.
    return [m.model_dump(exclude_none=True, exclude={"reasoning"}) for m in prompt]


def _answer_with_vllm(cfg: GenerateConfig, server: TargetServer, requests: list[Request],
                      journal: SourceJournals, backoff_initial_s: float,
                      backoff_max_s: float) -> RunTotals:
    """The target's vLLM server (greedy answers from the target itself, at the speed of a
    serving engine), asked as any OpenAI endpoint is."""
    endpoint = server.endpoint()
    regenerator = OpenAIRegenerator(
        with_completion_budget(endpoint, cfg.max_new_tokens), journal, api_key=None,
        temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
        backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s)
    log.info("generate: %d requests to vLLM at %s, %d in flight", len(requests),
             endpoint.base_url, cfg.vllm.concurrency)
    return run_async(regenerator.run(requests))


def _answer_with_transformers(cfg: GenerateConfig, target_cfg: TargetConfig, target: Descriptor,
                              requests: list[Request], journal: SourceJournals) -> RunTotals:
    from draftsmith.generate.transformers_backend import TransformersGenerator, resolve_cache
    from draftsmith.target import load_target_model, load_tokenizer

    dtype = target_cfg.dtype if cfg.dtype == "auto" else cfg.dtype
    model = load_target_model(target.path, target_cfg.device, dtype)
    cache = resolve_cache(cfg.cache, model.device)
    log.info("generate: transformers, %s cache, %s, batches of %d", cache, dtype, cfg.batch_size)
    generator = TransformersGenerator(
        model, load_tokenizer(target),
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, seed=cfg.seed, cache=cache, batch_size=cfg.batch_size,
        longest_prompt=max((r.prompt_tokens for r in requests), default=0),
        cache_lengths=cfg.cache_lengths, compile_prefill=cfg.compile_prefill,
    )
    totals = RunTotals()
    started = time.monotonic()
    # Similar lengths per batch keep left-padding waste small.
    ordered = sorted(requests, key=lambda r: r.prompt_tokens)
    progress = Progress("generate", total=len(ordered), unit="request")
    for start in range(0, len(ordered), cfg.batch_size):
        batch = ordered[start:start + cfg.batch_size]
        completions = generator.complete(
            [[{"role": m["role"], "content": m["content"]} for m in r.messages] for r in batch])
        for request, completion in zip(batch, completions, strict=True):
            journal.add_answer(Answer(
                key=request.key, record_id=request.record_id, content=completion.text,
                reasoning=None, prompt_tokens=request.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                finish_reason=completion.finish_reason))
            totals.answered += 1
            totals.prompt_tokens += request.prompt_tokens
            totals.completion_tokens += completion.completion_tokens
        progress.update(len(batch), tokens=totals.completion_tokens)
    progress.close()
    totals.seconds = time.monotonic() - started
    return totals


def with_completion_budget(endpoint: EndpointConfig, max_new_tokens: int) -> EndpointConfig:
    """The endpoint with every partition's max_tokens set: its own, else generate's
    max_new_tokens (without it a server applies its own limit, often far longer)."""
    return endpoint.model_copy(update={"partitions": [
        p if p.max_tokens is not None else p.model_copy(update={"max_tokens": max_new_tokens})
        for p in endpoint.partitions]})


@dataclass
class GenerateWork:
    """What generate has to do: the records read, the requests for the prompts to answer, and
    the journals that hold the answers so far."""

    records: list[Record]
    stats: list[SourceStats]
    journal: SourceJournals
    requests: list[Request]
    request_for: dict[int, Request]  # record index -> its request

    @property
    def unique(self) -> dict[str, Request]:
        """Records repeated with the same id and prompt share one request (and its answer)."""
        return {r.key: r for r in self.requests}


def check_cache_settings(cfg: GenerateConfig, target_cfg: TargetConfig) -> None:
    """Refuse settings that contradict each other before any journal is read: a journal that
    holds every answer would otherwise let them pass until the day something is asked."""
    if cfg.backend != "transformers" or not cfg.compile_prefill:
        return
    import torch

    from draftsmith.generate.transformers_backend import resolve_cache

    device = torch.device(target_cfg.device)
    cache = resolve_cache(cfg.cache, device)
    if cache != "static":
        raise ValueError(
            f"generate.compile_prefill: true fills a static cache, but generate.cache: "
            f"{cfg.cache} is {cache} on {device.type}; set generate.cache: static or "
            "generate.compile_prefill: false")


def plan_requests(cfg: GenerateConfig, data: DataConfig, target_cfg: TargetConfig,
                  target: Descriptor, plan: StagePlan, writer: str | None = None,
                  api_key: str | None = None, backoff_initial_s: float = 1.0,
                  backoff_max_s: float = 60.0, server: TargetServer | None = None
                  ) -> GenerateWork:
    """Read every source (a source the target writes is written first, what its journal
    lacks) and make a request of every prompt to answer. writer: the journal files this
    process appends to (one per host when generate is spread over hosts)."""
    check_cache_settings(cfg, target_cfg)
    records: list[Record] = []
    stats: list[SourceStats] = []
    for source in data.sources:
        if source.synthesize is not None:
            from draftsmith.generate.synthesize import synthesized_source

            source_records, source_stats = synthesized_source(
                source, cfg, target_cfg, target, plan, api_key, backoff_initial_s,
                backoff_max_s, server)
        else:
            source_records, source_stats = load_data_source(source, data.max_drop_rate)
        log.info("source %s: read %d, kept %d, dropped %s%s", source.name, source_stats.read,
                 source_stats.kept, source_stats.dropped or "none",
                 f", notes {source_stats.notes}" if source_stats.notes else "")
        records += source_records
        stats.append(source_stats)

    todo = [(i, prompt) for i, r in enumerate(records)
            if (prompt := _prompt_part(r, cfg.regenerate)) is not None]
    journal = SourceJournals({
        source.name: Journal(journal_dir(plan, cfg, source, target, target_cfg.dtype), writer)
        for source in data.sources}, plan.dir.parent / ANSWERS_DIR)
    request_for: dict[int, Request] = {}
    if todo:
        from draftsmith.target import load_tokenizer

        tokenizer = load_tokenizer(target)
        for index, prompt in todo:
            wire = _wire_messages(prompt)
            try:
                prompt_tokens = len(tokenizer.apply_chat_template(
                    wire, add_generation_prompt=True, tokenize=True, return_dict=False))
            except Exception as err:  # jinja raises what the template's author chose
                raise GenerateInputError(
                    f"record {records[index].id} ({records[index].source}): the target's chat "
                    f"template cannot render its prompt: {type(err).__name__}: {err}") from None
            request_for[index] = Request(
                key=hash_json([records[index].id, wire])[:24], record_id=records[index].id,
                messages=wire, prompt_tokens=prompt_tokens)
            journal.source_of[request_for[index].key] = records[index].source
    return GenerateWork(records, stats, journal, list(request_for.values()), request_for)


def run_generate(cfg: GenerateConfig, data: DataConfig, target_cfg: TargetConfig,
                 target: Descriptor, plan: StagePlan, *, api_key: str | None = None,
                 backoff_initial_s: float = 1.0, backoff_max_s: float = 60.0,
                 joined_run: str | None = None) -> Descriptor:
    """api_key: a Prefect Secret's value, passed by the task layer (never logged or written);
    without it the key comes from generate.endpoint.api_key_env, if set. joined_run: the
    hosts of that spread run answered every prompt (run_generate_range): write the stage's
    output from the journals, answering nothing here."""
    server = (TargetServer(cfg, target_cfg, target, plan.dir.parent / ANSWERS_DIR)
              if cfg.backend == "vllm" else None)
    try:
        return _generate(cfg, data, target_cfg, target, plan, api_key, backoff_initial_s,
                         backoff_max_s, joined_run, server)
    finally:
        if server is not None:
            server.stop()


def _generate(cfg: GenerateConfig, data: DataConfig, target_cfg: TargetConfig,
              target: Descriptor, plan: StagePlan, api_key: str | None,
              backoff_initial_s: float, backoff_max_s: float, joined_run: str | None,
              server: TargetServer | None) -> Descriptor:
    work = plan_requests(cfg, data, target_cfg, target, plan, api_key=api_key,
                         backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
                         server=server)
    records, stats, journal = work.records, work.stats, work.journal
    requests, request_for, unique = work.requests, work.request_for, work.unique
    done_before = journal.answers()
    missing = [r for key, r in unique.items() if key not in done_before]
    totals = RunTotals()
    if joined_run is not None:
        if missing:
            raise WorkerCrashError(
                f"generate: {len(missing)} of {len(unique)} prompts have no answer after every "
                f"host's range finished (first: {missing[0].record_id}); run the stage again: "
                "only the missing answers are asked")
        # The hosts' answers count as this run's, the rest as answered before.
        totals.answered = len(answered_by(journal, joined_run) & unique.keys())
    answered_before = len(unique.keys() & done_before.keys()) - totals.answered
    if answered_before:
        log.info("generate: %d of %d prompts answered before (earlier runs or attempts; "
                 "journals under %s), %d to ask", answered_before, len(unique), journal.dir,
                 len(missing))
    if missing and cfg.backend == "openai":
        assert cfg.endpoint is not None  # the config refuses openai without an endpoint
        regenerator = OpenAIRegenerator(
            with_completion_budget(cfg.endpoint, cfg.max_new_tokens), journal,
            api_key=resolve_api_key(cfg.endpoint, api_key), temperature=cfg.temperature,
            top_p=cfg.top_p, seed=cfg.seed,
            backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s)
        log.info("generate: %d requests to %s (model %s), partitions %s", len(missing),
                 regenerator.url, cfg.endpoint.model,
                 [p.model_dump() for p in regenerator.endpoint.partitions])
        totals = run_async(regenerator.run(missing))
    elif missing and cfg.backend == "vllm":
        totals = _answer_with_vllm(cfg, server, missing, journal, backoff_initial_s,
                                   backoff_max_s)
    elif missing:
        journal.start_attempt()
        totals = _answer_with_transformers(cfg, target_cfg, target, missing, journal)

    answers = journal.answers()
    failures = {f.key: f for f in journal.failures()}
    unanswered = [r for key, r in unique.items() if key not in answers]
    # Every request is answered (before or now) or failed, exactly once.
    if answered_before + totals.answered + len(unanswered) != len(unique):
        raise AssertionError(f"generate: {answered_before} answered before + {totals.answered} "
                             f"now + {len(unanswered)} failed != {len(unique)} requests")
    if unanswered and len(unanswered) > cfg.max_failure_rate * len(unique):
        first = failures.get(unanswered[0].key)
        # Retrying the stage helps only when some failure may pass (5xx, timeouts, garbage
        # replies); a server that refuses every request (4xx) refuses it again.
        kind = (EndpointError if any(f.retryable for f in failures.values()) or
                len(failures) < len(unanswered) else GenerateInputError)
        raise kind(
            f"generate: {len(unanswered)} of {len(unique)} requests failed after every retry "
            f"(more than generate.max_failure_rate={cfg.max_failure_rate}); causes "
            f"{_causes(failures.values())}; first: {unanswered[0].record_id}: "
            f"{first.error if first else 'no answer'}. Errors: errors.jsonl of each source's "
            f"journal under {journal.dir}. The {len(answers)} answers so far are kept there; "
            "running the stage again asks only for the missing ones")

    kept: list[Record] = []
    answered_keys = set()
    for index, record in enumerate(records):
        request = request_for.get(index)
        if request is None:
            kept.append(record)
            continue
        answer = answers.get(request.key)
        if answer is None:
            continue  # failed: in errors.jsonl, never written as data
        answered_keys.add(request.key)
        prompt = _prompt_part(record, cfg.regenerate)
        kept.append(record.model_copy(update={"messages": [
            *prompt, Message(role="assistant", content=answer.content,
                             reasoning=answer.reasoning)]}))
    used = [answers[k] for k in answered_keys]
    prompt_tokens = sum(a.prompt_tokens for a in used)
    completion_tokens = sum(a.completion_tokens for a in used)
    with_reasoning = sum(a.reasoning is not None for a in used)
    unparsed = think_tags_without_reasoning(used)
    if unparsed:
        log.warning(
            "generate: %d of %d answers carry think tags in their content and no reasoning "
            "field (first: %s): the server separates no reasoning, so training sees the think "
            "text as answer text, rendered unlike the target's own turns. Start the server "
            "with a reasoning parser (SGLang: --reasoning-parser, kimi_k2 for Kimi-K2.5) and "
            "regenerate", len(unparsed), len(used), unparsed[0].record_id)
    finished = sum(a.finish_reason == "stop" for a in used)
    cost = cost_usd(cfg.endpoint, prompt_tokens, completion_tokens) if cfg.endpoint else None
    summary = {
        "backend": cfg.backend,
        "requests": len(unique),
        "answered": len(used),
        "answered_this_attempt": totals.answered,
        "answered_before": answered_before,
        "failed": len(unanswered),
        "failed_by_cause": _causes(failures[r.key] for r in unanswered if r.key in failures),
        "retries_this_attempt": totals.retries,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "mean_completion_tokens": round(completion_tokens / len(used), 1) if used else 0.0,
        "finished_turns": finished,
        "with_reasoning": with_reasoning,
        "think_tags_without_reasoning": len(unparsed),
        "seconds_this_attempt": round(totals.seconds, 2),
        "requests_per_s": round(totals.answered / totals.seconds, 3) if totals.seconds else None,
        "tokens_per_s": (round(totals.completion_tokens / totals.seconds, 1)
                         if totals.seconds else None),
        "cost_usd": round(cost, 6) if cost is not None else None,
        "per_partition": totals.per_partition,
        "per_source": per_source_counts(
            requests, journal.source_of,
            {k: a for k, a in done_before.items()
             if joined_run is None or k not in answered_by(journal, joined_run)}, answers),
    }
    with stage_output(plan) as out:
        write_records(out, kept)
        (out / "stats.json").write_text(json.dumps([s.model_dump() for s in stats], indent=2))
        (out / GENERATION_FILE).write_text(json.dumps(summary, indent=2))
        if unanswered:
            failed = {r.key for r in unanswered}
            (out / ERRORS_FILE).write_text("".join(
                line + "\n" for line in journal.errors_text().splitlines()
                if line.strip() and json.loads(line)["key"] in failed))
    log.info("generate: %d records, %d answered by the target (%d this attempt, %d from the "
             "journal), %d failed, %d prompt + %d completion tokens (mean completion %.1f), %d "
             "ended their turn, %d carried reasoning%s", len(kept), len(used), totals.answered,
             answered_before, len(unanswered), prompt_tokens, completion_tokens,
             summary["mean_completion_tokens"], finished, with_reasoning,
             f", cost ${cost:.4f}" if cost is not None else "")
    descriptor = finish_stage(
        plan,
        counts={"records": len(kept), "generated": len(used), "failed": len(unanswered),
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "finished_turns": finished, "with_reasoning": with_reasoning},
        figures={"backend": cfg.backend, "cost_usd": summary["cost_usd"],
                 "tokens_per_s": summary["tokens_per_s"],
                 "requests_per_s": summary["requests_per_s"]},
    )
    # The journals stay: they are the per-source answer caches of later runs.
    return descriptor


def per_source_counts(requests: list[Request], source_of: dict[str, str],
                      before: dict[str, Answer], now: dict[str, Answer]
                      ) -> dict[str, dict[str, int]]:
    """Per source: its distinct prompts, those answered in earlier runs or attempts, and those
    answered in this one."""
    out: dict[str, dict[str, int]] = {}
    for key in {r.key for r in requests}:
        counts = out.setdefault(source_of[key], {"requests": 0, "answered_before": 0,
                                                 "answered_this_attempt": 0})
        counts["requests"] += 1
        if key in before:
            counts["answered_before"] += 1
        elif key in now:
            counts["answered_this_attempt"] += 1
    return dict(sorted(out.items()))


def _causes(failures) -> dict[str, int]:
    return dict(sorted(Counter(f.cause for f in failures).items()))


# What reasoning models print around their thinking when no reasoning parser takes it out
# of the content: <think> (Kimi-K2.5, DeepSeek-R1, Qwen3), ◁think▷ (Kimi-VL).
THINK_TAGS = ("<think>", "</think>", "\u25c1think\u25b7", "\u25c1/think\u25b7")


def think_tags_without_reasoning(answers: list) -> list:
    return [a for a in answers
            if a.reasoning is None and any(tag in a.content for tag in THINK_TAGS)]


# --------------------------------------------------------------------------- several hosts


def answered_by(journal: SourceJournals, run_id: str) -> set[str]:
    """The request keys answered by the hosts of one spread run (their own journal files)."""
    keys: set[str] = set()
    for source_journal in journal.journals.values():
        for path in source_journal.dir.glob(f"answers.{run_id}-*.jsonl"):
            partial: dict[str, Answer] = {}
            source_journal.read_answers(path, partial, own=False)
            keys |= partial.keys()
    return keys


def range_requests(requests: list[Request], batch_size: int, part: HostPart) -> list[Request]:
    """The part's range of the prompts: whole batches of the order one host answers them in
    (by prompt length), so each batch, and each answer, is the one a single host computes."""
    ordered = sorted(requests, key=lambda r: r.prompt_tokens)
    start, end = range_bounds(-(-len(ordered) // batch_size), part.count, part.index)
    return ordered[start * batch_size:end * batch_size]


def run_generate_range(cfg: GenerateConfig, data: DataConfig, target_cfg: TargetConfig,
                       target: Descriptor, plan: StagePlan, part: HostPart) -> dict:
    """One host's range of the prompts, answered by the target in this process into this
    host's own journal files; run_generate(joined_run=...) writes the stage's output once
    every range is done. Prompts of the range answered before are not asked again."""
    if cfg.backend != "transformers":
        raise ConfigValueError(f"generate.backend={cfg.backend}: only the transformers backend "
                               "answers on the GPU hosts, so only it is split over them")
    work = plan_requests(cfg, data, target_cfg, target, plan, writer=f"{part.run_id}-{part.index}")
    mine = range_requests(list(work.unique.values()), cfg.batch_size, part)
    done = work.journal.answers()
    missing = [r for r in mine if r.key not in done]
    log.info("generate %s: %d of %d prompts, %d answered before", part.where(), len(mine),
             len(work.unique), len(mine) - len(missing))
    totals = RunTotals()
    if missing:
        work.journal.start_attempt()
        totals = _answer_with_transformers(cfg, target_cfg, target, missing, work.journal)
    return {"requests": len(mine), "answered": totals.answered,
            "completion_tokens": totals.completion_tokens,
            "seconds": round(totals.seconds, 2)}
