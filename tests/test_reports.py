"""What a Prefect user reads: reports keyed per pipeline, rounded and ordered tables, charts
inside the markdown, the run summary, the short form's config. (The real server and UI are
in tests/test_prefect_server.py; these pin the engine's side without one.)"""

from __future__ import annotations

import base64
import json

import pytest

from draftsmith import stages
from draftsmith.artifacts import Descriptor
from draftsmith.config import (
    ConfigError,
    EndpointConfig,
    form_config,
    load_config,
    parse_config,
)
from draftsmith.summary import run_report, stage_rows
from tests.conftest import REPO


def tiny_raw(tmp_path, **top) -> dict:
    return {"run_root": str(tmp_path / "runs" / "Kimi-K2.5 trial"), **top,
            "data": {"sources": [{"name": "a", "path": str(tmp_path / "a.jsonl")}]}}


def test_artifact_keys_are_scoped_to_the_pipeline_and_valid_for_prefect(tmp_path):
    named = parse_config(tiny_raw(tmp_path, name="Kimi-K2.5 8gpu"))
    assert stages.artifact_key(named, "train") == "draftsmith-kimi-k2-5-8gpu-train"
    # Without a name: run_root's last directory.
    unnamed = parse_config(tiny_raw(tmp_path))
    assert stages.artifact_key(unnamed, "train-progress") == \
        "draftsmith-kimi-k2-5-trial-train-progress"
    # A config file names its pipeline.
    assert load_config(REPO / "examples" / "tiny.yaml").pipeline_name == "tiny"


def chart(path) -> None:
    from draftsmith.plotting import plt, save_figure

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [1, 0])
    save_figure(fig, path, "training")


