"""Regeneration over HTTP against a real OpenAI-compatible server: `transformers serve` with the
random tiny target on a loopback port, offline, one server for the module. A fault-injecting
proxy (tests/openai_server.py) sits in front of it for the retry, error, key and reasoning
tests; the kill test kills the server itself with SIGKILL mid-run.
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
from tests.openai_server import FaultProxy, ServeProcess, prompt_key

SHORT_MAX_TOKENS, LONG_MAX_TOKENS = 5, 9


@pytest.fixture(scope="module")
def server(random_target_dir, tmp_path_factory):
    serve = ServeProcess(random_target_dir, tmp_path_factory.mktemp("serve") / "serve.log")
    serve.start()
    yield serve
    serve.kill()


@pytest.fixture()
def proxy(server):
    if not server.alive():  # a test that killed it must not take the others down with it
        server.start()
    fault_proxy = FaultProxy(server.url)
    yield fault_proxy
    fault_proxy.close()


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


def run(cfg, data_path, random_target, random_target_dir, root, name="p", **kwargs):
    data = DataConfig(sources=[{"name": name, "path": str(data_path)}])
    plan = plan_stage(root, "generate", {"run": str(root)}, [random_target])
    descriptor = run_generate(cfg, data, TargetConfig(model=str(random_target_dir)),
                              random_target, plan, backoff_initial_s=0.05, backoff_max_s=0.2,
                              **kwargs)
    return descriptor, plan


def records_of(descriptor) -> list[dict]:
    return [json.loads(line) for line in
            (descriptor.dir / "records.jsonl").read_text().splitlines()]


def test_regenerates_every_prompt_with_partitions_tokens_and_cost(
        proxy, random_target, random_target_dir, tmp_path, caplog):
    data_path = write_prompts(tmp_path / "prompts.jsonl", 10, long_every=4)  # p0, p4, p8 long
    cfg = generate_cfg(proxy, random_target_dir, price_per_1m_prompt_tokens=2.0,
                       price_per_1m_completion_tokens=8.0)
    with caplog.at_level(logging.INFO, logger="draftsmith"):
        descriptor, plan = run(cfg, data_path, random_target, random_target_dir, tmp_path)

    records = records_of(descriptor)
    assert [r["id"] for r in records] == [f"p/p{i}" for i in range(10)]  # input order
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in records)
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
    assert not journal_dir(plan).exists()  # its answers live in the finished directory now
    assert proxy.auth_headers and set(proxy.auth_headers) == {None}  # no key configured


def test_429_and_503_are_retried_with_backoff(proxy, random_target, random_target_dir,
                                              tmp_path, caplog):
    proxy.fail_next.extend([(429, {"Retry-After": "0"}), (503, {}), (500, {})])
    data_path = write_prompts(tmp_path / "prompts.jsonl", 4)
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        descriptor, _ = run(generate_cfg(proxy, random_target_dir), data_path, random_target,
                            random_target_dir, tmp_path)
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["answered"] == 4 and summary["failed"] == 0
    assert summary["retries_this_attempt"] == 3
    assert not (descriptor.dir / "errors.jsonl").exists()
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "HTTP 429" in warnings and "HTTP 503" in warnings and "retrying in" in warnings
    assert sum(proxy.answers.values()) == 4  # no prompt answered twice


def test_a_hung_request_times_out_and_is_retried(proxy, random_target, random_target_dir,
                                                 tmp_path, caplog):
    proxy.stall_next.append(4.0)
    data_path = write_prompts(tmp_path / "prompts.jsonl", 2)
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        descriptor, _ = run(generate_cfg(proxy, random_target_dir, timeout_s=1.0), data_path,
                            random_target, random_target_dir, tmp_path)
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["answered"] == 2 and summary["retries_this_attempt"] == 1
    assert "ReadTimeout" in caplog.text


def test_a_request_failing_every_retry_goes_to_the_error_file_never_to_the_data(
        proxy, random_target, random_target_dir, tmp_path):
    proxy.always_fail["def f2(x)"] = 503
    data_path = write_prompts(tmp_path / "prompts.jsonl", 5)
    cfg = generate_cfg(proxy, random_target_dir, max_retries=2)
    with pytest.raises(GenerateError) as info:
        run(cfg, data_path, random_target, random_target_dir, tmp_path)
    message = str(info.value)
    assert "1 of 5 requests failed" in message and "p/p2" in message and "HTTP 503" in message
    assert "max_failure_rate" in message and "errors.jsonl" in message
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [random_target])
    errors = [json.loads(line) for line in
              (journal_dir(plan) / "errors.jsonl").read_text().splitlines()]
    assert [(e["record_id"], e["attempts"], e["retryable"]) for e in errors] == [
        ("p/p2", 3, True)]  # the first try and max_retries=2 more

    # Tolerated failures: the stage finishes without the failed record and keeps the error.
    cfg = cfg.model_copy(update={"max_failure_rate": 0.25})
    descriptor, _ = run(cfg, data_path, random_target, random_target_dir, tmp_path)
    assert [r["id"] for r in records_of(descriptor)] == ["p/p0", "p/p1", "p/p3", "p/p4"]
    assert descriptor.counts["failed"] == 1
    kept_errors = (descriptor.dir / "errors.jsonl").read_text()
    assert "p/p2" in kept_errors and "def f2" not in kept_errors  # ids, not prompts
    # The other four were answered once, in the first attempt, and not asked again.
    assert all(proxy.answers[k] == 1 for k in proxy.answers) and len(proxy.answers) == 4


def test_a_client_error_is_not_retried(proxy, random_target, random_target_dir, tmp_path):
    data_path = write_prompts(tmp_path / "prompts.jsonl", 2)
    cfg = generate_cfg(proxy, random_target_dir, model="not-the-served-model")
    with pytest.raises(GenerateError, match="2 of 2 requests failed"):
        run(cfg, data_path, random_target, random_target_dir, tmp_path)
    assert proxy.requests == 2  # one each: a 4xx other than 429 does not get better


def test_reasoning_is_captured_counted_and_reassembled_before_the_answer(
        proxy, random_target, random_target_dir, random_target_tokenizer, tmp_path):
    from draftsmith.data.formats import Record
    from draftsmith.data.tokenize import tokenize_record

    proxy.add_reasoning = True
    data_path = write_prompts(tmp_path / "prompts.jsonl", 3)
    descriptor, _ = run(generate_cfg(proxy, random_target_dir), data_path, random_target,
                        random_target_dir, tmp_path)
    assert descriptor.counts["with_reasoning"] == 3
    record = Record.model_validate(records_of(descriptor)[1])
    answer = record.messages[-1]
    assert answer.reasoning == "thinking about: " + record.messages[0].content[-24:]
    ids, mask = tokenize_record(random_target_tokenizer, record)
    masked = [t for t, m in zip(ids, mask, strict=True) if m]
    assert random_target_tokenizer.decode(masked, skip_special_tokens=False) == (
        f"<think>\n{answer.reasoning}\n</think>\n\n{answer.content}<|im_end|>")


def test_think_tags_in_content_without_reasoning_are_warned_about(
        proxy, random_target, random_target_dir, tmp_path, caplog):
    """A reasoning model served without a reasoning parser (SGLang fills reasoning_content
    only with --reasoning-parser): the think text lands in the answers' content."""
    import json

    proxy.think_in_content = True
    data_path = write_prompts(tmp_path / "prompts.jsonl", 3)
    with caplog.at_level("WARNING", logger="draftsmith.generate.stage"):
        descriptor, _ = run(generate_cfg(proxy, random_target_dir), data_path, random_target,
                            random_target_dir, tmp_path)
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
        run(generate_cfg(proxy, random_target_dir), data_path, random_target,
            random_target_dir, tmp_path / "second")
    assert not any("think tags" in r.getMessage() for r in caplog.records)


