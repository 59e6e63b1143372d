"""draftsmith.extract.preflight: the store-size estimate matches what extraction writes, and a
store that will not fit stops the run before any forward pass."""

from __future__ import annotations

import pytest

from draftsmith.artifacts import Descriptor, plan_stage
from draftsmith.config import ExtractConfig, TargetConfig
from draftsmith.extract.preflight import (
    DiskSpaceError,
    bytes_per_token,
    check_extract_disk,
    estimate_store_bytes,
    free_bytes,
    merged_tokens,
)
from tests.test_merge import merge, record


@pytest.fixture(scope="module")
def merged(tmp_path_factory, random_target):
    records = [record("s", i, f"question {i}", f"def f{i}(x):\n    return x + {i}\n")
               for i in range(12)]
    return merge(tmp_path_factory.mktemp("merged"), records, random_target,
                 validation_fraction=0.3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_estimate_matches_the_store_extraction_writes(tmp_path, merged, random_target,
                                                      random_target_dir, dtype):
    from draftsmith.extract.stage import run_extract

    cfg = ExtractConfig(dtype=dtype, shard_tokens=1 << 20)
    estimate = check_extract_disk(cfg, merged, random_target, tmp_path, [1, 3, 4])
    assert estimate.tokens == merged_tokens(merged) == (
        merged.counts["train_tokens"] + merged.counts["validation_tokens"])
    assert estimate.bytes_per_token == 4 * 64 * {"float32": 4, "bfloat16": 2}[dtype] + 13
    hidden = run_extract(cfg, TargetConfig(model=str(random_target_dir)), merged,
                         random_target, plan_stage(tmp_path, "extract", cfg, [merged]))
    written = sum(p.stat().st_size for p in hidden.dir.glob("*.safetensors"))
    assert hidden.counts["tokens"] == estimate.tokens
    # The estimate is the payload plus a small margin: never below what is written, and
    # within a few percent of it.
    assert written <= estimate.needed_bytes <= 1.05 * written


def test_a_store_that_will_not_fit_stops_with_the_figures_and_the_fixes(tmp_path,
                                                                        random_target):
    huge = Descriptor(stage="merge", path=str(tmp_path), key="k", fingerprint="f",
                      counts={"train_tokens": 10**12, "validation_tokens": 10**10})
    free = free_bytes(tmp_path)
    with pytest.raises(DiskSpaceError) as info:
        check_extract_disk(ExtractConfig(dtype="float32"), huge, random_target,
                           tmp_path / "extract" / "key", [1, 3, 4])
    message = str(info.value)
    assert "1010000000000 tokens x 1037 bytes/token" in message
    assert f"{free / (1 << 30):.1f} GiB free" in message
    assert "extract.dtype: bfloat16" in message and "run_root" in message
    assert not (tmp_path / "extract").exists()  # nothing was started


def test_estimate_for_the_reference_deployment():
    """Kimi-K2.5 shape (hidden 7168, 3 aux layers, bf16): 87.8M tokens come to ~4.6 TiB, the
    size the store of hidden states for 87.8M tokens reached on a real run (~4.6 TB)."""
    assert bytes_per_token(7168, 3, "bfloat16") == 57357
    payload = 87_800_000 * 57357
    assert payload / 2**40 == pytest.approx(4.58, abs=0.01)
    assert estimate_store_bytes(87_800_000, 7168, 3, "bfloat16") == int(payload * 1.02)


def test_free_bytes_of_a_destination_that_does_not_exist_yet(tmp_path):
    assert free_bytes(tmp_path / "a" / "b" / "c") == free_bytes(tmp_path) > 0


def test_merged_tokens_of_an_older_merge_output_reads_the_splits(tmp_path, merged):
    older = merged.model_copy(update={"counts": {"train_tokens": merged.counts["train_tokens"]}})
    assert merged_tokens(older) == merged_tokens(merged)
