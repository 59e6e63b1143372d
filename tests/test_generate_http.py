"""Regeneration over HTTP against a real OpenAI-compatible server: the session's `vllm serve` of
the trained tiny target (tests/vllm_chain.py, 127.0.0.1), whose granite reasoning parser fills
vLLM's `reasoning` field. A proxy (tests/openai_server.py) sits in front of it: it counts
requests in flight and answers per prompt, and injects only the faults a healthy server does
not produce (429/503 bursts, a hung request, an outage, a key check).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from draftsmith.artifacts import plan_stage
from draftsmith.config import DataConfig, GenerateConfig, TargetConfig
from draftsmith.generate.openai_client import GenerateError
from draftsmith.generate.stage import journal_dir, run_generate
from tests.openai_server import FaultProxy, prompt_key

# The first test that needs the shared vLLM server may build its chain and start it.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SHORT_MAX_TOKENS, LONG_MAX_TOKENS = 5, 9


@pytest.fixture()
def proxy(vllm_server):
    fault_proxy = FaultProxy(vllm_server.figures["url"])
    yield fault_proxy
    fault_proxy.close()


@pytest.fixture()
def served_target(vllm_chain):
    """The target vLLM serves (its descriptor, as the stage gets it)."""
    return vllm_chain.target


@pytest.fixture()
def served_target_dir(vllm_chain) -> Path:
    return Path(vllm_chain.target.path)


@pytest.fixture()
def served_tokenizer(vllm_chain):
    from draftsmith.target import load_tokenizer

    return load_tokenizer(vllm_chain.target)


def write_prompts(path: Path, n: int, long_every: int = 0) -> Path:
    rows = []
    for i in range(n):
        prompt = f"Complete this function from m{i}.py:\ndef f{i}(x):"
        if long_every and i % long_every == 0:
            prompt += " return x" * 40  # past the short partition's prompt length
        rows.append({"id": f"p{i}", "prompt": prompt})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate_cfg(proxy: FaultProxy, model_dir: Path, **endpoint) -> GenerateConfig:
    return GenerateConfig(backend="openai", endpoint={
        "base_url": proxy.url, "model": str(model_dir), "timeout_s": 60, "max_retries": 3,
        "partitions": [
            {"max_prompt_tokens": 64, "concurrency": 3, "max_tokens": SHORT_MAX_TOKENS},
            {"max_prompt_tokens": 4096, "concurrency": 1, "max_tokens": LONG_MAX_TOKENS}],
        **endpoint})


def run(cfg, data_path, served_target, served_target_dir, root, name="p", **kwargs):
    data = DataConfig(sources=[{"name": name, "path": str(data_path)}])
    plan = plan_stage(root, "generate", {"run": str(root)}, [served_target])
    descriptor = run_generate(cfg, data, TargetConfig(model=str(served_target_dir)),
                              served_target, plan, backoff_initial_s=0.05, backoff_max_s=0.2,
                              **kwargs)
    return descriptor, plan


def journal_of(plan, cfg, data_path, target, name="p") -> Path:
    """The answer journal of source `name` (kept after the stage: the per-source cache)."""
    from draftsmith.config import DataSource

    return journal_dir(plan, cfg, DataSource(name=name, path=str(data_path)), target)


def records_of(descriptor) -> list[dict]:
    return [json.loads(line) for line in
            (descriptor.dir / "records.jsonl").read_text().splitlines()]


def test_regenerates_every_prompt_with_partitions_tokens_and_cost(
        proxy, served_target, served_target_dir, tmp_path, caplog):
    data_path = write_prompts(tmp_path / "prompts.jsonl", 10, long_every=4)  # p0, p4, p8 long
    cfg = generate_cfg(proxy, served_target_dir, price_per_1m_prompt_tokens=2.0,
                       price_per_1m_completion_tokens=8.0)
    with caplog.at_level(logging.INFO, logger="draftsmith"):
        descriptor, plan = run(cfg, data_path, served_target, served_target_dir, tmp_path)

    records = records_of(descriptor)
    assert [r["id"] for r in records] == [f"p/p{i}" for i in range(10)]  # input order
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in records)
    # The answers are the target's own: vLLM's greedy answer is what transformers decodes.
    import torch

    from draftsmith.serve.deploy import prompt_ids
    from draftsmith.target import load_target_model, load_tokenizer

    tokenizer = load_tokenizer(served_target)
    model = load_target_model(served_target.path)
    for record in (records[1], records[4]):
        prompt = prompt_ids(tokenizer, json.dumps(record["messages"]))
        budget = LONG_MAX_TOKENS if record["id"] == "p/p4" else SHORT_MAX_TOKENS
        out = model.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False)
        expected = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
        assert record["messages"][-1]["content"] == expected, record["id"]
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["requests"] == summary["answered"] == 10 and summary["failed"] == 0
    # Each partition's completion budget reached the server; short prompts ran 3 at a time at
    # most, long ones one at a time.
    partitions = summary["per_partition"]
    assert partitions["<= 64 prompt tokens"]["answered"] == 7
    assert partitions["<= 4096 prompt tokens"]["answered"] == 3
    assert set(proxy.max_in_flight) == {SHORT_MAX_TOKENS, LONG_MAX_TOKENS}
    assert proxy.max_in_flight[SHORT_MAX_TOKENS] <= 3
    assert proxy.max_in_flight[LONG_MAX_TOKENS] == 1
    assert 0 < partitions["<= 64 prompt tokens"]["completion_tokens"] <= 7 * SHORT_MAX_TOKENS
    # Token totals are the server's usage figures; the cost follows from the prices.
    counts = descriptor.counts
    assert counts["prompt_tokens"] > 10 * 10 and counts["completion_tokens"] > 0
    expected = (counts["prompt_tokens"] * 2.0 + counts["completion_tokens"] * 8.0) / 1e6
    assert descriptor.figures["cost_usd"] == pytest.approx(expected, rel=1e-6)
    assert summary["mean_completion_tokens"] == pytest.approx(
        counts["completion_tokens"] / 10, abs=0.1)
    assert descriptor.figures["tokens_per_s"] > 0 and descriptor.figures["requests_per_s"] > 0
    progress = [r.getMessage() for r in caplog.records if r.name == "draftsmith.progress"]
    assert any("request/s" in m and "tokens/s" in m and "mean completion" in m
               for m in progress)
    assert any("cost $" in r.getMessage() for r in caplog.records)
    # The journal stays, the source's answer cache: a rerun with the same prompts asks nothing.
    journal = journal_of(plan, cfg, data_path, served_target) / "answers.jsonl"
    assert len(journal.read_text().splitlines()) == 10
    assert proxy.auth_headers and set(proxy.auth_headers) == {None}  # no key configured


def test_429_and_503_are_retried_with_backoff(proxy, served_target, served_target_dir,
                                              tmp_path, caplog):
    proxy.fail_next.extend([(429, {"Retry-After": "0"}), (503, {}), (500, {})])
    data_path = write_prompts(tmp_path / "prompts.jsonl", 4)
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        descriptor, _ = run(generate_cfg(proxy, served_target_dir), data_path, served_target,
                            served_target_dir, tmp_path)
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["answered"] == 4 and summary["failed"] == 0
    assert summary["retries_this_attempt"] == 3
    assert not (descriptor.dir / "errors.jsonl").exists()
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "HTTP 429" in warnings and "HTTP 503" in warnings and "retrying in" in warnings
    assert sum(proxy.answers.values()) == 4  # no prompt answered twice


def test_a_garbled_reply_of_the_real_server_is_retried_without_disturbing_the_batch(
        proxy, served_target, served_target_dir, tmp_path, caplog):
    """vLLM's own replies, cut short and with their content nulled on the way back, in the
    middle of a batch: each is one failed attempt of its request, retried; the stage neither
    aborts nor stores an empty answer."""
    data_path = write_prompts(tmp_path / "prompts.jsonl", 8)
    cfg = generate_cfg(proxy, served_target_dir)

    def garble(answered: int) -> None:
        if answered == 2:  # two healthy answers are in, more are in flight
            proxy.garble_next.extend(["truncate", "null_content"])

    proxy.after_answer = garble
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        descriptor, _ = run(cfg, data_path, served_target, served_target_dir, tmp_path)
    assert proxy.garbled == 2
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert (summary["answered"], summary["failed"], summary["retries_this_attempt"]) == (8, 0, 2)
    assert "is not JSON" in caplog.text and "content is null" in caplog.text
    records = records_of(descriptor)
    assert sorted(r["id"] for r in records) == sorted(f"p/p{i}" for i in range(8))
    assert all(r["messages"][-1]["content"] for r in records)  # no empty turn stored


def test_a_hung_request_times_out_and_is_retried(proxy, served_target, served_target_dir,
                                                 tmp_path, caplog):
    # The hung request is held far longer than the timeout, and the timeout far longer than
    # a healthy answer takes on a busy machine, so only the hung one times out.
    proxy.stall_next.append(120.0)
    data_path = write_prompts(tmp_path / "prompts.jsonl", 2)
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        descriptor, _ = run(generate_cfg(proxy, served_target_dir, timeout_s=15.0), data_path,
                            served_target, served_target_dir, tmp_path)
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["answered"] == 2 and summary["retries_this_attempt"] == 1
    assert "ReadTimeout" in caplog.text


def test_a_request_failing_every_retry_goes_to_the_error_file_never_to_the_data(
        proxy, served_target, served_target_dir, tmp_path):
    proxy.always_fail["def f2(x)"] = 503
    data_path = write_prompts(tmp_path / "prompts.jsonl", 5)
    cfg = generate_cfg(proxy, served_target_dir, max_retries=2)
    with pytest.raises(GenerateError) as info:
        run(cfg, data_path, served_target, served_target_dir, tmp_path)
    message = str(info.value)
    assert "1 of 5 requests failed" in message and "p/p2" in message and "HTTP 503" in message
    assert "max_failure_rate" in message and "errors.jsonl" in message
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [served_target])
    errors = [json.loads(line) for line in
              (journal_of(plan, cfg, data_path, served_target) / "errors.jsonl")
              .read_text().splitlines()]
    assert [(e["record_id"], e["attempts"], e["retryable"]) for e in errors] == [
        ("p/p2", 3, True)]  # the first try and max_retries=2 more

    # Tolerated failures: the stage finishes without the failed record and keeps the error.
    cfg = cfg.model_copy(update={"max_failure_rate": 0.25})
    descriptor, _ = run(cfg, data_path, served_target, served_target_dir, tmp_path)
    assert [r["id"] for r in records_of(descriptor)] == ["p/p0", "p/p1", "p/p3", "p/p4"]
    assert descriptor.counts["failed"] == 1
    kept_errors = (descriptor.dir / "errors.jsonl").read_text()
    assert "p/p2" in kept_errors and "def f2" not in kept_errors  # ids, not prompts
    # The other four were answered once, in the first attempt, and not asked again.
    assert all(proxy.answers[k] == 1 for k in proxy.answers) and len(proxy.answers) == 4


def test_a_client_error_is_not_retried(proxy, served_target, served_target_dir, tmp_path):
    data_path = write_prompts(tmp_path / "prompts.jsonl", 2)
    cfg = generate_cfg(proxy, served_target_dir, model="not-the-served-model")
    with pytest.raises(GenerateError, match="2 of 2 requests failed"):
        run(cfg, data_path, served_target, served_target_dir, tmp_path)
    assert proxy.requests == 2  # one each: a 4xx other than 429 does not get better


# vLLM's granite parser splits an answer at "Here is my thought process:" / "Here is my
# response:"; a structured-output regex (a real vLLM request field) makes the tiny target
# answer in that shape, so the parser fills vLLM's `reasoning` field for real.
THOUGHT, RESPONSE = "Here is my thought process:", "Here is my response:"


def test_reasoning_vllm_parses_is_captured_counted_and_reassembled_before_the_answer(
        proxy, served_target, served_target_dir, served_tokenizer, tmp_path):
    from draftsmith.data.formats import Record
    from draftsmith.data.tokenize import tokenize_record

    data_path = write_prompts(tmp_path / "prompts.jsonl", 3)
    cfg = generate_cfg(proxy, served_target_dir, extra_body={"structured_outputs": {
        "regex": f"{THOUGHT} [a-z]{{2,12}}\\. {RESPONSE} [a-z]{{2,12}}\\."}})
    cfg.endpoint.partitions = [cfg.endpoint.partitions[1].model_copy(
        update={"max_tokens": 64, "concurrency": 3})]
    descriptor, _ = run(cfg, data_path, served_target, served_target_dir, tmp_path)
    assert descriptor.counts["with_reasoning"] == 3
    record = Record.model_validate(records_of(descriptor)[1])
    answer = record.messages[-1]
    # What vLLM's parser cut out: the thought without its marker, the response after its own.
    assert answer.reasoning and THOUGHT not in answer.reasoning
    assert answer.reasoning.strip().endswith(".")  # the thought, up to the response marker
    assert answer.content and RESPONSE not in answer.content
    ids, mask = tokenize_record(served_tokenizer, record)
    masked = [t for t, m in zip(ids, mask, strict=True) if m]
    assert served_tokenizer.decode(masked, skip_special_tokens=False) == (
        f"<think>\n{answer.reasoning}\n</think>\n\n{answer.content}<|im_end|>")


def test_think_tags_in_content_without_reasoning_are_warned_about(
        proxy, served_target, served_target_dir, tmp_path, caplog):
    """A reasoning model served without a reasoning parser (SGLang fills reasoning_content
    only with --reasoning-parser): the think text lands in the answers' content."""
    import json

    proxy.think_in_content = True
    data_path = write_prompts(tmp_path / "prompts.jsonl", 3)
    with caplog.at_level("WARNING", logger="draftsmith.generate.stage"):
        descriptor, _ = run(generate_cfg(proxy, served_target_dir), data_path, served_target,
                            served_target_dir, tmp_path)
    warning = next(r.getMessage() for r in caplog.records if "think tags" in r.getMessage())
    assert "3 of 3 answers" in warning and "--reasoning-parser" in warning
    assert "kimi_k2" in warning
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["think_tags_without_reasoning"] == 3
    caplog.clear()
    proxy.reset()
    proxy.add_reasoning = True  # with a parser: no warning
    data_path = write_prompts(tmp_path / "more.jsonl", 2)
    with caplog.at_level("WARNING", logger="draftsmith.generate.stage"):
        run(generate_cfg(proxy, served_target_dir), data_path, served_target,
            served_target_dir, tmp_path / "second")
    assert not any("think tags" in r.getMessage() for r in caplog.records)