def test_api_key_comes_from_the_environment_and_never_reaches_logs_or_files(
        proxy, random_target, random_target_dir, tmp_path, caplog, monkeypatch):
    secret = "sk-draftsmith-test-7f3a9c"
    proxy.required_key = secret
    data_path = write_prompts(tmp_path / "prompts.jsonl", 3)
    cfg = generate_cfg(proxy, random_target_dir, api_key_env="DRAFTSMITH_TEST_KEY")
    with pytest.raises(GenerateError, match="DRAFTSMITH_TEST_KEY.*not set"):
        run(cfg, data_path, random_target, random_target_dir, tmp_path / "unset")
    monkeypatch.setenv("DRAFTSMITH_TEST_KEY", secret)
    proxy.fail_next.append((503, {}))  # a retry logs a warning: it must not carry the key
    with caplog.at_level(logging.DEBUG):  # every logger, httpx and httpcore included
        descriptor, _ = run(cfg, data_path, random_target, random_target_dir, tmp_path)
    assert descriptor.counts["generated"] == 3
    assert proxy.auth_headers.count(f"Bearer {secret}") == 4
    assert secret not in caplog.text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path


def test_server_killed_mid_run_then_restarted_every_prompt_answered_exactly_once(
        server, proxy, random_target, random_target_dir, tmp_path):
    n = 12
    data_path = write_prompts(tmp_path / "prompts.jsonl", n)
    cfg = generate_cfg(proxy, random_target_dir, max_retries=1)

    def crash(answered: int) -> None:
        if answered == 4:
            server.kill()

    proxy.after_answer = crash
    with pytest.raises(GenerateError, match=r"requests failed after every retry"):
        run(cfg, data_path, random_target, random_target_dir, tmp_path)
    assert not server.alive()
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [random_target])
    journaled = [json.loads(line) for line in
                 (journal_dir(plan) / "answers.jsonl").read_text().splitlines()]
    assert len(journaled) >= 4 and len({a["key"] for a in journaled}) == len(journaled)
    assert not plan.is_complete()

    server.start()
    proxy.after_answer = None
    descriptor, _ = run(cfg, data_path, random_target, random_target_dir, tmp_path)
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert summary["answered_before"] == len(journaled)
    assert summary["answered_this_attempt"] == n - len(journaled)
    records = records_of(descriptor)
    assert sorted(r["id"] for r in records) == sorted(f"p/p{i}" for i in range(n))
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)
    # Across the crashed run and the rerun, the server answered each prompt exactly once.
    assert len(proxy.answers) == n and set(proxy.answers.values()) == {1}
    sent = {prompt_key({"messages": [{"role": "user", "content": r["messages"][0]["content"]}]})
            for r in records}
    assert sent == set(proxy.answers)


