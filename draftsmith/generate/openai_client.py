"""Regeneration over HTTP: any OpenAI-compatible chat-completions server answers the prompts.

Prompts are split into partitions by prompt length; each partition has its own number of
requests in flight and its own completion budget (long prompts hold a server's KV cache longer).
Faults are per request, never per stage: a 429, a 5xx, a timeout, a dropped connection or a
malformed 200 (a body that is not JSON, no choices, null or missing content, wrong types) is a
failed attempt of that one request, retried with exponential backoff and jitter (never sooner
than a Retry-After); a request that still fails goes to the journal's error file with its cause,
never into the data, and every other request carries on. Every answer is appended to the journal
and fsynced as it arrives, so a crashed or retried run asks only for what is still missing.

The API key is sent in the Authorization header and nowhere else: it is not logged, not written
and not part of any error message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from draftsmith.config import EndpointConfig, Partition
from draftsmith.errors import InputError, TransientError
from draftsmith.generate.journal import Answer, Failure, Journal, Request, RunTotals
from draftsmith.progress import Progress

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 425, 429}) | frozenset(range(500, 600))


class GenerateError(RuntimeError):
    pass


class GenerateInputError(InputError, GenerateError):
    """Generation cannot start or cannot succeed as configured (an unset API key, a prompt the
    chat template cannot render, requests the server refuses on every try)."""


class EndpointError(TransientError, GenerateError):
    """Too many requests failed after every retry for reasons that may pass (the server down,
    overloaded, or answering garbage); a rerun asks only for the missing answers."""


class HTTPStatusFailure(Exception):
    """A non-2xx answer; the body is kept short (servers may echo the prompt back)."""

    def __init__(self, status: int, body: str, retry_after: float | None):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.retry_after = status, retry_after


class MalformedReply(Exception):
    """A 200 whose body is no usable chat completion. Says what is wrong with its structure but
    quotes none of it (a body may echo the prompt)."""


@dataclass
class Completion:
    content: str
    reasoning: str | None
    prompt_tokens: int | None  # None: the server sent no usage
    completion_tokens: int | None
    finish_reason: str | None


def _count(usage: dict[str, Any], name: str) -> int | None:
    value = usage.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedReply(f"usage.{name} is {type(value).__name__} {value!r:.40}, expected a "
                             "count")
    return value


def parse_completion(body: bytes | str) -> Completion:
    """The answer in a chat-completions body, or MalformedReply saying what is wrong with it.
    An empty string is an answer (the target ended its turn at once); null is not."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MalformedReply(f"the body ({len(body)} bytes) is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise MalformedReply(f"the body is a JSON {type(data).__name__}, expected an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        what = "missing" if choices is None else f"{type(choices).__name__} {choices!r:.20}"
        extra = " (the body has an 'error')" if "error" in data else ""
        raise MalformedReply(f"choices is {what}, expected a non-empty list{extra}")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise MalformedReply(f"choices[0].message is {type(message).__name__}, expected an "
                             "object")
    if "content" not in message:
        raise MalformedReply("choices[0].message has no content")
    content = message["content"]
    if content is None:
        raise MalformedReply("choices[0].message.content is null (no text to train on)")
    if not isinstance(content, str):
        raise MalformedReply(f"choices[0].message.content is {type(content).__name__}, "
                             "expected text")
    for name in ("reasoning_content", "reasoning"):  # SGLang/vLLM, and OpenRouter's spelling
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise MalformedReply(f"choices[0].message.{name} is {type(value).__name__}, "
                                 "expected text")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    finish_reason = choice.get("finish_reason")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise MalformedReply(f"choices[0].finish_reason is {type(finish_reason).__name__}, "
                             "expected text")
    usage = data.get("usage")
    if usage is None:
        usage = {}
    if not isinstance(usage, dict):
        raise MalformedReply(f"usage is {type(usage).__name__}, expected an object")
    return Completion(content=content, reasoning=reasoning or None,
                      prompt_tokens=_count(usage, "prompt_tokens"),
                      completion_tokens=_count(usage, "completion_tokens"),
                      finish_reason=finish_reason)


def resolve_api_key(endpoint: EndpointConfig, secret_value: str | None = None) -> str | None:
    """The key to send: a Prefect Secret's value (resolved by the task layer and passed in), or
    the environment variable named by api_key_env; None for servers without authentication."""
    if secret_value is not None:
        return secret_value
    if endpoint.api_key_secret is not None:
        raise GenerateInputError(
            f"generate.endpoint.api_key_secret={endpoint.api_key_secret!r} is a Prefect Secret "
            "block, resolved only when the stage runs under Prefect (draftsmith run); outside "
            "Prefect set generate.endpoint.api_key_env to an environment variable instead")
    if endpoint.api_key_env is not None:
        value = os.environ.get(endpoint.api_key_env)
        if not value:
            raise GenerateInputError(
                f"generate.endpoint.api_key_env={endpoint.api_key_env!r}: that environment "
                "variable is not set (or empty); export it before the run")
        return value
    return None


def pick_partition(partitions: Sequence[Partition], prompt_tokens: int) -> int | None:
    """Index of the smallest partition that takes this prompt, or None when none does."""
    for index, partition in enumerate(partitions):
        if prompt_tokens <= partition.max_prompt_tokens:
            return index
    return None


class RequestProgress(Progress):
    """Requests/s, tokens/s and mean completion length, with an ETA from a recent window:
    completion lengths drift during a run (long answers tend to come last), and an average over
    the whole run would keep promising the early pace."""

    def __init__(self, total: int, window: int = 256, every_s: float = 5.0):
        super().__init__("generate", total=total, unit="request", every_s=every_s)
        self.answered_n = self.failed_n = self.tokens = 0
        self._recent: deque[float] = deque(maxlen=window)  # when each recent request ended

    def answered(self, completion_tokens: int) -> None:
        self.answered_n += 1
        self.tokens += completion_tokens
        self._finished()

    def failed(self) -> None:
        self.failed_n += 1
        self._finished()

    def _finished(self) -> None:
        now = time.monotonic()
        self._recent.append(now)
        elapsed = max(now - self.started, 1e-9)
        self.update(1, **{
            "tokens/s": f"{self.tokens / elapsed:.1f}",
            "mean completion": f"{self.tokens / max(self.answered_n, 1):.0f} tokens",
            "failed": self.failed_n,
        })

    @property
    def eta_s(self) -> float | None:
        if not self.total:
            return None
        if len(self._recent) < 2 or self._recent[-1] <= self._recent[0]:
            return super().eta_s
        recent_rate = (len(self._recent) - 1) / (self._recent[-1] - self._recent[0])
        return (self.total - self.done) / recent_rate


def _retryable(err: BaseException) -> bool:
    if isinstance(err, HTTPStatusFailure):
        return err.status in RETRYABLE_STATUS
    if isinstance(err, httpx.UnsupportedProtocol):  # base_url is not http(s): no retry helps
        return False
    # DecodingError: a body that does not decompress, garbled on the way like a bad JSON body.
    return isinstance(err, (MalformedReply, httpx.TimeoutException, httpx.TransportError,
                            httpx.DecodingError))


def _cause(err: BaseException) -> str:
    if isinstance(err, HTTPStatusFailure):
        return "http_status"
    if isinstance(err, (MalformedReply, httpx.DecodingError)):
        return "malformed_reply"
    if isinstance(err, httpx.TimeoutException):
        return "timeout"
    return "connection"


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    try:
        return min(float(value), 300.0) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


class _Backoff:
    """Exponential backoff with full jitter, but never sooner than the server's Retry-After."""

    def __init__(self, initial_s: float, max_s: float):
        self._jitter = wait_random_exponential(multiplier=initial_s, max=max_s)

    def __call__(self, state: RetryCallState) -> float:
        wait = self._jitter(state)
        err = state.outcome.exception() if state.outcome else None
        if isinstance(err, HTTPStatusFailure) and err.retry_after is not None:
            wait = max(wait, err.retry_after)
        return wait


def _describe(err: BaseException) -> str:
    if isinstance(err, HTTPStatusFailure):
        return str(err)
    if isinstance(err, MalformedReply):
        return f"malformed reply: {err}"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class OpenAIRegenerator:
    """Answers requests through one endpoint; journal every answer as it arrives."""

    def __init__(self, endpoint: EndpointConfig, journal: Journal, *, api_key: str | None,
                 temperature: float, top_p: float, seed: int,
                 backoff_initial_s: float = 1.0, backoff_max_s: float = 60.0,
                 progress_every_s: float = 5.0):
        self.endpoint, self.journal = endpoint, journal
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.backoff = _Backoff(backoff_initial_s, backoff_max_s)
        self.progress_every_s = progress_every_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = endpoint.base_url.rstrip("/") + "/chat/completions"

    def body(self, request: Request, partition: Partition) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.endpoint.model, "messages": request.messages,
                                "max_tokens": partition.max_tokens,
                                "temperature": self.temperature, "stream": False}
        if self.temperature > 0:
            body.update(top_p=self.top_p, seed=self.seed)
        return {**self.endpoint.extra_body, **body}  # draftsmith's own fields win

    async def _post(self, client: httpx.AsyncClient, request: Request,
                    partition: Partition) -> Answer:
        response = await client.post(self.url, json=self.body(request, partition),
                                     headers=self._headers)
        if response.status_code != 200:
            raise HTTPStatusFailure(response.status_code, response.text,
                                    _retry_after(response.headers))
        completion = parse_completion(response.content)
        return Answer(
            key=request.key, record_id=request.record_id, content=completion.content,
            reasoning=completion.reasoning,
            prompt_tokens=(completion.prompt_tokens if completion.prompt_tokens is not None
                           else request.prompt_tokens),
            completion_tokens=completion.completion_tokens or 0,
            finish_reason=completion.finish_reason)

    async def _answer(self, client: httpx.AsyncClient, request: Request, partition: Partition,
                      totals: RunTotals) -> Answer | Failure:
        attempts = 0

        def before_sleep(state: RetryCallState) -> None:
            totals.retries += 1
            err = state.outcome.exception() if state.outcome else None
            log.warning("generate: %s attempt %d failed (%s); retrying in %.1fs",
                        request.record_id, state.attempt_number, _describe(err)[:200],
                        state.next_action.sleep if state.next_action else 0.0)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.endpoint.max_retries + 1), wait=self.backoff,
            retry=retry_if_exception(_retryable), before_sleep=before_sleep, reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    return await self._post(client, request, partition)
        except (HTTPStatusFailure, MalformedReply, httpx.HTTPError) as err:
            return Failure(key=request.key, record_id=request.record_id, error=_describe(err),
                           attempts=attempts, retryable=_retryable(err), cause=_cause(err))
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    async def run(self, requests: Sequence[Request]) -> RunTotals:
        totals = RunTotals()
        partitions = self.endpoint.partitions
        queues: list[list[Request]] = [[] for _ in partitions]
        progress = RequestProgress(total=len(requests), every_s=self.progress_every_s)
        self.journal.start_attempt()
        for request in requests:
            index = pick_partition(partitions, request.prompt_tokens)
            if index is None:  # no retry can fix it; recorded, never sent
                self.journal.add_failure(Failure(
                    key=request.key, record_id=request.record_id, attempts=0, retryable=False,
                    cause="prompt_too_long",
                    error=f"prompt has {request.prompt_tokens} tokens, more than the largest "
                          f"partition's max_prompt_tokens={partitions[-1].max_prompt_tokens}"))
                totals.failed += 1
                progress.failed()
                continue
            queues[index].append(request)
        started = time.monotonic()
        limits = httpx.Limits(max_connections=sum(p.concurrency for p in partitions),
                              max_keepalive_connections=sum(p.concurrency for p in partitions))
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.endpoint.timeout_s),
                                     limits=limits) as client:

            async def worker(index: int, pending: deque[Request]) -> None:
                name = f"<= {partitions[index].max_prompt_tokens} prompt tokens"
                stats = totals.per_partition.setdefault(
                    name, {"requests": 0, "answered": 0, "failed": 0, "completion_tokens": 0})
                while pending:
                    request = pending.popleft()
                    stats["requests"] += 1
                    result = await self._answer(client, request, partitions[index], totals)
                    if isinstance(result, Failure):
                        self.journal.add_failure(result)
                        totals.failed += 1
                        stats["failed"] += 1
                        progress.failed()
                        log.error("generate: %s failed after %d attempt(s): %s",
                                  request.record_id, result.attempts, result.error[:300])
                        continue
                    self.journal.add_answer(result)  # durable before it counts as done
                    totals.answered += 1
                    totals.prompt_tokens += result.prompt_tokens
                    totals.completion_tokens += result.completion_tokens
                    totals.with_reasoning += result.reasoning is not None
                    stats["answered"] += 1
                    stats["completion_tokens"] += result.completion_tokens
                    progress.answered(result.completion_tokens)

            workers = []
            for index, queue in enumerate(queues):
                pending = deque(queue)
                workers += [worker(index, pending)
                            for _ in range(min(partitions[index].concurrency, len(queue)))]
            await asyncio.gather(*workers)
        totals.seconds = time.monotonic() - started
        progress.close()
        if totals.answered + totals.failed != len(requests):  # every request ends one way
            raise AssertionError(f"generate: {totals.answered} answered + {totals.failed} failed "
                                 f"!= {len(requests)} requests")
        return totals


def cost_usd(endpoint: EndpointConfig, prompt_tokens: int, completion_tokens: int
             ) -> float | None:
    """Cost from the configured prices per million tokens; None when no price is set."""
    if endpoint.price_per_1m_prompt_tokens is None and \
            endpoint.price_per_1m_completion_tokens is None:
        return None
    return (prompt_tokens * (endpoint.price_per_1m_prompt_tokens or 0.0)
            + completion_tokens * (endpoint.price_per_1m_completion_tokens or 0.0)) / 1e6