def test_api_key_comes_from_the_environment_and_never_reaches_logs_or_files(
        proxy, served_target, served_target_dir, tmp_path, caplog, monkeypatch):
    secret = "sk-draftsmith-test-7f3a9c"
    proxy.required_key = secret
    data_path = write_prompts(tmp_path / "prompts.jsonl", 3)
    cfg = generate_cfg(proxy, served_target_dir, api_key_env="DRAFTSMITH_TEST_KEY")
    with pytest.raises(GenerateError, match="DRAFTSMITH_TEST_KEY.*not set"):
        run(cfg, data_path, served_target, served_target_dir, tmp_path / "unset")
    monkeypatch.setenv("DRAFTSMITH_TEST_KEY", secret)
    proxy.fail_next.append((503, {}))  # a retry logs a warning: it must not carry the key
    with caplog.at_level(logging.DEBUG):  # every logger, httpx and httpcore included
        descriptor, _ = run(cfg, data_path, served_target, served_target_dir, tmp_path)
    assert descriptor.counts["generated"] == 3
    assert proxy.auth_headers.count(f"Bearer {secret}") == 4
    assert secret not in caplog.text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path


def test_server_gone_mid_run_then_back_every_prompt_answered_exactly_once(
        proxy, served_target, served_target_dir, tmp_path):
    """An outage after four answers (the proxy answers 502, as a gateway does when the server
    behind it died): the run fails with what it has journaled; once the server is back, the
    rerun asks only for the rest."""
    n = 12
    data_path = write_prompts(tmp_path / "prompts.jsonl", n)
    cfg = generate_cfg(proxy, served_target_dir, max_retries=1)

    def crash(answered: int) -> None:
        if answered == 4:
            proxy.down = True

    proxy.after_answer = crash
    with pytest.raises(GenerateError, match=r"requests failed after every retry"):
        run(cfg, data_path, served_target, served_target_dir, tmp_path)
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [served_target])
    journaled = [json.loads(line) for line in
                 (journal_of(plan, cfg, data_path, served_target) / "answers.jsonl")
                 .read_text().splitlines()]
    assert len(journaled) >= 4 and len({a["key"] for a in journaled}) == len(journaled)
    assert not plan.is_complete()

    proxy.down, proxy.after_answer = False, None
    descriptor, _ = run(cfg, data_path, served_target, served_target_dir, tmp_path)
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["answered_before"] == len(journaled)
    assert summary["answered_this_attempt"] == n - len(journaled)
    records = records_of(descriptor)
    assert sorted(r["id"] for r in records) == sorted(f"p/p{i}" for i in range(n))
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)
    # Across the failed run and the rerun, the server answered each prompt exactly once.
    assert len(proxy.answers) == n and set(proxy.answers.values()) == {1}
    sent = {prompt_key({"messages": [{"role": "user", "content": r["messages"][0]["content"]}]})
            for r in records}
    assert sent == set(proxy.answers)


