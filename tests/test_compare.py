"""Comparing configs: the variants' syntax and a row's figures (the flow itself runs in
tests/test_pipeline_e2e.py, on the session's Prefect API)."""

from __future__ import annotations

import pytest

from draftsmith.compare import (
    Variant,
    check_variants,
    comparison_markdown,
    comparison_row,
    parse_variant,
    shown_columns,
)
from draftsmith.config import ConfigError


def test_a_variant_is_a_name_and_overrides():
    assert parse_variant("e2: train.epochs=2 train.lr=1e-3") == Variant(
        "e2", ("train.epochs=2", "train.lr=1e-3"))
    assert parse_variant("base") == Variant("base")
    assert parse_variant("code: 'data.sources=[{name: f, builtin: python-functions}]'") == \
        Variant("code", ("data.sources=[{name: f, builtin: python-functions}]",))
    assert Variant("e2", ("train.epochs=2",)).run_overrides("smollm2") == [
        "train.epochs=2", "name=smollm2-e2"]
    with pytest.raises(ConfigError, match=r"\['epochs'\] are not key=value"):
        parse_variant("e2: epochs")
    with pytest.raises(ConfigError, match="start with the variant's name"):
        parse_variant("train.epochs=2")
    with pytest.raises(ConfigError, match=r"\['a'\] given more than once"):
        check_variants([Variant("a"), Variant("a")])


def test_a_row_has_a_column_per_set_and_part():
    def stage(state, cost=None, **figures):
        return {"state": state, "descriptor": {"counts": {}, "figures": figures, "cost": cost}}

    results = {
        "generate": stage("Cached", backend="vllm", tokens_per_s=5120.04, cost={
            "seconds": 300.0, "peak_gpu_gib": None, "disk_bytes": 1_000_000}),
        "merge": {"state": "Cached", "descriptor": {
            "counts": {"train_records": 900}, "figures": {},
            "cost": {"seconds": 2.5, "peak_gpu_gib": None, "disk_bytes": 3_000_000}}},
        "extract": stage("Cached", aux_layer_ids=[1, 2, 3], tokens_per_s=81234.56),
        "train": stage("Completed", tau=3.31234, acceptance_replayed=3.1, tokens_per_s=41234.5,
                       cost={
                           "seconds": 61.25, "peak_gpu_gib": 4.5, "disk_bytes": 40_250_000}),
        "export": stage("Cached", drafter_dir="/runs/x/export/k/drafter", cost={
            "seconds": None, "peak_gpu_gib": None, "disk_bytes": 20_000_000}),
        "benchmark": stage("Completed", speedup=1.8123, sets=[
            {"set": "chat", "split": "dev", "acceptance": 2.61, "ci95": [2.5, 2.7],
             "identical": "40/40"},
            {"set": "code", "split": "dev", "acceptance": 3.05, "ci95": [2.9, 3.2],
             "identical": "33/34"}])}
    row = comparison_row(Variant("wide", ("drafter.intermediate_size=3072",)), results)
    assert row == {"variant": "wide", "overrides": "drafter.intermediate_size=3072",
                   "ran": "train, benchmark", "train records": 900, "tau": 3.312,
                   "replayed": 3.1, "train tokens/s": 41234.5, "chat dev": "2.610 [2.500, 2.700]",
                   "code dev": "3.050 [2.900, 3.200]", "identical": "73/74", "speedup": 1.812,
                   "generate tokens/s": 5120.04, "extract tokens/s": 81234.56,
                   "generate s": 300.0, "merge s": 2.5, "train s": 61.25, "GPU peak GiB": 4.5,
                   "disk MB": 64.2,
                   "drafter": "/runs/x/export/k/drafter"}
    page = comparison_markdown("smollm2: 1 variants", [row])
    assert "| variant | overrides | ran |" in page and "| wide |" in page
    trained_only = {**row, "speedup": None, "identical": None}
    assert shown_columns([trained_only, {**trained_only, "speedup": 1.2}]) == [
        c for c in row if c != "identical"]  # a column no row has a value in is not shown


def test_a_variant_whose_answers_came_from_the_journal_says_so_not_a_rate():
    """Answers are kept across generate's speed settings: a variant that changed only
    generate.cache asked the target nothing, and its row must not read as a fast generate."""
    reused = {"generate": {"state": "Completed", "descriptor": {
        "counts": {"records": 300}, "figures": {"backend": "transformers", "tokens_per_s": None},
        "cost": {"seconds": 0.19, "peak_gpu_gib": None, "disk_bytes": 137_420}}}}
    row = comparison_row(Variant("static", ("generate.cache=static",)), reused)
    assert row["generate tokens/s"] == "reused" and row["extract tokens/s"] is None
    assert comparison_row(Variant("none"), {})["generate tokens/s"] is None  # no generate ran