def test_prefect_secret_block_key_is_sent_and_stays_out_of_prefect(
        proxy, random_target, random_target_dir, tmp_path):
    """The task layer resolves generate.endpoint.api_key_secret: the key reaches the server,
    and neither the run's logs, task parameters nor artifacts hold it."""
    from prefect import flow
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.logging.handlers import APILogWorker
    from prefect.testing.utilities import prefect_test_harness

    from tasks.stages import generate as generate_task

    secret = "sk-prefect-secret-5d1e77"
    proxy.required_key = secret
    cfg = generate_cfg(proxy, random_target_dir, api_key_secret="draftsmith-test-key")
    data = DataConfig(sources=[{"name": "p", "path": str(write_prompts(tmp_path / "p.jsonl",
                                                                       3))}])
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [random_target])

    @flow
    def regenerate():
        return generate_task(plan, cfg, data, TargetConfig(model=str(random_target_dir)),
                             random_target)

    with prefect_test_harness(server_startup_timeout=120):
        Secret(value=secret).save("draftsmith-test-key")
        descriptor = regenerate()
        APILogWorker.drain_all(timeout=10)
        with get_client(sync_client=True) as client:
            logs = [log.message for log in client.read_logs()]
            runs = [run.model_dump(mode="json") for run in client.read_task_runs()]
            artifacts = [a.model_dump(mode="json") for a in client.read_artifacts()]
    assert descriptor.counts["generated"] == 3
    assert proxy.auth_headers == [f"Bearer {secret}"] * 3
    assert any(m.startswith("generate summary") for m in logs)  # the logs did arrive
    assert {a["key"] for a in artifacts} >= {"draftsmith-generate-sources",
                                             "draftsmith-generate-summary"}
    assert secret not in json.dumps([logs, runs, artifacts])
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path


def test_client_killed_mid_run_resumes_from_its_journal(proxy, random_target, random_target_dir,
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
    cfg = generate_cfg(proxy, random_target_dir)
    data = DataConfig(sources=[{"name": "p", "path": str(data_path)}])
    target_cfg = TargetConfig(model=str(random_target_dir))
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [random_target])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"generate": cfg.model_dump(mode="json"),
                                "data": data.model_dump(mode="json"),
                                "target_cfg": target_cfg.model_dump(mode="json"),
                                "target": random_target.model_dump(mode="json"),
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
                     (journal_dir(plan) / "answers.jsonl").read_text().splitlines()
                     if line.endswith("}"))
    # Answers 1..3 arrived well before the crash; a starved client may not have written all.
    assert 1 <= len(journaled) <= 4 + concurrency and len(set(journaled)) == len(journaled)

    descriptor = run_generate(cfg, data, target_cfg, random_target, plan,
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