def test_prefect_secret_block_key_is_sent_and_stays_out_of_prefect(
        prefect_api, proxy, served_target, served_target_dir, tmp_path):
    """The task layer resolves generate.endpoint.api_key_secret: the key reaches the server,
    and neither the run's logs, task parameters nor artifacts hold it."""
    from prefect import flow
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogWorker

    from draftsmith import stages
    from draftsmith.config import PipelineConfig
    from tasks.stages import task_for

    secret = "sk-prefect-secret-5d1e77"
    proxy.required_key = secret
    cfg = generate_cfg(proxy, served_target_dir, api_key_secret="draftsmith-test-key")
    data = DataConfig(sources=[{"name": "p", "path": str(write_prompts(tmp_path / "p.jsonl",
                                                                       3))}])
    config = PipelineConfig(name="secret-test", run_root=str(tmp_path), generate=cfg, data=data,
                            target=TargetConfig(model=str(served_target_dir)))
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [served_target])

    @flow
    def regenerate():
        return task_for(stages.get("generate"))(plan, config, {"target": served_target})

    Secret(value=secret).save("draftsmith-test-key", overwrite=True)
    state = regenerate(return_state=True)
    descriptor = state.result()
    APILogWorker.drain_all(timeout=10)
    # The session's API holds other tests' runs too: read this flow run's.
    this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        logs = [log.message for log in client.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))]
        runs = [run.model_dump(mode="json") for run in client.read_task_runs(
            flow_run_filter=this_run)]
        artifacts = [a.model_dump(mode="json") for a in client.read_artifacts(
            flow_run_filter=this_run)]
    assert descriptor.counts["generated"] == 3
    assert proxy.auth_headers == [f"Bearer {secret}"] * 3
    assert any(m.startswith("generate summary") for m in logs)  # the logs did arrive
    assert {a["key"] for a in artifacts} >= {"draftsmith-secret-test-generate-sources",
                                             "draftsmith-secret-test-generate-summary",
                                             "draftsmith-secret-test-generate-progress"}
    assert secret not in json.dumps([logs, runs, artifacts])
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path


