"""tasks/stages.py: what the Prefect task wrappers add around the engine."""

from __future__ import annotations

import pytest
from prefect.states import Failed

from draftsmith.errors import CheckpointError, ConfigValueError, WorkerCrashError
from draftsmith.extract.preflight import DiskSpaceError
from draftsmith.preflight import PreflightError
from tasks.stages import retry_unless_hopeless


@pytest.mark.parametrize("error, retried", [
    (DiskSpaceError("extract will not fit"), False),  # the disk stays full between attempts
    (PreflightError("train: needs about 3 GiB"), False),
    (RuntimeError("CUDA error: an illegal memory access"), True),
    (ConnectionError("endpoint went away"), True),
])
def test_preflight_failures_are_not_retried_other_failures_are(error, retried):
    state = Failed(data=error, message=repr(error))
    assert retry_unless_hopeless(None, None, state) is retried


@pytest.mark.parametrize("error, attempts", [
    (ConfigValueError("train.step_weights has 2 entries, ttt_steps is 3"), 1),
    (CheckpointError("init_from/model.safetensors is truncated: re-export it"), 1),
    (WorkerCrashError("extract: shards ['s0'] were not written (a worker failed)"), 3),
    (RuntimeError("CUDA error: an illegal memory access"), 3),
])
def test_a_stage_task_fails_an_input_error_at_once_and_retries_the_rest(
        prefect_api, tmp_path, error, attempts):
    """The real stage task with its real retry policy, in a Prefect flow: an input error
    would fail the same way again, so its message ends the task on the first attempt."""
    from prefect import flow

    from draftsmith import stages
    from draftsmith.artifacts import plan_stage
    from draftsmith.config import DataConfig, PipelineConfig, TargetConfig
    from draftsmith.figures import Figures
    from tasks.stages import stage_task

    calls = []

    def fails(_config, _inputs, _plan, _secret=None):
        calls.append(1)
        raise error

    toy = stages.Stage("flaky", "fails", "tests/test_tasks.py", fails, inputs=(), section=None,
                       figures=Figures, describe=lambda _d: "")
    config = PipelineConfig(name="retry-test", run_root=str(tmp_path),
                            target=TargetConfig(model="builtin:tiny"),
                            data=DataConfig(sources=[{"name": "s", "path": "unused.jsonl"}]))
    plan = plan_stage(tmp_path, "flaky", {}, [])
    task = stage_task(toy).with_options(retry_delay_seconds=0)

    states = []

    @flow
    def one_stage() -> None:
        states.append(task(plan, config, {}, return_state=True))

    one_stage()
    state = states[0]
    assert state.is_failed() and str(error) in state.message
    assert len(calls) == attempts  # retries=2: three attempts, unless hopeless


@pytest.mark.parametrize("error_name, attempts", [("TargetFileError", 1), ("TargetFetchError", 2)])
def test_resolving_the_target_fails_an_input_error_at_once(prefect_api, monkeypatch,
                                                           error_name, attempts):
    """A missing converter package or a wrong model file fails the same way again; a fetch
    that failed (the registry down) may pass on the retry."""
    from prefect import flow

    from draftsmith import smollm2_target, target
    from draftsmith.config import TargetConfig
    from tasks.stages import resolve_target

    error = getattr(smollm2_target, error_name)("target builtin:smollm2-135m-instruct: no")
    calls = []

    def fails(_cfg):
        calls.append(1)
        raise error

    monkeypatch.setattr(target, "resolve_target", fails)
    states = []

    @flow
    def resolve_only() -> None:
        states.append(resolve_target.with_options(retry_delay_seconds=0)(
            TargetConfig(model="builtin:smollm2-135m-instruct"), return_state=True))

    resolve_only()
    assert states[0].is_failed() and "no" in states[0].message
    assert len(calls) == attempts


def test_a_cached_stage_result_goes_to_the_suites_prefect_home_not_the_users(prefect_api):
    """Prefect stores a cached task's result under its home, by cache key. The suite has a home
    of its own (tests/conftest.py): results left in the user's home by an earlier suite on the
    same paths were found there, and a stage the test meant to run did not."""
    import uuid
    from pathlib import Path

    from prefect import flow, task

    from tests.conftest import PREFECT_TEST_HOME

    key = f"draftsmith-suite-home-{uuid.uuid4().hex}"

    @task(cache_key_fn=lambda *_: key, persist_result=True)
    def stage() -> int:
        return 1

    @flow
    def run() -> int:
        return stage()

    assert run() == 1
    assert (Path(PREFECT_TEST_HOME) / "storage" / key).is_file()
    assert not (Path.home() / ".prefect" / "storage" / key).exists()
