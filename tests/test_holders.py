"""A server the user started holds the GPUs or the deploy port: extract and deploy name it
(pid and command line), the server a GPU worker belongs to, and how to stop it.

The user's server here is a real one: `transformers serve` of the random tiny target on
loopback, as a user runs it to answer generate's prompts. nvidia-smi is a stand-in that reports
the processes the test names as GPU holders.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith import preflight
from draftsmith.artifacts import StagePlan
from draftsmith.serve.gpus import GpusBusyError, require_free_gpus
from draftsmith.serve.holders import PortBusyError, require_free_port
from draftsmith.serve.readiness import port_open
from tests.test_sglang_launch import free_port

BIN = Path(sys.executable).parent


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def user_server(random_target_dir, tmp_path_factory):
    """`transformers serve` of the tiny target on a loopback port: (process, port)."""
    port = free_port()
    log = tmp_path_factory.mktemp("user-server") / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(BIN / "transformers"), "serve", str(random_target_dir), "--host", "127.0.0.1",
             "--port", str(port), "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 300
        while not port_open("127.0.0.1", port):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield process, port
    finally:
        stop(process)


def gpus_held_by(tmp_path: Path, monkeypatch, pids: list[int]) -> None:
    """nvidia-smi reports `pids` on GPUs 0, 1, ...: one process a GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apps = "".join(f"echo 'GPU-{i}, {pid}, python3, 70000'\n" for i, pid in enumerate(pids))
    gpus = "".join(f"echo '{i}, GPU-{i}'\n" for i in range(len(pids)))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$*" in\n  *query-compute-apps*)\n{apps};;\n'
                   f"  *query-gpu*)\n{gpus};;\nesac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def server_model(process: subprocess.Popen) -> str:
    return process.args[2]


def flat(text: str) -> str:
    return " ".join(text.split())


def test_deploy_names_the_server_on_its_port_and_how_to_stop_it(user_server):
    process, port = user_server
    with pytest.raises(PortBusyError) as busy:
        require_free_port("deploy", "127.0.0.1", port)
    message = flat(str(busy.value))
    assert f"deploy: 127.0.0.1:{port} is already in use by a server this run did not start" \
        in message
    # The server's command line (the transformers script, run by its interpreter).
    assert f"(pid {process.pid}: " in message
    assert f"{BIN / 'transformers'} serve {server_model(process)} --host 127.0.0.1" in message
    assert f"`kill {process.pid}`" in message
    assert f"pid {process.pid} is a model server started outside this run: if it is the " \
        "generation server you started for generate (generate.backend: openai), generate is " \
        "done with it" in message
    assert "or set deploy.port to a free port" in message
    require_free_port("deploy", "127.0.0.1", free_port())  # a free port passes


def test_extract_names_the_server_on_its_gpus(user_server, tmp_path, monkeypatch):
    process, _ = user_server
    gpus_held_by(tmp_path, monkeypatch, [process.pid])
    plan = StagePlan(stage="extract", key="k", path=str(tmp_path / "runs" / "extract" / "k"))
    with pytest.raises(GpusBusyError) as busy:
        preflight.check_stage(plan, "cuda")
    message = str(busy.value)
    assert message.startswith("extract: all GPUs must be free, but other processes hold them:")
    assert f"GPU 0: pid {process.pid} python3 (70000 MiB): " in message
    assert f"{BIN / 'transformers'} serve {server_model(process)}" in message
    assert f"`kill {process.pid}`" in flat(message)
    assert "CUDA_VISIBLE_DEVICES" in message


def test_a_gpu_worker_is_traced_to_the_server_that_started_it(tmp_path, monkeypatch):
    """SGLang's and vLLM's GPU workers are children of the server the user started: the
    advice is to stop that server, not each worker. Here a process whose command line reads as
    a vLLM server starts one child, which nvidia-smi reports on GPU 0, beside a plain process
    on GPU 1."""
    worker = "import subprocess, sys, time; subprocess.run([sys.executable, '-c', " \
             "'import time; time.sleep(600)'])"
    server = subprocess.Popen([sys.executable, "-c", worker, "vllm", "serve", "/models/x"],
                              start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    try:
        import psutil

        deadline = time.monotonic() + 60
        while not psutil.Process(server.pid).children():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        child = psutil.Process(server.pid).children()[0].pid
        gpus_held_by(tmp_path, monkeypatch, [child, other.pid])
        with pytest.raises(GpusBusyError) as busy:
            require_free_gpus(["0", "1"])
        message = str(busy.value)
        assert message.startswith("deploy: GPUs 0,1 must be free")
        assert (f"GPU 0: pid {child} python3 (70000 MiB), a worker of pid {server.pid}: "
                in message) and "vllm serve /models/x" in message
        advice = flat(message.split("\n")[-1])
        assert (f"pid {server.pid} is a model server started outside this run: if it is the "
                "generation server you started for generate" in advice)
        assert f"`kill {server.pid}`" in advice and f"`kill {other.pid}`" in advice
        assert f"kill {child}" not in advice  # the server, not its worker
    finally:
        stop(server)
        stop(other)


def test_a_server_started_after_deploy_finds_its_port_taken_and_names_the_holder(
        user_server, tmp_path):
    """The benchmark starts its baseline (and its repeats) on the deploy port once the
    speculative server has stopped; a program that took the port in between is named, and
    no server is started, instead of its /health answering the readiness checks."""
    from draftsmith.serve.engine_adapter import start_until_ready
    from draftsmith.serve.process import ServerLaunch

    process, port = user_server
    marker = tmp_path / "started"
    launch = ServerLaunch(argv=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"], env={},
                          host="127.0.0.1", port=port, drafter_dir=None)
    with pytest.raises(PortBusyError, match=f"deploy: 127.0.0.1:{port} is already in use") \
            as busy:
        start_until_ready(launch, tmp_path / "baseline.log", "vllm-baseline",
                          lambda _process: {})
    assert f"(pid {process.pid}: " in flat(str(busy.value))
    assert not marker.exists()