def test_client_killed_mid_run_resumes_from_its_journal(proxy, served_target, served_target_dir,
                                                         tmp_path):
    """kill -9 of draftsmith itself (a VM crash) right after an answer arrives: the rerun asks
    only for what the journal lacks, and every prompt ends up in the data exactly once."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    n, concurrency = 10, 3
    data_path = write_prompts(tmp_path / "prompts.jsonl", n)
    cfg = generate_cfg(proxy, served_target_dir)
    data = DataConfig(sources=[{"name": "p", "path": str(data_path)}])
    target_cfg = TargetConfig(model=str(served_target_dir))
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [served_target])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"generate": cfg.model_dump(mode="json"),
                                "data": data.model_dump(mode="json"),
                                "target_cfg": target_cfg.model_dump(mode="json"),
                                "target": served_target.model_dump(mode="json"),
                                "plan": plan.model_dump(mode="json")}))
    child = subprocess.Popen([sys.executable, str(REPO / "tests" / "generate_child.py"),
                              str(spec)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})

    def crash(answered: int) -> None:
        if answered == 4:
            os.kill(child.pid, signal.SIGKILL)

    proxy.after_answer = crash
    assert child.wait(timeout=300) == -signal.SIGKILL
    proxy.after_answer = None
    journaled = list(json.loads(line)["key"] for line in
                     (journal_of(plan, cfg, data_path, served_target) / "answers.jsonl")
                     .read_text().splitlines() if line.endswith("}"))
    # Answers 1..3 arrived well before the crash; a starved client may not have written all.
    assert 1 <= len(journaled) <= 4 + concurrency and len(set(journaled)) == len(journaled)

    descriptor = run_generate(cfg, data, target_cfg, served_target, plan,
                              backoff_initial_s=0.05, backoff_max_s=0.2)
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["answered_before"] == len(journaled)
    assert summary["answered_before"] + summary["answered_this_attempt"] == n
    ids = [r["id"] for r in records_of(descriptor)]
    assert ids == [f"p/p{i}" for i in range(n)]
    # Only answers that arrived but were not yet journaled when the process died are asked
    # for twice: at most the requests in flight then.
    assert len(proxy.answers) == n
    assert sum(proxy.answers.values()) - n <= concurrency


def test_generate_max_new_tokens_is_the_budget_of_partitions_that_set_none(
        proxy, served_target, served_target_dir, tmp_path):
    """Without it a server applies its own limit (a mean of 538 tokens against 96 set)."""
    data_path = write_prompts(tmp_path / "prompts.jsonl", 4, long_every=2)
    cfg = GenerateConfig(backend="openai", max_new_tokens=7, endpoint={
        "base_url": proxy.url, "model": str(served_target_dir), "timeout_s": 60,
        "partitions": [{"max_prompt_tokens": 64, "concurrency": 2},  # no max_tokens: 7
                       {"max_prompt_tokens": 4096, "concurrency": 1,
                        "max_tokens": LONG_MAX_TOKENS}]})
    descriptor, _ = run(cfg, data_path, served_target, served_target_dir, tmp_path)
    assert set(proxy.max_in_flight) == {7, LONG_MAX_TOKENS}
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["per_partition"]["<= 64 prompt tokens"]["completion_tokens"] <= 2 * 7
    assert summary["seconds_this_attempt"] > 0 and summary["tokens_per_s"] > 0


def test_generation_is_keyed_per_source_only_a_changed_source_is_asked(
        proxy, served_target, served_target_dir, tmp_path):
    """Two sources; the second gains a record: the next run (a new stage key: its data
    changed) asks the server for that record alone, and reads every other answer from the
    sources' journals."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_prompts(first, 3)

    def write_second(n: int) -> None:  # prompts of its own (the proxy counts by prompt)
        second.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Explain b{i}."}) + "\n"
                                  for i in range(n)))

    write_second(3)
    cfg = generate_cfg(proxy, served_target_dir)
    data = DataConfig(sources=[{"name": "a", "path": str(first)},
                               {"name": "b", "path": str(second)}])

    def generate(version: str):
        plan = plan_stage(tmp_path, "generate", {"data": version}, [served_target])
        return run_generate(cfg, data, TargetConfig(model=str(served_target_dir)),
                            served_target, plan)

    generate("before")
    assert len(proxy.answers) == 6
    write_second(4)  # b/p3 is new; the other records are as they were
    descriptor = generate("after")
    assert len(proxy.answers) == 7 and set(proxy.answers.values()) == {1}
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["per_source"] == {
        "a": {"requests": 3, "answered_before": 3, "answered_this_attempt": 0},
        "b": {"requests": 4, "answered_before": 3, "answered_this_attempt": 1}}
    assert [r["id"] for r in records_of(descriptor)] == [
        "a/p0", "a/p1", "a/p2", "b/p0", "b/p1", "b/p2", "b/p3"]
    # Other generate settings are another journal: everything is asked again.
    cfg = cfg.model_copy(update={"max_new_tokens": 9})
    generate("new settings")
    assert len(proxy.answers) == 7 and sum(proxy.answers.values()) == 14


