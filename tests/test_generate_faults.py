"""Endpoint faults are per request, never per stage: the generate stage against a server that
injects each fault into one reply in the middle of a batch of healthy ones
(tests/fault_server.py). A fault that passes is retried and its answer kept; a fault on every
attempt is counted in errors.jsonl with its cause and never written as data; the healthy
requests are answered once each and kept, whatever happens to their neighbour.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.artifacts import plan_stage
from draftsmith.config import DataConfig, DataSource, GenerateConfig, TargetConfig
from draftsmith.errors import InputError, TransientError
from draftsmith.generate.openai_client import EndpointError, GenerateInputError
from draftsmith.generate.stage import journal_dir, run_generate
from tests.fault_server import FAULTS, MALFORMED, FaultServer, expected_answer

N, FAULTY = 9, 4  # the faulty prompt sits in the middle, with requests in flight beside it


@pytest.fixture(scope="module")
def fault_server():
    server = FaultServer()
    yield server
    server.close()


@pytest.fixture()
def server(fault_server):
    fault_server.reset()
    return fault_server


def prompt(i: int) -> str:
    return f"Complete this function from m{i}.py:\ndef f{i}(x):"


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": prompt(i)}) + "\n"
                            for i in range(n)))
    return path


def generate_cfg(server: FaultServer, **overrides) -> GenerateConfig:
    return GenerateConfig(backend="openai", max_failure_rate=overrides.pop("max_failure_rate", 0),
                          endpoint={"base_url": server.url, "model": "m", "timeout_s": 30,
                                    "max_retries": 2,
                                    "partitions": [{"max_prompt_tokens": 4096, "concurrency": 4,
                                                    "max_tokens": 8}], **overrides})


def run(cfg: GenerateConfig, data_path: Path, random_target, random_target_dir, root: Path):
    data = DataConfig(sources=[{"name": "p", "path": str(data_path)}])
    plan = plan_stage(root, "generate", {"run": str(root)}, [random_target])
    descriptor = run_generate(cfg, data, TargetConfig(model=str(random_target_dir)),
                              random_target, plan, backoff_initial_s=0.01, backoff_max_s=0.05)
    return descriptor, plan


def records_of(descriptor) -> dict[str, str]:
    """record id -> the assistant's answer."""
    rows = [json.loads(line) for line in
            (descriptor.dir / "records.jsonl").read_text().splitlines()]
    return {r["id"]: r["messages"][-1]["content"] for r in rows}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_that_passes_is_retried_and_every_answer_kept(
        fault, server, random_target, random_target_dir, tmp_path):
    server.inject(prompt(FAULTY), fault, attempts=1)
    descriptor, _ = run(generate_cfg(server), write_prompts(tmp_path / "p.jsonl", N),
                        random_target, random_target_dir, tmp_path)
    assert records_of(descriptor) == {f"p/p{i}": expected_answer(prompt(i)) for i in range(N)}
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    assert (summary["requests"], summary["answered"], summary["failed"]) == (N, N, 0)
    assert summary["retries_this_attempt"] == 1
    assert server.faults == {fault: 1}
    # Nobody was abandoned and asked again: one answer per prompt, the faulty one included.
    assert set(server.answers.values()) == {1} and len(server.answers) == N


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_on_every_attempt_is_counted_with_its_cause_never_written_as_data(
        fault, server, random_target, random_target_dir, tmp_path):
    server.inject(prompt(FAULTY), fault)
    cfg = generate_cfg(server, max_failure_rate=0.2)
    descriptor, _ = run(cfg, write_prompts(tmp_path / "p.jsonl", N), random_target,
                        random_target_dir, tmp_path)
    healthy = {f"p/p{i}": expected_answer(prompt(i)) for i in range(N) if i != FAULTY}
    assert records_of(descriptor) == healthy
    summary = json.loads((descriptor.dir / "generation.json").read_text())
    # Read + answered + failed == input.
    assert summary["answered_before"] + summary["answered_this_attempt"] + summary["failed"] \
        == summary["requests"] == N
    assert summary["failed"] == 1 and descriptor.counts["failed"] == 1
    cause = ("malformed_reply" if fault in MALFORMED else "http_status"
             if fault.startswith("http") else "connection")
    assert summary["failed_by_cause"] == {cause: 1}
    (error,) = [json.loads(line) for line in
                (descriptor.dir / "errors.jsonl").read_text().splitlines()]
    assert (error["record_id"], error["cause"], error["attempts"], error["retryable"]) == (
        f"p/p{FAULTY}", cause, 3, True)  # the first try and max_retries=2 more
    assert server.attempts[prompt(FAULTY)] == 3
    assert set(server.answers.values()) == {1} and len(server.answers) == N - 1


def test_what_a_malformed_reply_error_says(server, random_target, random_target_dir, tmp_path):
    """The error names what is wrong with the reply; it quotes none of it (replies may echo
    the prompt) and says how to finish the stage."""
    server.inject(prompt(FAULTY), "null_content")
    with pytest.raises(EndpointError) as info:
        run(generate_cfg(server), write_prompts(tmp_path / "p.jsonl", N), random_target,
            random_target_dir, tmp_path)
    message = str(info.value)
    assert "1 of 9 requests failed" in message and f"p/p{FAULTY}" in message
    assert "malformed reply: choices[0].message.content is null" in message
    assert "{'malformed_reply': 1}" in message and "asks only for the missing ones" in message
    assert isinstance(info.value, TransientError) and not isinstance(info.value, InputError)
    plan = plan_stage(tmp_path, "generate", {"run": str(tmp_path)}, [random_target])
    source = DataSource(name="p", path=str(tmp_path / "p.jsonl"))
    errors = (journal_dir(plan, generate_cfg(server), source, random_target) /
              "errors.jsonl").read_text()
    assert prompt(FAULTY) not in errors and "def f" not in errors


def test_requests_every_retry_refuses_fail_as_input_errors(server, random_target,
                                                           random_target_dir, tmp_path):
    """A prompt no partition takes fails the same way on every run: an input error, not a
    transient one, so the orchestration does not retry it."""
    cfg = generate_cfg(server)
    cfg.endpoint.partitions[0].max_prompt_tokens = 8
    with pytest.raises(GenerateInputError, match="prompt_too_long"):
        run(cfg, write_prompts(tmp_path / "p.jsonl", 3), random_target, random_target_dir,
            tmp_path)
    assert sum(server.attempts.values()) == 0
