"""The real Prefect flow, end to end, on the tiny target trained as the demo trains it.

One Prefect test harness (a temporary API and database) serves the session. The runs share one
run root, in order: the session's full run (tests/tiny_run.py, which the vLLM tests serve too),
a rerun (all cached), a benchmark-only change, a data change, a deleted stage directory, and
the CLI on the finished outputs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.artifacts import MANIFEST
from draftsmith.stages import names
from tests.conftest import REPO
from tests.tiny_run import RECORDS_PER_SOURCE, run_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]  # first_run: the whole pipeline
STAGES = tuple(names())


@pytest.fixture()
def base_raw(tiny_config):
    return json.loads(json.dumps(tiny_config))  # a copy: the session's config stays as it ran


def states(results: dict[str, dict]) -> dict[str, str]:
    return {stage: r["state"] for stage, r in results.items()}


@pytest.fixture()
def first_run(tiny_run):
    return tiny_run


def test_full_run_completes_every_stage_and_the_drafter_pays(first_run):
    assert states(first_run) == {stage: "Completed" for stage in STAGES}
    bench = first_run["benchmark"]["descriptor"]["figures"]
    assert bench["lossless"] is True
    assert bench["acceptance_length"] > 1.5
    train = first_run["train"]["descriptor"]["figures"]
    assert train["tau"] > 1.5 and 0 < train["full_acc_0"] <= 1
    assert train["tokens_per_s"] > 0  # steady throughput, past the compiling windows
    generate = first_run["generate"]["descriptor"]["counts"]
    both = 2 * RECORDS_PER_SOURCE
    assert generate["records"] == both and generate["generated"] == both
    for stage, result in first_run.items():  # what each output cost to make, in its manifest
        cost, out = result["descriptor"]["cost"], Path(result["descriptor"]["path"])
        files = json.loads((out / MANIFEST).read_text())["files"]
        assert cost["disk_bytes"] == sum((out / name).stat().st_size for name in files), stage
        assert cost["seconds"] is not None and cost["peak_gpu_gib"] is None, stage


def test_second_run_is_all_cached(first_run, base_raw):
    again = run_pipeline(base_raw)
    assert states(again) == {stage: "Cached" for stage in STAGES}
    assert again["benchmark"]["descriptor"] == first_run["benchmark"]["descriptor"]


def test_changing_benchmark_settings_reruns_only_the_benchmark(first_run, base_raw):
    raw = json.loads(json.dumps(base_raw))
    raw["benchmark"]["max_new_tokens"] = 24
    results = run_pipeline(raw)
    expected = {stage: "Cached" for stage in STAGES}
    expected["benchmark"] = "Completed"
    assert states(results) == expected


def test_a_cached_stage_whose_directory_is_gone_is_recomputed(first_run, base_raw):
    shutil.rmtree(first_run["deploy"]["descriptor"]["path"])
    results = run_pipeline(base_raw)
    assert results["deploy"]["state"] == "Completed"
    assert os.path.isdir(results["deploy"]["descriptor"]["path"])
    # Same inputs, same deterministic output: the benchmark downstream stays cached.
    assert results["benchmark"]["state"] == "Cached"


def test_new_data_reruns_from_generate(first_run, base_raw, tmp_path):
    raw = json.loads(json.dumps(base_raw))
    source = raw["data"]["sources"][1]
    n = RECORDS_PER_SOURCE
    grown = tmp_path / "openai-grown.jsonl"  # a new file: the other tests keep the old data
    # The records the first run read, the 10 after them and a new one.
    lines = Path(source["path"]).read_text().splitlines(keepends=True)[: n + 10]
    grown.write_text("".join(lines) + json.dumps({"id": "new-1", "messages": [
        {"role": "user", "content": "Complete this function from demo.py:\ndef add(a, b):"}
    ]}) + "\n")
    source["path"], source["limit"] = str(grown), None
    results = run_pipeline(raw, ["generate", "merge", "extract"])
    assert states(results) == {"generate": "Completed", "merge": "Completed",
                               "extract": "Completed"}
    generated = results["generate"]["descriptor"]
    assert generated["counts"]["records"] == n + n + 11
    # Answers are journaled per source: the unchanged source asked for nothing, the grown one
    # only for the prompts no earlier run had answered (its first n were).
    summary = json.loads((Path(generated["path"]) / "generation.json").read_text())
    assert summary["per_source"] == {
        "stdlib-openai": {"requests": n + 11, "answered_before": n, "answered_this_attempt": 11},
        "stdlib-sharegpt": {"requests": n, "answered_before": n, "answered_this_attempt": 0}}
    assert summary["seconds_this_attempt"] > 0 and summary["tokens_per_s"] > 0


def test_online_training_runs_through_the_flow_without_a_store(first_run, base_raw):
    """train.mode=online in the demo config: extract writes no store, train captures the
    target's states itself, and the drafter is exported and validated."""
    raw = json.loads(json.dumps(base_raw))
    raw["train"].update(mode="online", epochs=2)
    result = run_pipeline(raw, ["extract", "train", "export"])
    assert states(result) == {"generate": "Reused", "merge": "Reused", "extract": "Completed",
                              "train": "Completed", "export": "Completed"}
    extract = result["extract"]["descriptor"]
    assert extract["figures"]["mode"] == "online" and extract["counts"]["bytes"] == 0
    assert not list(Path(extract["path"]).glob("*.safetensors"))  # nothing stored
    assert result["extract"]["descriptor"]["key"] != first_run["extract"]["descriptor"]["key"]
    train = result["train"]["descriptor"]["figures"]
    assert train["tau"] > 1.0 and 0 < train["full_acc_0"] <= 1
    assert result["train"]["descriptor"]["key"] != first_run["train"]["descriptor"]["key"]