def train_descriptor(tmp_path) -> Descriptor:
    rows = [{"split": "train", "step": s, "epoch": 0, "lr": 0.0012345678, "tau": 1.123456789,
             "tokens_per_s": 2061.77777, **{f"loss_{j}": 7.2222222 for j in range(2)},
             **{f"full_acc_{j}": 0.1234567 for j in range(2)},
             **{f"cond_acc_{j}": 0.3333333 for j in range(2)}} for s in (1, 10)]
    rows.append({"split": "validation", "step": 10, "epoch": 0, "tau": 1.5555555,
                 "acceptance_replayed": 1.4444444, "packing_efficiency": 0.97311,
                 **{f"loss_{j}": 6.1 for j in range(2)},
                 **{f"full_acc_{j}": 0.2 for j in range(2)},
                 **{f"cond_acc_{j}": 0.4 for j in range(2)}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chart(tmp_path)
    return Descriptor(stage="train", path=str(tmp_path), key="k", fingerprint="f",
                      counts={"steps": 10, "epochs": 1},
                      figures={"tau": 1.5556, "acceptance_replayed": 1.4444,
                               "full_acc_0": 0.2, "full_acc_1": 0.2, "loss_0": 6.1})


def test_training_table_has_steps_and_validation_rounded_tau_and_acceptance_first(tmp_path):
    table, page = stages.get("train").reports(train_descriptor(tmp_path))
    assert table.kind == "table" and table.key == "train"
    assert [r["split"] for r in table.rows] == ["train", "train", "validation"]
    columns = list(table.rows[0])
    assert columns[:5] == ["split", "epoch", "step", "tau", "acceptance_replayed"]
    assert columns[5:11] == ["full_acc_0", "full_acc_1", "cond_acc_0", "cond_acc_1", "loss_0",
                             "loss_1"]
    assert all(list(r) == columns for r in table.rows)  # the UI takes its columns from row 1
    assert table.rows[0]["tau"] == 1.1235 and table.rows[0]["tokens_per_s"] == 2061.8
    assert table.rows[0]["acceptance_replayed"] is None  # logged at validation only
    # The summary page carries the chart itself, as a PNG the browser can decode.
    assert page.kind == "markdown" and page.key == "train-summary"
    assert "best validation tau **1.556**" in page.text
    data = page.text.split("](data:image/png;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(data) == (tmp_path / "training.png").read_bytes()


def test_benchmark_report_embeds_its_chart_and_tabulates_configs(tmp_path):
    configs = [{"config": "chain, 3 steps", "num_steps": 3, "speculative_tokens_per_s": 812.25,
                "greedy_tokens_per_s": 560.0, "speedup": 1.45042, "acceptance_length": 3.2649,
                "lossless": True}]
    (tmp_path / "report.json").write_text(json.dumps({"configs": configs}))
    (tmp_path / "report.md").write_text("# draftsmith benchmark\n")
    chart(tmp_path)
    (tmp_path / "training.png").rename(tmp_path / "benchmark.png")
    bench = Descriptor(stage="benchmark", path=str(tmp_path), key="k", fingerprint="f")
    page, table = stages.get("benchmark").reports(bench)
    assert page.key == "benchmark" and page.text.startswith("![benchmark tokens/s")
    assert table.key == "benchmark-configs"
    assert list(table.rows[0])[:3] == ["config", "acceptance_length", "speedup"]
    assert table.rows[0]["speedup"] == 1.4504


def results(state: str = "Completed") -> dict[str, dict]:
    def of(stage, counts=None, **figures):
        return {"state": state, "descriptor": {"stage": stage, "path": f"/r/{stage}",
                                               "key": "k", "fingerprint": "f",
                                               "counts": counts or {}, "figures": figures}}

    return {
        "generate": of("generate", {"records": 300, "generated": 300}, backend="transformers"),
        "train": of("train", tau=3.6789, acceptance_replayed=3.2711, full_acc_0=0.949,
                    loss_0=0.61),
        "benchmark": of("benchmark", engine="embedded", acceptance_length=3.2649,
                        verdict="speculation is 1.44x plain greedy decoding",
                        report="/r/report.md", lossless=True, speedup=1.441,
                        speculative_tokens_per_s=800.0, greedy_tokens_per_s=555.0),
    }


def test_the_run_summary_leads_with_the_figures_and_lists_every_stage():
    report = run_report(results(), "tiny, data 3f2a9c1b")
    assert report.kind == "markdown" and report.key == "run"
    lines = report.text.splitlines()
    assert lines[0] == "# tiny, data 3f2a9c1b"
    assert lines[2] == ("| records | tau | acceptance replayed | measured acceptance | "
                        "speedup | lossless |")
    assert lines[4] == "| 300 | 3.679 | 3.271 | 3.265 | 1.44x | yes |"
    assert "| generate | Completed | 300 records, 300 answered by the target | - |" in lines
    assert any(line.startswith("| benchmark | Completed | measured acceptance length 3.26")
               and "<br>" not in line and line.count("|") >= 4 for line in lines)
    rows, problems = stage_rows(results())
    assert [r.stage for r in rows] == ["generate", "train", "benchmark"] and problems == []


def test_the_form_reads_a_config_by_path_or_example_name_or_whole(tmp_path):
    by_name = form_config("tiny", None, ["train.epochs=2"])
    assert by_name.name == "tiny" and by_name.train.epochs == 2
    by_path = form_config(str(REPO / "examples" / "tiny.yaml"), None, [])
    assert by_path.data.sources[0].path == by_name.data.sources[0].path  # resolved alike
    whole = form_config("ignored", by_name.model_dump(mode="json"), ["train.ttt_steps=2"])
    assert whole.train.epochs == 2 and whole.train.ttt_steps == 2
    with pytest.raises(ConfigError, match=r"no such file on this machine.*tiny"):
        form_config("/nowhere/pipeline.yaml", None, [])
    with pytest.raises(ConfigError, match="train.epochs"):
        form_config("tiny", None, ["train.epochs=zero"])


def test_a_bad_stage_name_in_the_form_names_the_valid_ones():
    from flows.pipeline import selected_stages

    assert selected_stages(["fix-keys", "train"]) == ["export", "train"]
    assert selected_stages(None) is None
    with pytest.raises(ConfigError, match="unknown stage 'trian'; choose from generate, merge"):
        selected_stages(["trian"])


def test_partitions_default_to_generate_max_new_tokens():
    from draftsmith.generate.stage import with_completion_budget

    endpoint = EndpointConfig(base_url="http://x/v1", model="m", partitions=[
        {"max_prompt_tokens": 64, "concurrency": 2},
        {"max_prompt_tokens": 4096, "concurrency": 1, "max_tokens": 9}])
    budget = [p.max_tokens for p in with_completion_budget(endpoint, 96).partitions]
    assert budget == [96, 9]
    assert [p.max_tokens for p in EndpointConfig(base_url="http://x/v1",
                                                 model="m").partitions] == [None, None]


def test_the_run_summary_has_a_row_per_prompt_set():
    run = results()
    run["benchmark"]["descriptor"]["figures"]["sets"] = [
        {"set": "chat", "split": "test", "prompts": 80, "acceptance": 2.61, "ci95": [2.5, 2.7],
         "per_position": [0.7, 0.5, 0.4], "identical": "80/80", "speedup": 1.9}]
    text = run_report(run, "smollm2").text
    assert "## By prompt set" in text
    assert "| chat | test | 80 | 2.610 | 2.500-2.700 | 0.70, 0.50, 0.40 | 80/80 | 1.9 |" in text
