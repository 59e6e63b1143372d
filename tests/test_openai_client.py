"""draftsmith.generate.openai_client without a server: partitions, cost, the ETA follows the
recent pace, Retry-After is honoured, key resolution. (tests/test_journal.py covers the answers
journal; tests/test_generate_http.py runs the client against a live server.)"""

from __future__ import annotations

import json

import pytest
from tenacity import RetryCallState

from draftsmith.config import EndpointConfig, Partition
from draftsmith.generate import openai_client
from draftsmith.generate.openai_client import (
    GenerateError,
    HTTPStatusFailure,
    RequestProgress,
    cost_usd,
    pick_partition,
    resolve_api_key,
)


def test_smallest_partition_that_takes_the_prompt():
    partitions = [Partition(max_prompt_tokens=100, concurrency=8, max_tokens=10),
                  Partition(max_prompt_tokens=1000, concurrency=2, max_tokens=20)]
    assert [pick_partition(partitions, n) for n in (1, 100, 101, 1000, 1001)] == [
        0, 0, 1, 1, None]


def test_cost_from_prices_per_million_tokens():
    endpoint = EndpointConfig(base_url="http://x/v1", model="m")
    assert cost_usd(endpoint, 10**6, 10**6) is None  # no price configured, no cost claimed
    priced = endpoint.model_copy(update={"price_per_1m_prompt_tokens": 0.5,
                                         "price_per_1m_completion_tokens": 2.0})
    assert cost_usd(priced, 2_000_000, 500_000) == pytest.approx(2.0)


def test_eta_follows_the_recent_pace_when_completions_grow(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(openai_client.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr("draftsmith.progress.time.monotonic", lambda: clock[0])
    progress = RequestProgress(total=1000, window=50, every_s=1e9)
    for _ in range(500):  # short answers: 10 requests a second
        clock[0] += 0.1
        progress.answered(20)
    assert progress.eta_s == pytest.approx(50.0, rel=0.01)
    for _ in range(100):  # answers grow: one request a second now
        clock[0] += 1.0
        progress.answered(200)
    # 400 left at the recent 1/s, not at the run's average of 600/150 = 4/s.
    assert progress.eta_s == pytest.approx(400.0, rel=0.01)
    assert progress.done / (clock[0]) == pytest.approx(4.0)
    message = progress.message()
    assert "ETA 6m40s" in message and "mean completion" in message and "tokens/s" in message


def test_backoff_never_undercuts_retry_after():
    backoff = openai_client._Backoff(initial_s=0.01, max_s=0.05)

    class Outcome:
        def __init__(self, err):
            self.err = err

        def exception(self):
            return self.err

    state = RetryCallState(None, None, (), {})
    state.attempt_number = 1
    state.outcome = Outcome(HTTPStatusFailure(429, "slow down", retry_after=7.0))
    assert backoff(state) == 7.0
    state.outcome = Outcome(HTTPStatusFailure(503, "busy", retry_after=None))
    assert 0 <= backoff(state) <= 0.05


@pytest.mark.parametrize(("status", "retried"), [(429, True), (500, True), (503, True),
                                                 (408, True), (400, False), (401, False),
                                                 (404, False)])
def test_which_statuses_are_retried(status, retried):
    assert openai_client._retryable(HTTPStatusFailure(status, "", None)) is retried


def test_api_key_resolution(monkeypatch):
    endpoint = EndpointConfig(base_url="http://x/v1", model="m")
    assert resolve_api_key(endpoint) is None
    with_env = endpoint.model_copy(update={"api_key_env": "DRAFTSMITH_K"})
    monkeypatch.setenv("DRAFTSMITH_K", "v1")
    assert resolve_api_key(with_env) == "v1"
    with_secret = endpoint.model_copy(update={"api_key_secret": "blk"})
    assert resolve_api_key(with_secret, secret_value="from-block") == "from-block"
    with pytest.raises(GenerateError, match="Prefect Secret block.*api_key_env"):
        resolve_api_key(with_secret)  # outside Prefect nothing resolves the block


def test_a_completion_body_is_read_only_when_it_has_text():
    from draftsmith.generate.openai_client import MalformedReply, parse_completion

    def body(message, **extra):
        return json.dumps({"choices": [{"message": message, "finish_reason": "stop"}], **extra})

    empty = parse_completion(body({"role": "assistant", "content": ""}))
    assert (empty.content, empty.prompt_tokens, empty.completion_tokens) == ("", None, None)
    thought = parse_completion(body({"content": "4", "reasoning_content": "",
                                     "reasoning": "two and two"},
                                    usage={"prompt_tokens": 7, "completion_tokens": 1}))
    assert (thought.reasoning, thought.prompt_tokens, thought.completion_tokens) == (
        "two and two", 7, 1)
    for bad, why in [('{"choices": [', "not JSON"), (body({"content": None}), "null"),
                     (body({"content": "x"}, usage={"completion_tokens": -1}), "usage"),
                     (json.dumps({"choices": None}), "choices is missing")]:
        with pytest.raises(MalformedReply, match=why):
            parse_completion(bad)