def test_a_cached_rerun_imports_neither_torch_nor_transformers(first_run, base_raw, tmp_path):
    """A cached re-run costs fixed work, not stages: showing what each stage wrote (its
    summary, its reports' lines) must not load the stage modules' heavy imports."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(base_raw))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "250"}
    env.pop("PREFECT_API_URL", None)
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('heavy modules:', [m for m in ('torch', "
             "'transformers') if m in sys.modules]))\n"
             "from draftsmith.cli import app\n"
             f"sys.argv = ['draftsmith', 'run', {str(config)!r}]\n"
             "app()\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"│ (\S+) +│ (\w+) +│", proc.stdout))  # the summary table
    assert rows == {stage: "Cached" for stage in STAGES}, proc.stdout
    assert "heavy modules: []" in proc.stdout


def session_api_env(tmp_path: Path) -> dict[str, str]:
    """A CLI child's environment pointed at the session's Prefect API (tests/conftest.py
    `prefect_api`), so it does not start a temporary server of its own (seconds of CPU each;
    test_a_cached_rerun_imports_neither_torch_nor_transformers runs the CLI with one)."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_API_URL": PREFECT_API_URL.value()}


def test_cli_runs_one_stage_from_finished_outputs(first_run, base_raw, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(base_raw))
    # A wide console: rich folds the result column of a narrow one mid-word.
    env = {**session_api_env(tmp_path), "COLUMNS": "250"}
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "run", str(config), "--only", "fix-keys"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # fix-keys is the export stage's old name: its row says export
    assert "│ export" in proc.stdout and "drafter validated" in proc.stdout, proc.stdout


def test_a_stage_added_to_the_table_alone_runs_in_the_flow(prefect_api, base_raw, tmp_path,
                                                            monkeypatch):
    """Adding a stage is one table entry plus its function: the flow runs it as a task, caches
    it, and the CLI's summary shows it."""
    from draftsmith import stages
    from draftsmith.artifacts import finish_stage, stage_output
    from draftsmith.cli import _summary
    from draftsmith.figures import Figures

    def census(config, inputs, plan, _secret=None):
        with stage_output(plan) as out:
            (out / "sources.txt").write_text("\n".join(s.name for s in config.data.sources))
        return finish_stage(plan, counts={"sources": len(config.data.sources)},
                            figures={"target": inputs["target"].path})

    toy = stages.Stage("census", "counts the data sources", "tests/test_pipeline_e2e.py",
                       census, inputs=(stages.TARGET, stages.DATA), section=None,
                       figures=Figures, describe=lambda d: f"{d.counts['sources']} sources")
    monkeypatch.setattr(stages, "STAGES", [toy, *stages.STAGES])
    raw = json.loads(json.dumps(base_raw))
    raw["run_root"] = str(tmp_path / "census")
    first = run_pipeline(raw, ["census"])
    assert states(first) == {"census": "Completed"}
    written = Path(first["census"]["descriptor"]["path"]) / "sources.txt"
    assert written.read_text() == "stdlib-sharegpt\nstdlib-openai"
    assert states(run_pipeline(raw, ["census"])) == {"census": "Cached"}
    table, problems = _summary(first)
    assert problems == [] and [str(cell) for cell in table.columns[2]._cells] == ["2 sources"]


