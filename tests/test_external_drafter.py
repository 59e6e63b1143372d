"""deploy.drafter: a drafter made elsewhere (another run's export, a GPU lease's copy, a public
drafter) deployed and benchmarked by the pipeline itself. The plan runs deploy and benchmark
only, keys them by the drafter's files, and refuses what cannot be: a stage that would make a
drafter, a missing directory, a drafter for another target, a benchmark with no prompts.
The run through the real flow is in tests/test_pipeline_e2e.py."""

from __future__ import annotations

import shutil

import pytest
import yaml

from draftsmith.checks import check_config
from draftsmith.config import ConfigError, load_config
from draftsmith.export.convert import export_drafter
from draftsmith.export.layout import ExportError
from draftsmith.plan import RunPlan
from tests.test_export import make_drafter


@pytest.fixture(scope="module")
def drafter_dir(random_target_dir, tmp_path_factory):
    """An SGLang-layout drafter of the session's random target."""
    drafter, _ = make_drafter(random_target_dir)
    out = tmp_path_factory.mktemp("made-elsewhere") / "drafter"
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", out)
    return out


def pipeline_config(tmp_path, drafter, **benchmark):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    raw = {"run_root": str(tmp_path / "runs"),
           "data": {"sources": [{"name": "a", "path": str(data)}]},
           "deploy": {"drafter": str(drafter)},
           "benchmark": benchmark or {"suite": ["chat"], "prompts_per_set": 2}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def test_the_run_is_deploy_and_benchmark_of_that_drafter(tmp_path, drafter_dir, random_target):
    run = RunPlan(pipeline_config(tmp_path, drafter_dir), random_target)
    assert run.selected == ["deploy", "benchmark"]
    assert [s.name for s in run.order] == ["deploy", "benchmark"]
    assert run.results["export"]["state"] == "External"
    rows = {r.stage: r for r in run.preview()}
    assert list(rows) == ["export", "deploy", "benchmark"]
    assert rows["export"].status == "external" and str(drafter_dir) in rows["export"].reason
    assert rows["deploy"].status == "to run" and rows["benchmark"].status == "to run"
    # deploy reads the drafter and the target; there is no merge output to read
    assert set(run.inputs_of(run.order[0])) == {"export", "target"}


def test_keys_follow_the_drafters_files_not_its_path(tmp_path, drafter_dir, random_target,
                                                      random_target_dir):
    key = RunPlan(pipeline_config(tmp_path, drafter_dir), random_target).plan_for("deploy").key
    moved = shutil.copytree(drafter_dir, tmp_path / "moved")
    assert RunPlan(pipeline_config(tmp_path, moved),
                   random_target).plan_for("deploy").key == key
    other, _ = make_drafter(random_target_dir, seed=1)
    export_drafter(other.state_dict(), other.config, "sglang", "llama", tmp_path / "other")
    assert RunPlan(pipeline_config(tmp_path, tmp_path / "other"),
                   random_target).plan_for("deploy").key != key


@pytest.mark.parametrize("selected", [["train"], ["export", "deploy"]])
def test_a_stage_that_makes_a_drafter_is_refused(tmp_path, drafter_dir, random_target,
                                                 selected):
    with pytest.raises(ConfigError, match=r"deploy.drafter=.* made elsewhere.*--from deploy"):
        RunPlan(pipeline_config(tmp_path, drafter_dir), random_target, selected)


def test_benchmark_alone_reads_the_deploy_of_that_drafter(tmp_path, drafter_dir,
                                                          random_target):
    run = RunPlan(pipeline_config(tmp_path, drafter_dir), random_target, ["benchmark"])
    assert run.selected == ["benchmark"]
    with pytest.raises(FileNotFoundError, match="stage 'deploy' has no complete output"):
        list(run.steps())


def test_a_missing_directory_is_named(tmp_path, random_target):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"deploy.drafter={missing}: no such directory"):
        RunPlan(pipeline_config(tmp_path, missing), random_target)
    findings = check_config(pipeline_config(tmp_path, missing))
    assert any(f.level == "error" and f"deploy.drafter={missing}" in f.message
               for f in findings)


def test_a_drafter_for_another_target_is_refused(tmp_path, drafter_dir, random_target):
    figures = {**random_target.figures, "hidden_size": random_target.figures["hidden_size"] * 2,
               "num_layers": 2}
    other = random_target.model_copy(update={"figures": figures})
    with pytest.raises(ExportError, match="a drafter for another target") as info:
        RunPlan(pipeline_config(tmp_path, drafter_dir), other)
    assert "hidden states of size" in str(info.value) and "aux layers" in str(info.value)


def test_a_benchmark_needs_prompts_of_its_own(tmp_path, drafter_dir):
    with pytest.raises(ConfigError, match="benchmark.suite.*prompts_file.*prompts_builtin"):
        pipeline_config(tmp_path, drafter_dir, num_prompts=4)


def test_the_cli_plans_and_runs_the_config_s_own_stages(tmp_path, drafter_dir, random_target_dir,
                                                       monkeypatch):
    """`draftsmith plan` shows the drafter as export's external output and runs nothing;
    `draftsmith run` with no stage picked hands the flow no selection, so the plan runs deploy
    and benchmark (a list of all seven would be refused)."""
    from typer.testing import CliRunner

    from draftsmith import cli

    config = pipeline_config(tmp_path, drafter_dir)
    raw = config.model_dump(mode="json", exclude_defaults=True)
    raw["target"] = {"model": str(random_target_dir)}
    path = tmp_path / "external.yaml"
    path.write_text(yaml.safe_dump(raw))
    planned = CliRunner().invoke(cli.app, ["plan", str(path)], env={"COLUMNS": "200"})
    assert planned.exit_code == 0, planned.output
    assert "external" in planned.output and "deploy.drafter" in planned.output
    assert "generate" not in planned.output and not (tmp_path / "runs").exists()
    handed: list = []
    monkeypatch.setattr(cli, "_run_flow", lambda _config, selected: handed.append(selected) or {})
    ran = CliRunner().invoke(cli.app, ["run", str(path)])
    assert ran.exit_code == 0, ran.output
    assert handed == [[]]


def test_new_files_at_the_same_path_are_deployed_and_benchmarked_again(
        tmp_path, drafter_dir, random_target, random_target_dir):
    """The deployment of a drafter made elsewhere records its files' fingerprint: a drafter
    replaced in place gets a deployment of its own, so the benchmark's key (which follows the
    deployment) changes too, and its sweep points' keys with it."""
    from draftsmith.plan import run_in_process

    path = shutil.copytree(drafter_dir, tmp_path / "drafter")
    config = pipeline_config(tmp_path, path)
    first = run_in_process(config, random_target, ["deploy"])
    deployed = first.outputs["deploy"]
    assert deployed.figures["drafter_files"] == first.outputs["export"].fingerprint

    other, _ = make_drafter(random_target_dir, seed=1)
    shutil.rmtree(path)
    export_drafter(other.state_dict(), other.config, "sglang", "llama", path)
    again = run_in_process(config, random_target, ["deploy"])
    assert again.results["deploy"]["state"] == "Completed"
    assert again.outputs["deploy"].fingerprint != deployed.fingerprint
    assert again.plan_for("benchmark").key != first.plan_for("benchmark").key
