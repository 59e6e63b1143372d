"""benchmarks/gpu_speculative/attention_variants.py: each variant's runs fold into one entry,
its figures low to high, its plain tokens weighed against SDPA's in the same dtype; and a real
run on the CPU gives each variant its line, decode attention's tokens equal to SDPA's."""

from __future__ import annotations

import json

from tests.scripts import benchmark_script


def variants_module():
    return benchmark_script("gpu_speculative/attention_variants.py")


def line(variant: str, plain_ms: float, tokens: list[list[int]]) -> str:
    return json.dumps({"variant": variant, "device": "NVIDIA H100 80GB HBM3",
                       "ms_per_plain_token": plain_ms,
                       "ms_per_round": {"draft": 0.5, "verify": plain_ms + 0.5, "other": 0.1},
                       "plain_tokens": tokens})


def test_runs_fold_per_variant_against_sdpa_of_the_same_dtype(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join([line("sdpa", 3.1, [[1, 2], [3, 4]]),
                                line("decode", 2.5, [[1, 2], [3, 4]]),
                                line("bf16:sdpa", 1.9, [[1, 2], [3, 5]])]) + "\n")
    second.write_text("\n".join([line("decode", 2.1, [[1, 2], [3, 9]]),
                                 line("bf16:decode", 1.4, [[1, 2], [3, 4]])]) + "\n")
    summary = variants_module().summarize([first, second])
    assert summary["decode"]["runs"] == 2
    assert summary["decode"]["ms_per_plain_token"] == [2.1, 2.5]
    assert summary["decode"]["ms_per_round"]["verify"] == [2.6, 3.0]
    assert summary["decode"]["plain_tokens_as_sdpa"] == ["2/2", "1/2"]
    # bf16 is weighed against bf16's SDPA, not float32's
    assert summary["bf16:decode"]["plain_tokens_as_sdpa"] == ["1/2"]


def test_a_run_on_the_cpu_times_each_variant(tmp_path):
    out = tmp_path / "variants.jsonl"
    variants_module().main(["--device", "cpu", "--prompts", "1", "--max-new-tokens", "3",
                            "--variants", "sdpa", "decode", "--out", str(out)])
    rows = {row["variant"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert rows["sdpa"]["attention"] == "sdpa"
    assert rows["decode"]["attention"] == "draftsmith_grouped_verify_matmul"
    for row in rows.values():
        assert row["ms_per_plain_token"] > 0 and row["ms_per_round"]["verify"] > 0
        assert row["identical_outputs"] == "3/3"  # the benchmark stage's own check
    assert rows["decode"]["plain_tokens"] == rows["sdpa"]["plain_tokens"]
