"""The error taxonomy (draftsmith/errors.py): input and configuration errors are InputError (the
orchestration fails them at once), endpoint, network and crashed-process faults are
TransientError (retried). Each kind is raised by the engine for its real cases; the classes keep
what they subclassed before (ValueError, FileNotFoundError, RuntimeError)."""

from __future__ import annotations

import json
import pickle
import socket

import pytest

from draftsmith import errors
from draftsmith.errors import InputError, TransientError, worth_retrying


def input_error(err: BaseException) -> bool:
    return isinstance(err, InputError) and not isinstance(err, TransientError) \
        and not worth_retrying(err)


def transient(err: BaseException) -> bool:
    return isinstance(err, TransientError) and not isinstance(err, InputError) \
        and worth_retrying(err)


# --- input and configuration errors ------------------------------------------------------------


def test_a_bad_record_is_an_input_error(tmp_path):
    from draftsmith.data.formats import load_source

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "narrator", "value": "x"}]}) + "\n")
    with pytest.raises(ValueError) as info:
        load_source("bad", path)
    assert input_error(info.value)


def test_a_bad_value_is_an_input_error(tmp_path):
    from draftsmith.config import parse_config

    with pytest.raises(ValueError) as info:
        parse_config({"data": {"sources": [{"name": "a", "path": "a.jsonl"}]},
                      "train": {"lr": -1}})
    assert input_error(info.value)


def test_empty_aux_layer_ids_are_refused_by_the_config(tmp_path):
    from draftsmith.config import ConfigError, parse_config

    raw = {"data": {"sources": [{"name": "a", "path": "a.jsonl"}]}}
    for ids, why in [([], r"aux_layer_ids=\[\]: the drafter needs at least one"),
                     ([-1, 2], "negative ids"), ([3, 1], "distinct and ascending")]:
        with pytest.raises(ConfigError, match=why) as info:
            parse_config({**raw, "extract": {"aux_layer_ids": ids}})
        assert input_error(info.value)


def test_aux_layer_ids_beyond_the_target_are_an_input_error(random_target):
    from draftsmith.config import ExtractConfig
    from draftsmith.extract.stage import aux_layer_ids_for

    with pytest.raises(ValueError, match=r"ids \[8\] are outside 0..7") as info:
        aux_layer_ids_for(ExtractConfig(aux_layer_ids=[1, 8]), random_target)
    assert input_error(info.value)


def test_a_missing_file_is_an_input_error_and_still_a_file_not_found_error(tmp_path):
    from draftsmith.config import TargetConfig
    from draftsmith.data.formats import load_source
    from draftsmith.target import resolve_target

    for action in (lambda: load_source("gone", tmp_path / "gone.jsonl"),
                   lambda: resolve_target(TargetConfig(model=str(tmp_path / "no-model")))):
        with pytest.raises(FileNotFoundError) as info:
            action()
        assert input_error(info.value)


def test_refused_layer_ids_are_an_input_error():
    from draftsmith.export.layer_ids import engine_layer_ids

    with pytest.raises(ValueError, match="cannot be expressed") as info:
        engine_layer_ids([0, 30, 58], "deepseek", "sglang")
    assert input_error(info.value)


def test_an_unloadable_checkpoint_is_an_input_error(tmp_path):
    from draftsmith.export.convert import read_drafter

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')
    with pytest.raises(ValueError) as info:
        read_drafter(tmp_path)
    assert input_error(info.value)


def test_an_unset_api_key_is_an_input_error(monkeypatch):
    from draftsmith.config import EndpointConfig
    from draftsmith.generate.openai_client import resolve_api_key

    monkeypatch.delenv("DRAFTSMITH_NO_SUCH_KEY", raising=False)
    with pytest.raises(RuntimeError) as info:
        resolve_api_key(EndpointConfig(base_url="http://x/v1", model="m",
                                       api_key_env="DRAFTSMITH_NO_SUCH_KEY"))
    assert input_error(info.value)


# --- transient faults --------------------------------------------------------------------------


