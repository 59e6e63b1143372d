"""The run plan (draftsmith/plan.py) on a table of toy stages: what runs, what is cached or
reused, what retention prunes and recomputes, and what `draftsmith plan` says and why. No
Prefect and no model: the stages write a line of text."""

from __future__ import annotations

import pytest

from draftsmith import stages
from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    external_descriptor,
    finish_stage,
    stage_output,
)
from draftsmith.config import PipelineConfig, is_keyed, models_in
from draftsmith.figures import Figures
from draftsmith.plan import RunPlan, run_in_process


def writer(name: str, setting: str):
    """A toy stage: writes its setting and its inputs' fingerprints."""

    def run(config: PipelineConfig, inputs: dict[str, Descriptor], plan: StagePlan,
            _secret: str | None = None) -> Descriptor:
        value = getattr(config.merge, setting)
        with stage_output(plan) as out:
            seen = " ".join(f"{k}={d.fingerprint}" for k, d in sorted(inputs.items()))
            (out / "out.txt").write_text(f"{name} {value} {seen}\n")
        RUNS.append(name)
        return finish_stage(plan, figures={"value": value})

    return run


RUNS: list[str] = []


def toy(name: str, inputs: tuple[str, ...], setting: str, **extra) -> stages.Stage:
    return stages.Stage(name, f"toy stage {name}", "tests/test_run_plan.py",
                        writer(name, setting), inputs=inputs, section=None, figures=Figures,
                        describe=lambda d: f"value {d.figures['value']}",
                        key_extras=lambda c, s=setting: {s: getattr(c.merge, s)}, **extra)


@pytest.fixture
def table(monkeypatch):
    RUNS.clear()
    monkeypatch.setattr(stages, "STAGES", [
        toy("a", (stages.TARGET, stages.DATA), "seed"),
        toy("b", ("a",), "max_length", retention=("a", "delete_generations_after_merge")),
        toy("c", ("b", stages.TARGET), "draft_vocab_size"),
    ])


def config(tmp_path, **merge) -> PipelineConfig:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text('{"prompt": "hello"}\n')
    return PipelineConfig.model_validate({
        "run_root": str(tmp_path / "runs"), "data": {"sources": [{"name": "d",
                                                                    "path": str(data)}]},
        "merge": merge})


TARGET = external_descriptor("target", "/models/t", "target-fingerprint")


def states(run: RunPlan) -> dict[str, str]:
    return {name: r["state"] for name, r in run.results.items()}


def test_runs_then_finds_everything_cached(table, tmp_path):
    first = run_in_process(config(tmp_path), TARGET)
    assert states(first) == {"a": "Completed", "b": "Completed", "c": "Completed"}
    assert RUNS == ["a", "b", "c"]
    again = run_in_process(config(tmp_path), TARGET)
    assert states(again) == {"a": "Cached", "b": "Cached", "c": "Cached"}
    assert RUNS == ["a", "b", "c"]  # nothing ran twice
    assert [r.status for r in RunPlan(config(tmp_path), TARGET).preview()] == ["cached"] * 3


def test_a_changed_setting_reruns_its_stage_and_says_why(table, tmp_path):
    run_in_process(config(tmp_path), TARGET)
    rows = RunPlan(config(tmp_path, max_length=64), TARGET).preview()
    assert [(r.stage, r.status) for r in rows] == [("a", "cached"), ("b", "to run"),
                                                   ("c", "to run")]
    assert "settings.max_length 2048 -> 64" in rows[1].reason
    assert rows[2].key is None and rows[2].reason.startswith("after b")
    RUNS.clear()
    rerun = run_in_process(config(tmp_path, max_length=64), TARGET)
    # b's output changed, so c's key did; a kept its key and was not run again.
    assert RUNS == ["b", "c"] and states(rerun)["a"] == "Cached"


def test_new_data_reruns_from_the_first_stage_and_names_the_input(table, tmp_path):
    run_in_process(config(tmp_path), TARGET)
    (tmp_path / "data.jsonl").write_text('{"prompt": "new"}\n')
    rows = RunPlan(config(tmp_path), TARGET).preview()
    assert rows[0].status == "to run" and "inputs.data" in rows[0].reason


def test_stages_not_selected_are_read_from_disk_or_named_as_missing(table, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"stage 'a'.*--to a"):
        run_in_process(config(tmp_path), TARGET, ["b"])
    run_in_process(config(tmp_path), TARGET, ["a"])
    RUNS.clear()
    run = run_in_process(config(tmp_path), TARGET, ["b", "c"])
    assert states(run) == {"a": "Reused", "b": "Completed", "c": "Completed"}
    assert RUNS == ["b", "c"]
    rows = RunPlan(config(tmp_path, max_length=64), TARGET, ["c"]).preview()
    assert [(r.stage, r.status) for r in rows] == [("a", "reused"), ("b", "missing"),
                                                   ("c", "missing")]
    assert "--to b" in rows[1].reason


def test_retention_prunes_after_use_and_recomputes_when_needed(table, tmp_path):
    keep = config(tmp_path)
    keep.retention.delete_generations_after_merge = True
    first = run_in_process(keep, TARGET)
    assert not first.outputs["a"].dir.exists()  # deleted once b had read it
    again = run_in_process(keep, TARGET)
    assert states(again) == {"a": "Pruned", "b": "Cached", "c": "Cached"}
    RUNS.clear()
    changed = keep.model_copy(deep=True)
    changed.merge.max_length = 64
    rerun = run_in_process(changed, TARGET)
    assert RUNS == ["a", "b", "c"]  # b reads a, deleted: a first, then b and c
    assert rerun.outputs["a"].fingerprint == first.outputs["a"].fingerprint


def test_every_setting_says_whether_it_is_in_a_cache_key():
    """A new setting cannot slip into (or out of) a stage's key unnoticed: each field of each
    config section is marked keyed(...) or operational(...)."""
    from pydantic import BaseModel

    unmarked, seen = [], set()

    def walk(model: type[BaseModel], where: str) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            if model is not PipelineConfig and is_keyed(field) is None:
                unmarked.append(f"{where}.{name}")
            for kind in models_in(field.annotation):
                walk(kind, f"{where}.{name}" if model is not PipelineConfig else name)

    walk(PipelineConfig, "")
    assert unmarked == []
    assert len(seen) > 10  # every section was reached


def test_a_setting_added_later_changes_no_key_at_its_default():
    """keyed(..., added=True): a run root made before the setting existed stays cached after
    an upgrade; a value other than the default is in the key like any keyed setting."""
    from draftsmith.plan import key_material

    config = PipelineConfig.model_validate({"data": {"sources": [
        {"name": "a", "path": "a.jsonl"}]}})
    material = key_material(config, "generate")["generate"]
    assert "cache" not in material and "dtype" not in material
    assert "batch_size" in material  # an ordinary keyed setting is there at its default
    changed = config.model_copy(deep=True)
    changed.generate.cache = "static"
    assert key_material(changed, "generate")["generate"]["cache"] == "static"