def test_only_a_stage_whose_inputs_are_missing_names_the_stage_to_run(prefect_api, base_raw,
                                                                      tmp_path):
    raw = json.loads(json.dumps(base_raw))
    raw["run_root"] = str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"stage 'generate'.*--to generate"):
        run_pipeline(raw, ["merge"])


def test_served_deploy_launches_benchmarks_and_stops_the_server(first_run, base_raw):
    """deploy.engine=sglang through the stand-in server (tests/fake_sglang_server.py), which
    runs draftsmith's embedded engine behind SGLang's HTTP shapes."""
    import socket

    from draftsmith.serve import servers
    from tests.test_sglang_launch import FAKE, free_port

    raw = json.loads(json.dumps(base_raw))
    port = free_port()
    raw["deploy"].update(engine="sglang", sglang_command=FAKE, port=port, keep_serving=True)
    raw["benchmark"].update(concurrency=[1, 2], baseline=False)
    results = run_pipeline(raw)
    try:
        assert results["export"]["state"] == "Cached"
        assert results["deploy"]["state"] == "Completed"
        bench = results["benchmark"]["descriptor"]["figures"]
        assert bench["engine"] == "sglang" and bench["acceptance_length"] > 1.5
        bench_dir = Path(results["benchmark"]["descriptor"]["path"])
        report = json.loads((bench_dir / "report.json").read_text())
        assert [row["concurrency"] for row in report["rows"]] == [1, 2]
        assert "no baseline measured" in bench["verdict"]
        assert (bench_dir / "benchmark.png").is_file() and (bench_dir / "benchmark.svg").is_file()
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # keep_serving: still up after the flow

        # The next run finds the live server and reuses it; the benchmark is cached.
        again = run_pipeline(raw)
        assert again["deploy"]["state"] == "Completed"
        assert again["benchmark"]["state"] == "Cached"
        assert again["deploy"]["descriptor"] == results["deploy"]["descriptor"]

        # With a baseline and a drafting sweep: the speculative server makes way, on the same
        # port (and GPUs), for a server per sweep point and then the target alone, and the
        # verdict compares them.
        raw["deploy"]["keep_serving"] = False
        raw["benchmark"].update(baseline=True, sampled_temperature=0.7, sweep=[
            {"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4}])
        final = run_pipeline(raw)
        figures = final["benchmark"]["descriptor"]["figures"]
        assert figures["baseline_single_stream_tokens_per_s"] > 0 and figures["speedup"] > 0
        assert "speculation pays" in figures["verdict"] or "WARNING" in figures["verdict"]
        assert figures["best_config"] in ("chain, 3 steps", "tree 2x2/4")
        bench_dir = Path(final["benchmark"]["descriptor"]["path"])
        report = json.loads((bench_dir / "report.json").read_text())
        assert [(r["server"], r["concurrency"]) for r in report["rows"]] == [
            ("chain, 3 steps", 1), ("chain, 3 steps", 2), ("tree 2x2/4", 1), ("tree 2x2/4", 2),
            ("chain, 3 steps @ T=0.7", 1), ("chain, 3 steps @ T=0.7", 2),
            ("baseline", 1), ("baseline", 2)]
        assert all("acceptance_length" not in r for r in report["rows"]
                   if r["server"] == "baseline")
        tree = report["configs"][1]
        assert (tree["eagle_topk"], tree["num_draft_tokens"]) == (2, 4)
        assert tree["acceptance_length"] > 1.0 and tree["speedup"] > 0
        point_log = next(bench_dir.parent.parent.glob("benchmark-point/*/server.log"))
        assert "--speculative-eagle-topk 2" in " ".join(point_log.read_text().split())
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:  # this test's server only: the session's vLLM server stays up for its tests
        servers.stop(f"http://127.0.0.1:{port}")


def test_generate_and_merge_publish_their_stats_as_table_artifacts(first_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    # Keyed within the pipeline (named after its run_root, runs/tiny: no config file here).
    keys = ["draftsmith-tiny-generate-sources", "draftsmith-tiny-generate-summary",
            "draftsmith-tiny-merge-sources", "draftsmith-tiny-merge-vocab"]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    tables = {}
    # The first run's version of each (later runs with other data add versions).
    for artifact in sorted(artifacts, key=lambda a: a.created):
        data = artifact.data if isinstance(artifact.data, list) else json.loads(artifact.data)
        tables.setdefault(artifact.key, data)
    assert set(tables) == set(keys) and all(a.type == "table" for a in artifacts)
    sources = {row["source"]: row for row in tables["draftsmith-tiny-generate-sources"]}
    n = RECORDS_PER_SOURCE
    assert {s: (r["read"], r["kept"], r["dropped"], r["answered now"])
            for s, r in sources.items()} == {
        "stdlib-sharegpt": (n, n, 0, n), "stdlib-openai": (n, n, 0, n)}
    summary = {row["figure"]: row["value"] for row in tables["draftsmith-tiny-generate-summary"]}
    assert summary["answered"] == str(2 * n) and summary["failed"] == "0"
    # The in-process backend times itself too (it reported 0.0 s and no throughput).
    assert float(summary["seconds_this_attempt"]) > 0 and float(summary["tokens_per_s"]) > 0
    merged = {row["source"]: row for row in tables["draftsmith-tiny-merge-sources"]}
    for row in merged.values():
        assert row["records"] > 0 and 0 < row["masked_tokens"] < row["tokens"]
        assert row["mean_length"] == pytest.approx(row["tokens"] / row["records"], abs=0.1)
    vocab = {row["figure"]: row["value"] for row in tables["draftsmith-tiny-merge-vocab"]}
    assert 0 < float(vocab["coverage_train"]) <= 1


def test_cli_runs_generate_and_merge_alone_and_logs_their_stats(first_run, base_raw, tmp_path):
    """Both stages in one CLI process (--from/--to): each logs its stats."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(base_raw))
    env = {**session_api_env(tmp_path), "COLUMNS": "250"}
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "run", str(config), "--from", "generate",
         "--to", "merge"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for line in ("generate source", "generate summary", "merge source", "merge draft vocab"):
        assert line in output, output[-3000:]
    rows = dict(re.findall(r"│ (\S+) +│ (\w+) +│", proc.stdout))  # the summary table
    assert set(rows) == {"generate", "merge"}, proc.stdout


def test_extract_stops_before_starting_when_the_store_will_not_fit(first_run, base_raw,
                                                                   monkeypatch):
    from draftsmith.extract import preflight

    raw = json.loads(json.dumps(base_raw))
    raw["extract"]["dtype"] = "bfloat16"  # a new extract key: nothing finished to reuse
    extract_root = Path(raw["run_root"]) / "extract"
    before = set(extract_root.iterdir())
    monkeypatch.setattr(preflight, "free_bytes", lambda destination: 1 << 20)  # a full disk
    with pytest.raises(preflight.DiskSpaceError, match=r"extract will not fit.* 0\.0 GiB free"):
        run_pipeline(raw, ["extract"])
    assert set(extract_root.iterdir()) == before  # stopped before the stage began


def test_a_drafter_made_elsewhere_is_deployed_and_benchmarked_by_the_run(first_run, base_raw,
                                                                        tmp_path):
    """deploy.drafter: the session's drafter, copied away, measured by a run of its own on the
    session benchmark's prompts (as a file) gives the session's acceptance; nothing before
    deploy runs, and a second run is cached."""
    from draftsmith.artifacts import Descriptor
    from draftsmith.data.merge import read_split

    drafter = shutil.copytree(first_run["export"]["descriptor"]["figures"]["drafter_dir"],
                              tmp_path / "drafter")
    merged = Descriptor.model_validate(first_run["merge"]["descriptor"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": json.loads(row["messages"])}) + "\n"
                               for row in read_split(merged, "validation")))
    raw = json.loads(json.dumps(base_raw))
    raw["run_root"] = str(tmp_path / "runs")
    raw["deploy"]["drafter"] = str(drafter)
    raw["benchmark"]["prompts_file"] = str(prompts)
    results = run_pipeline(raw)
    assert states(results) == {"export": "External", "deploy": "Completed",
                               "benchmark": "Completed"}
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()
                  if p.is_dir() and not p.name.startswith(".")) == [
        "benchmark", "benchmark-part", "deploy"]  # the benchmark's parts, kept as measured
    assert results["deploy"]["descriptor"]["figures"]["drafter_dir"] == str(drafter)
    bench = results["benchmark"]["descriptor"]["figures"]
    session = first_run["benchmark"]["descriptor"]["figures"]
    assert bench["lossless"] is True
    assert bench["acceptance_length"] == session["acceptance_length"]
    again = run_pipeline(raw)
    assert states(again) == {"export": "External", "deploy": "Cached", "benchmark": "Cached"}


def test_retention_deletes_big_outputs_and_recomputes_them_when_a_stage_needs_them(
        first_run, base_raw):
    """Last in this module: it deletes the generations and the hidden-state store."""
    raw = json.loads(json.dumps(base_raw))
    raw["retention"] = {"delete_generations_after_merge": True,
                        "delete_hidden_states_after_train": True}
    generated = first_run["generate"]["descriptor"]
    hidden = first_run["extract"]["descriptor"]
    run_pipeline(raw)
    assert not os.path.exists(generated["path"]) and not os.path.exists(hidden["path"])

    # Nothing downstream needs them: the run stays cached and says what was deleted.
    again = run_pipeline(raw)
    expected = {stage: "Cached" for stage in STAGES}
    expected.update(generate="Pruned", extract="Pruned")
    assert states(again) == expected
    assert again["benchmark"]["descriptor"] == first_run["benchmark"]["descriptor"]

    # New training settings: train reads the hidden states, so extract runs again first (the
    # same store, bit for bit) and is deleted again once training has finished.
    raw["train"]["max_steps"] = 2
    retrained = run_pipeline(raw, ["train"])
    assert states(retrained) == {"generate": "Pruned", "merge": "Reused", "extract": "Completed",
                                 "train": "Completed"}
    assert retrained["extract"]["descriptor"]["fingerprint"] == hidden["fingerprint"]
    assert not os.path.exists(hidden["path"])


def test_compare_runs_each_variant_and_publishes_one_table(first_run, base_raw):
    """The compare flow: a variant with the session run's settings is all Cached, one that
    changes the benchmark runs only the benchmark; one table artifact under the base name,
    each variant's reports under its own, and the rows on disk."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from draftsmith.compare import read_comparison
    from flows.compare import VariantForm, compare

    rows = compare(full_config=base_raw, variants=[
        VariantForm(name="base"),
        VariantForm(name="short", overrides=["benchmark.max_new_tokens=12"])])
    base, short = rows
    assert (base["variant"], base["ran"], short["ran"]) == ("base", "-", "benchmark")
    trained = first_run["train"]["descriptor"]["figures"]
    assert base["tau"] == short["tau"] == round(trained["tau"], 3)
    bench = first_run["benchmark"]["descriptor"]["figures"]
    assert base["acceptance"] == round(bench["acceptance_length"], 3)
    assert short["overrides"] == "benchmark.max_new_tokens=12" and short["identical"] == "8/8"
    made = first_run["train"]["descriptor"]["cost"]  # a Cached output: what it cost to make
    assert base["train s"] == short["train s"] == made["seconds"]
    assert short["benchmark s"] is not None and base["disk MB"] > 0
    # The one store both variants read (re-made where another test's retention deleted the
    # session's): its capture rate, as the run that made it measured it.
    assert base["extract tokens/s"] == short["extract tokens/s"] > 0
    saved = read_comparison(Path(base_raw["run_root"]) / "compare" / "tiny.json")
    assert saved["rows"] == rows and saved["variants"][1]["name"] == "short"
    keys = ["draftsmith-tiny-comparison", "draftsmith-tiny-short-benchmark"]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    assert {a.key for a in artifacts} == set(keys)
    table = next(a for a in artifacts if a.key == keys[0])
    data = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [row["variant"] for row in data] == ["base", "short"]


def test_compare_stops_each_variant_after_the_stage_picked(first_run, base_raw):
    """`draftsmith compare --to train`: training variants compared on their figures and costs
    without deploying; the stages before are Cached from the session's run."""
    from draftsmith.plan import select_stages
    from flows.compare import VariantForm, compare

    # The lr variant trains one epoch, not the session run's six: what is checked is that it
    # ran train (and no later stage) and what that cost, not how well it trained.
    rows = compare(full_config=base_raw, stages=select_stages(stop="train"), variants=[
        VariantForm(name="base"),
        VariantForm(name="lr", overrides=["train.lr=2e-3", "train.epochs=1"])])
    base, lr = rows
    assert base["ran"] == "-"
    assert lr["ran"] in ("train", "extract, train")  # extract too where a test's retention
    # deleted the session's store (tests share its run root)
    assert lr["speedup"] is None and lr["drafter"] is None  # neither exported nor benchmarked
    assert "benchmark s" not in lr and lr["train s"] is not None and lr["extract s"] is not None
    assert base["train s"] == first_run["train"]["descriptor"]["cost"]["seconds"]