def test_an_unreachable_endpoint_is_transient(random_target, random_target_dir, tmp_path):
    from draftsmith.artifacts import plan_stage
    from draftsmith.config import DataConfig, GenerateConfig, TargetConfig
    from draftsmith.generate.stage import journal_dir, run_generate

    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    cfg = GenerateConfig(backend="openai", endpoint={
        "base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "max_retries": 1})
    plan = plan_stage(tmp_path, "generate", {"run": "x"}, [random_target])
    sources = DataConfig(sources=[{"name": "p", "path": str(data)}])
    with pytest.raises(RuntimeError, match=r"1 of 1 requests failed.*'connection': 1") as info:
        run_generate(cfg, sources,
                     TargetConfig(model=str(random_target_dir)), random_target, plan,
                     backoff_initial_s=0.01, backoff_max_s=0.02)
    assert transient(info.value)
    journal = journal_dir(plan, cfg, sources.sources[0], random_target)
    (failure,) = [json.loads(line) for line in
                  (journal / "errors.jsonl").read_text().splitlines()]
    assert (failure["cause"], failure["retryable"], failure["attempts"]) == ("connection", True, 2)


def test_busy_gpus_a_dead_server_and_lost_capture_are_transient():
    from draftsmith.extract.sglang_backend import CaptureError
    from draftsmith.serve.gpus import GpusBusyError
    from draftsmith.serve.readiness import ReadinessError

    for err in (GpusBusyError("GPU 0 held"), ReadinessError("port", "exited with code 1"),
                CaptureError("dump missing"), errors.WorkerCrashError("rank 1 died")):
        assert transient(err), err


# --- the classes -------------------------------------------------------------------------------


def engine_error_classes() -> list[type[BaseException]]:
    """Every error class the engine defines in the modules the stages raise from."""
    import importlib
    import inspect

    modules = ["draftsmith.errors", "draftsmith.config", "draftsmith.data.formats",
               "draftsmith.diskspace", "draftsmith.runlock",
               "draftsmith.data.tokenize", "draftsmith.export.formats",
               "draftsmith.export.layer_ids", "draftsmith.extract.store",
               "draftsmith.extract.preflight", "draftsmith.extract.sglang_backend",
               "draftsmith.generate.openai_client", "draftsmith.preflight",
               "draftsmith.serve.engine_adapter", "draftsmith.serve.gpus",
               "draftsmith.serve.readiness",
               "draftsmith.serve.sglang_launch", "draftsmith.train.launch"]
    found = []
    for name in modules:
        module = importlib.import_module(name)
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, Exception) and c.__module__ == name]
    return found


def test_every_stage_error_is_of_one_kind_and_survives_pickling():
    """Prefect keeps a failed task's exception in its state (pickled) and the retry condition
    reads it back: each class must come back whole, and be exactly one kind (or, for the
    client's internal per-request failures and the generic bases, none)."""
    internal = {"HTTPStatusFailure", "MalformedReply", "GenerateError", "TrainLaunchError",
                "InputError", "TransientError"}
    for cls in engine_error_classes():
        if cls.__name__ in internal:
            continue
        assert issubclass(cls, InputError) != issubclass(cls, TransientError), cls
        err = cls("check", "why") if cls.__name__ == "ReadinessError" else cls("a message")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err), cls


def test_what_subclasses_what_is_kept():
    from draftsmith.config import ConfigError
    from draftsmith.data.formats import DataFormatError
    from draftsmith.export.formats import ExportError
    from draftsmith.extract.store import StoreError
    from draftsmith.train.launch import TrainCrashError, TrainInputError, TrainLaunchError

    assert all(issubclass(c, ValueError) for c in (ConfigError, DataFormatError, ExportError,
                                                    StoreError, errors.CheckpointError))
    assert issubclass(errors.MissingFileError, FileNotFoundError)
    assert issubclass(TrainCrashError, TrainLaunchError) and issubclass(TrainInputError,
                                                                        TrainLaunchError)
    assert transient(TrainCrashError("x")) and input_error(TrainInputError("x"))
    assert worth_retrying(KeyError("a bug")), "an unforeseen error is retried, as before"
