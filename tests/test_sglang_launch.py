"""SGLang launch command, supervision and readiness, against tests/fake_sglang_server.py (no
GPU SGLang runs here: what a real server does beyond these HTTP shapes is not tested)."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from draftsmith.bench.acceptance import acceptance_length
from draftsmith.config import ConfigError, DeployConfig, TargetConfig, parse_config
from draftsmith.export.convert import export_drafter
from draftsmith.serve.engine_adapter import LaunchError
from draftsmith.serve.gpus import GpusBusyError, require_free_gpus
from draftsmith.serve.process import ManagedProcess
from draftsmith.serve.readiness import ReadinessError
from draftsmith.serve.sglang_launch import (
    ALLOW_LONGER_CONTEXT_ENV,
    SUPPORTED_SGLANG,
    UnsupportedSGLangError,
    build_launch,
    check_sglang_version,
    wait_until_ready,
)
from tests.conftest import REPO
from tests.ports import free_port
from tests.test_export import make_drafter

FAKE = [sys.executable, str(REPO / "tests" / "fake_sglang_server.py")]



@pytest.fixture()
def drafter_dir(random_target_dir, tmp_path):
    drafter, _ = make_drafter(random_target_dir)
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", tmp_path / "sglang",
                   context_length=8192)
    export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama",
                   tmp_path / "speculators")
    return tmp_path / "sglang"


def deploy(**kw) -> DeployConfig:
    return DeployConfig(engine="sglang", sglang_command=FAKE, port=kw.pop("port", 30000), **kw)


TARGET = TargetConfig(model="/models/kimi", tp_size=8, context_length=8192, dtype="bfloat16")


# --------------------------------------------------------------------------- the command


def test_launch_is_an_argument_list_with_every_speculative_flag(drafter_dir):
    cfg = deploy(num_steps=3, eagle_topk=1, num_draft_tokens=4, mem_fraction_static=0.85,
                 cuda_graph_max_bs_decode=8, extra_args=["--trust-remote-code"],
                 env={"NCCL_IB_DISABLE": "0"})
    launch = build_launch(cfg, TARGET, drafter_dir)
    argv = launch.argv
    assert argv[: len(FAKE)] == FAKE
    pairs = dict(zip(argv[len(FAKE)::2], argv[len(FAKE) + 1::2], strict=False))
    assert pairs["--model-path"] == "/models/kimi" and pairs["--tp-size"] == "8"
    assert pairs["--host"] == "127.0.0.1"
    assert pairs["--speculative-algorithm"] == "EAGLE3"
    assert pairs["--speculative-draft-model-path"] == str(drafter_dir)
    assert (pairs["--speculative-num-steps"], pairs["--speculative-eagle-topk"],
            pairs["--speculative-num-draft-tokens"]) == ("3", "1", "4")
    assert pairs["--context-length"] == "8192" and pairs["--mem-fraction-static"] == "0.85"
    assert pairs["--cuda-graph-max-bs-decode"] == "8"
    assert "--enable-metrics" in argv and argv[-1] == "--trust-remote-code"
    assert "--num-speculative-tokens" not in argv and "--cuda-graph-max-bs" not in argv
    assert launch.env == {"NCCL_IB_DISABLE": "0"}
    assert launch.shell().startswith("NCCL_IB_DISABLE=0 ")


def test_no_step_settings_leaves_all_three_to_sglang(drafter_dir):
    launch = build_launch(deploy(num_steps=None, eagle_topk=None, num_draft_tokens=None),
                          TARGET, drafter_dir)
    assert not any(a.startswith("--speculative-num") or a == "--speculative-eagle-topk"
                   for a in launch.argv)


@pytest.mark.parametrize(("settings", "message"), [
    ({"num_steps": 3, "eagle_topk": None, "num_draft_tokens": None}, "go together"),
    ({"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 6}, "num_steps \\+ 1"),
    ({"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 8}, "at most 7"),
    ({"speculative_algorithm": "EAGLE"}, "EAGLE3"),
    ({"extra_args": ["--num-speculative-tokens", "3"]}, "not an SGLang flag"),
])
def test_bad_speculative_settings_are_refused_before_launch(settings, message):
    raw = {"data": {"sources": [{"name": "x", "path": "x.jsonl"}]},
           "deploy": {"engine": "sglang", **settings}}
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_a_served_context_longer_than_the_drafter_is_refused_or_allowed(drafter_dir):
    target = TARGET.model_copy(update={"context_length": 262144})
    with pytest.raises(LaunchError, match="--context-length 262144"):
        build_launch(deploy(), target, drafter_dir)
    launch = build_launch(deploy(allow_shorter_draft_context=True), target, drafter_dir)
    assert launch.env[ALLOW_LONGER_CONTEXT_ENV] == "1"


def test_a_speculators_layout_drafter_is_refused(drafter_dir):
    with pytest.raises(LaunchError, match="export.format=sglang"):
        build_launch(deploy(), TARGET, drafter_dir.parent / "speculators")


def test_both_servers_get_the_same_max_running_requests(drafter_dir):
    """SGLang caps an EAGLE server at 48 running requests when unset and leaves a plain one
    uncapped; the baseline must run under the same cap or the speedup is understated."""
    def cap(launch):
        return launch.argv[launch.argv.index("--max-running-requests") + 1]

    cfg = deploy()
    assert cap(build_launch(cfg, TARGET, drafter_dir)) == cap(build_launch(cfg, TARGET, None))
    assert cap(build_launch(cfg, TARGET, None)) == "48"
    cfg = deploy(max_running_requests=128)
    assert cap(build_launch(cfg, TARGET, drafter_dir)) == cap(build_launch(cfg, TARGET, None))
    assert cap(build_launch(cfg, TARGET, None)) == "128"
    raw = {"data": {"sources": [{"name": "x", "path": "x.jsonl"}]},
           "deploy": {"engine": "sglang", "extra_args": ["--max-running-requests=64"]}}
    with pytest.raises(ConfigError, match="deploy.max_running_requests"):
        parse_config(raw)


@pytest.mark.parametrize(("extra_args", "refused"), [
    (["--attention-backend", "flashmla"], True),  # page size 64, forced
    (["--attention-backend=trtllm_mla"], True),
    (["--attention-backend", "flex_attention", "--page-size", "16"], True),
    (["--prefill-attention-backend", "flashmla", "--decode-attention-backend", "flashmla"], True),
    (["--attention-backend", "fa3", "--page-size", "64"], False),  # SGLang's tree backends
    (["--attention-backend", "flex_attention"], False),  # page size 1
    ([], False),  # SGLang picks fa3 (Hopper) or flashinfer (Blackwell) for MLA
])
def test_tree_points_on_a_paged_mla_backend_are_refused_when_the_config_loads(extra_args,
                                                                               refused):
    raw = {"data": {"sources": [{"name": "x", "path": "x.jsonl"}]},
           "deploy": {"engine": "sglang", "extra_args": extra_args},
           "benchmark": {"sweep": [{"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
                                   {"num_steps": 3, "eagle_topk": 4, "num_draft_tokens": 8}]}}
    if refused:
        with pytest.raises(ConfigError, match=r"benchmark.sweep\[1\].eagle_topk=4"):
            parse_config(raw)
    else:
        parse_config(raw)
    chain = {**raw, "benchmark": {"sweep": raw["benchmark"]["sweep"][:1]}}
    parse_config(chain)  # chains run on every backend
    tree_deploy = {**chain, "deploy": {**raw["deploy"], "num_steps": 3, "eagle_topk": 4,
                                       "num_draft_tokens": 8}}
    if refused:
        with pytest.raises(ConfigError, match="deploy.eagle_topk=4"):
            parse_config(tree_deploy)


def test_the_sglang_extra_pins_the_supported_range():
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["sglang"]
    assert extra == [f"sglang[all]{SUPPORTED_SGLANG}"]
    checked = next(line.split("==")[1] for line in (
        REPO / "tests" / "sglang_conformance" / "requirements.txt").read_text().splitlines()
        if line.startswith("sglang=="))
    # The conformance tests read the oldest supported version's code.
    assert SUPPORTED_SGLANG.startswith(f">={checked},")


@pytest.mark.parametrize(("version", "refused"), [
    ("0.5.23", None), ("0.5.30.post1", None), ("0.5.24.dev3+gabc", None),
    ("0.5.9", "runs SGLang 0.5.9; draftsmith supports SGLang >=0.5.23,<0.6"),
    ("0.6.0", "runs SGLang 0.6.0"), (None, "reports no SGLang version"),
    ("main", "not a version number"),
])
def test_sglang_versions_outside_the_supported_range_are_refused(version, refused):
    if refused is None:
        check_sglang_version(version, "the server")
    else:
        with pytest.raises(UnsupportedSGLangError, match=refused) as err:
            check_sglang_version(version, "the server")
        assert "pip install 'draftsmith[sglang]'" in str(err.value)


# --------------------------------------------------------------------------- readiness


def serve(drafter_dir, tmp_path, mode: str = "", version: str = "0.5.23", **kw):
    port = free_port()
    cfg = deploy(port=port, startup_timeout_s=kw.pop("timeout", 60), **kw)
    launch = build_launch(cfg, TARGET, drafter_dir)
    env = {**launch.env, "FAKE_SGLANG_MODE": mode, "FAKE_SGLANG_VERSION": version}
    return cfg, launch, ManagedProcess(launch.argv, tmp_path / "server.log", env)


def test_ready_server_passes_every_check(drafter_dir, tmp_path):
    cfg, launch, process = serve(drafter_dir, tmp_path)
    with process:
        info = wait_until_ready(launch.url, cfg, str(drafter_dir), process)
    assert info["speculative_algorithm"] == "EAGLE3"
    assert "fake sglang: ready" in (tmp_path / "server.log").read_text()  # streamed to file


@pytest.mark.parametrize(("mode", "check", "why"), [
    ("wrong_algorithm", "server_info", "speculative_algorithm is 'EAGLE'"),
    ("generate_fails", "generation", "500"),
    ("crash", "port", "exited with code 3"),
    ("never_listen", "port", "not open after"),
])
def test_each_failed_readiness_check_says_which_and_why(drafter_dir, tmp_path, mode, check, why):
    # Only the server that never listens waits out its startup timeout: keep that one short.
    # The others fail on their own as soon as they are up, which on a busy machine can take
    # longer than a few seconds (python start-up and imports).
    cfg, launch, process = serve(drafter_dir, tmp_path, mode,
                                 timeout=4 if mode == "never_listen" else 300)
    with process, pytest.raises(ReadinessError) as info:
        wait_until_ready(launch.url, cfg, str(drafter_dir), process)
    assert info.value.check == check and why in str(info.value)


@pytest.mark.parametrize(("version", "why"), [
    ("0.5.9", "runs SGLang 0.5.9; draftsmith supports SGLang >=0.5.23,<0.6"),
    ("none", "reports no SGLang version"),
])
def test_a_server_of_an_unsupported_sglang_is_not_ready(drafter_dir, tmp_path, version, why):
    cfg, launch, process = serve(drafter_dir, tmp_path, version=version)
    with process, pytest.raises(ReadinessError) as info:
        wait_until_ready(launch.url, cfg, str(drafter_dir), process)
    assert info.value.check == "version" and why in str(info.value)
    assert launch.url in str(info.value)


def test_stopping_the_server_stops_its_whole_process_group(drafter_dir, tmp_path):
    cfg, launch, process = serve(drafter_dir, tmp_path, "spawn_child")
    with process:
        wait_until_ready(launch.url, cfg, str(drafter_dir), process)
        line = next(x for x in process.recent_output().splitlines() if "worker pid" in x)
        worker = int(line.rsplit(" ", 1)[1])
        os.kill(worker, 0)  # alive while the server is
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker {worker} survived the server's stop")


# --------------------------------------------------------------------------- metrics, GPUs


def test_acceptance_length_sums_before_dividing():
    metas = [{"completion_tokens": 3, "spec_verify_ct": 3},  # a short answer, accepting little
             {"completion_tokens": 300, "spec_verify_ct": 100}]
    assert acceptance_length(metas) == pytest.approx(303 / 103)
    with pytest.raises(ValueError, match="spec_verify_ct"):
        acceptance_length([{"completion_tokens": 5}])


def test_a_reply_without_a_verify_step_does_not_break_the_acceptance_length():
    """SGLang adds spec_verify_ct only after a verify step: a reply whose first token was EOS
    (or of max_new_tokens 1) has none, and was not decoded speculatively."""
    metas = [{"completion_tokens": 1},
             {"completion_tokens": 300, "spec_verify_ct": 100, "spec_accept_length": 3.0}]
    assert acceptance_length(metas) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no spec_verify_ct for a reply of 7 tokens"):
        acceptance_length([*metas, {"completion_tokens": 7}])
    with pytest.raises(ValueError, match="no verify steps"):
        acceptance_length([{"completion_tokens": 1}])


def test_busy_gpus_are_named_before_launch(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n"
                   "  --query-compute-apps*) echo 'GPU-aaa, 4242, /usr/bin/python3, 70000';;\n"
                   "  --query-gpu*) echo '0, GPU-aaa'; echo '1, GPU-bbb';;\nesac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(GpusBusyError, match="GPU 0: pid 4242 /usr/bin/python3"):
        require_free_gpus(["0", "1"])
    require_free_gpus(["1"])  # GPU 1 is free


# --------------------------------------------------------------------------- benchmark client


def test_client_measures_a_server_running_the_embedded_engine(random_target, random_target_dir,
                                                              drafter_dir, tmp_path):
    """The stand-in fronts draftsmith's own speculative engine: what the client reports must
    be what the engine did, and the outputs must be plain greedy decoding."""
    import asyncio

    from draftsmith.bench.client import run_load, summarize
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, plain_generate
    from draftsmith.target import load_target_model

    target = TargetConfig(model=random_target.path)
    cfg = deploy(port=free_port(), num_steps=2, eagle_topk=1, num_draft_tokens=3)
    launch = build_launch(cfg, target, drafter_dir)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 14)]
    with ManagedProcess(launch.argv, tmp_path / "server.log", launch.env) as process:
        wait_until_ready(launch.url, cfg, str(drafter_dir), process, timeout_s=120)
        results, wall = asyncio.run(run_load(launch.url, prompts, max_new_tokens=12,
                                             concurrency=2))
        # One token each: from the prefill, no verify step, no spec_verify_ct (as SGLang).
        single, single_wall = asyncio.run(run_load(launch.url, prompts[:1] * 2,
                                                   max_new_tokens=1))
    summary = summarize(results, wall)
    assert all("spec_verify_ct" not in r.meta_info for r in single)
    mixed = summarize([*results, *single], wall + single_wall)
    assert mixed["acceptance_length"] == summary["acceptance_length"]

    model = load_target_model(random_target.path)
    engine = EmbeddedSpeculativeEngine.load(model, drafter_dir, num_steps=2)
    eos = model.generation_config.eos_token_id
    expected_tokens = expected_rounds = all_tokens = 0
    for prompt, result in zip(prompts, results, strict=True):
        local = engine.generate(prompt, 12, eos)
        assert result.output_ids == local.tokens == plain_generate(engine.runner, prompt, 12,
                                                                    eos).tokens
        assert result.meta_info.get("spec_verify_ct", 0) == local.verify_rounds
        assert result.ttft_s <= result.latency_s
        all_tokens += len(local.tokens)
        if local.verify_rounds:
            expected_tokens += len(local.tokens)
            expected_rounds += local.verify_rounds
    assert summary["requests"] == 3 and summary["completion_tokens"] == all_tokens
    assert summary["acceptance_length"] == pytest.approx(expected_tokens / expected_rounds,
                                                         abs=1e-3)
    assert summary["tokens_per_s"] > 0 and summary["inter_chunk_mean_s"] is not None


def test_deploy_refuses_a_port_another_server_holds(drafter_dir, random_target, tmp_path):
    """Someone else's server on the port would pass every readiness check by accident."""
    from draftsmith.artifacts import Descriptor, plan_stage
    from draftsmith.serve.deploy import deploy_server
    from draftsmith.serve.sglang_launch import SGLANG

    exported = Descriptor(stage="export", path=str(tmp_path), key="k", fingerprint="f",
                          figures={"format": "sglang", "drafter_dir": str(drafter_dir)})
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        cfg = deploy(port=holder.getsockname()[1])
        plan = plan_stage(tmp_path / "runs", "deploy", {}, [exported])
        with pytest.raises(RuntimeError, match=rf"already in use by a server this run did "
                                               rf"not start \(pid {os.getpid()}: "):
            deploy_server(SGLANG, cfg, TargetConfig(model=random_target.path),
                          str(drafter_dir), random_target.path, "llama", plan)
    assert not plan.is_complete()


def test_baseline_launch_has_no_speculation_and_readiness_insists(drafter_dir, tmp_path):
    cfg = deploy(port=free_port())
    launch = build_launch(cfg, TARGET, None)
    assert not any(a.startswith("--speculative") for a in launch.argv)
    assert launch.drafter_dir is None and "--context-length" in launch.argv
    with ManagedProcess(launch.argv, tmp_path / "plain.log", launch.env) as process:
        info = wait_until_ready(launch.url, cfg, None, process)
        assert not info["speculative_algorithm"]
        with pytest.raises(ReadinessError, match="speculative_algorithm is None"):
            wait_until_ready(launch.url, cfg, str(drafter_dir), process)
    speculative = build_launch(cfg, TARGET, drafter_dir)
    with (ManagedProcess(speculative.argv, tmp_path / "spec.log", speculative.env) as process,
          pytest.raises(ReadinessError, match="started without speculation")):
        wait_until_ready(speculative.url, cfg, None, process)