WRITTEN = 40


def test_the_target_writes_prompts_through_the_server_and_resumes(
        vllm_server, served_target, served_target_dir, tmp_path):
    """A `synthesize:` source with backend openai: the real vLLM server continues the chat
    template's user turn (token ids, /v1/completions), one seed per prompt; a run cut off
    part-way asks only for the prompts its journal lacks, and keeps the ones written."""
    from draftsmith.generate.synthesize import read_journal

    cfg = GenerateConfig(backend="openai", max_new_tokens=4, endpoint={
        "base_url": vllm_server.figures["url"] + "/v1", "model": str(served_target_dir),
        "timeout_s": 60, "partitions": [{"max_prompt_tokens": 4096, "concurrency": 4}]})
    # The tiny target ends about one user turn in ten within 96 tokens, and sampled
    # continuations differ with the server's batching: 40 prompts of up to 160 tokens keep
    # some (at 12 of 24 tokens, CI once kept none).
    data = DataConfig(sources=[{"name": "w", "synthesize": {"prompts": WRITTEN,
                                                            "max_prompt_tokens": 160}}])
    target = TargetConfig(model=str(served_target_dir))
    first = run_generate(cfg, data, target, served_target,
                         plan_stage(tmp_path, "generate", {"n": 1}, [served_target]))
    journal = next((tmp_path / "generate" / "prompts").glob("w-*/written.jsonl"))
    written = read_journal(journal)
    assert sorted(written) == list(range(WRITTEN))
    assert {e["finish_reason"] for e in written.values()} <= {"stop", "length"}
    kept = json.loads((first.dir / "stats.json").read_text())[0]["kept"]
    assert kept == first.counts["generated"] and kept >= 1

    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:5]) + lines[5][:7])  # cut off mid-line
    run_generate(cfg, data, target, served_target,
                 plan_stage(tmp_path, "generate", {"n": 2}, [served_target]))
    again = read_journal(journal)
    assert sorted(again) == list(range(WRITTEN))
    kept_before = [json.loads(line)["index"] for line in lines[:5]]
    assert all(again[i] == written[i] for i in kept_before)
