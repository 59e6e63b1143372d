"""The extract stage: bucketing, exact layers in the stored shards, resume after a kill -9,
data parallel over processes, progress."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from draftsmith.artifacts import Descriptor, external_descriptor, plan_stage
from draftsmith.config import ExtractConfig, TargetConfig
from draftsmith.extract.batching import plan_batches, plan_shards
from draftsmith.extract.stage import run_extract, throughput
from draftsmith.extract.store import RECEIPTS, ShardReader
from tests.conftest import REPO

AUX_IDS = [1, 3, 4]


def make_merged(root: Path, n_train: int, n_val: int, vocab: int, seed: int = 0) -> Descriptor:
    """A merge output (train/validation parquet) with random token rows of 3..40 tokens."""
    g = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("validation", n_val)):
        rows = []
        for i in range(n):
            T = int(torch.randint(3, 41, (1,), generator=g))
            rows.append({"id": f"{split}-{i}", "source": "test",
                         "input_ids": torch.randint(0, vocab, (T,), generator=g).tolist(),
                         "loss_mask": torch.randint(0, 2, (T,), generator=g).tolist()})
        pq.write_table(pa.Table.from_pylist(rows), root / f"{split}.parquet")
    return external_descriptor("merge", root, f"merged-{seed}-{n_train}-{n_val}")


@pytest.fixture(scope="module")
def merged(tmp_path_factory, random_target):
    return make_merged(tmp_path_factory.mktemp("merged"), 30, 6,
                       random_target.figures["vocab_size"])


def extract(root: Path, merged: Descriptor, target: Descriptor, **overrides) -> Descriptor:
    cfg = ExtractConfig(shard_tokens=120, batch_size=4, batch_tokens=64, **overrides)
    plan = plan_stage(root, "extract", {"k": 1}, [merged, target])
    return run_extract(cfg, TargetConfig(model=target.path), merged, target, plan)


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def single(tmp_path_factory, merged, random_target):
    """One uninterrupted single-process extraction: the reference the other runs must equal."""
    descriptor = extract(tmp_path_factory.mktemp("single"), merged, random_target)
    return descriptor, shard_bytes(descriptor.dir)


# --------------------------------------------------------------------------- bucketing

def test_length_bucketing_keeps_padding_small_and_respects_the_budget():
    g = torch.Generator().manual_seed(0)
    rows = [{"id": f"r{i}", "input_ids": [0] * int(torch.randint(10, 500, (1,), generator=g))}
            for i in range(300)]
    specs = plan_shards("train", rows, shard_tokens=4000)
    assert sorted(i for s in specs for i in s.ids) == sorted(r["id"] for r in rows)
    assert all(s.num_tokens >= 4000 for s in specs[:-1])
    lengths = [t for s in specs for t in s.tokens]
    assert lengths == sorted(lengths)  # neighbours have similar lengths
    bucketed = [plan_batches(s.tokens, batch_size=16, batch_tokens=2048) for s in specs]
    for plan, spec in zip(bucketed, specs, strict=True):
        assert sorted(i for b in plan.batches for i in b) == list(range(len(spec.ids)))
        for b in plan.batches:
            assert len(b) <= 16
            assert len(b) == 1 or max(spec.tokens[i] for i in b) * len(b) <= 2048
    waste = 1 - sum(p.real_tokens for p in bucketed) / sum(p.padded_tokens for p in bucketed)
    unsorted = [len(r["input_ids"]) for r in rows]
    naive = plan_batches(unsorted, batch_size=16, batch_tokens=None)
    assert waste < 0.05 < naive.padding_waste


def test_a_sample_longer_than_the_budget_runs_alone():
    plan = plan_batches([5, 6, 100, 7], batch_size=8, batch_tokens=20)
    assert plan.batches == [[0, 1], [2], [3]]
    assert plan.padded_tokens == 12 + 100 + 7


# --------------------------------------------------------------------------- stage

def reference_states(model, ids: list[int]):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1][0] for i in AUX_IDS], dim=-1)  # [T, 3H]
    return aux, out.hidden_states[-1][0], out.logits[0]  # [T, H] after the final norm, [T, V]


def test_stored_states_are_transformers_hidden_states_of_those_layers(
        single, merged, random_target_model):
    descriptor, _ = single
    reader = ShardReader(descriptor.path)
    assert reader.aux_layer_ids == AUX_IDS
    assert descriptor.counts["samples"] == len(reader) == 36
    assert descriptor.counts["shards"] > 3
    rows = {r["id"]: r for r in pq.read_table(Path(merged.path) / "train.parquet").to_pylist()}
    for sample_id in ("train-0", "train-7", "train-29"):
        sample = reader.sample(sample_id)
        assert sample.input_ids.tolist() == rows[sample_id]["input_ids"]
        assert sample.loss_mask.tolist() == rows[sample_id]["loss_mask"]
        aux, final, logits = reference_states(random_target_model,
                                              rows[sample_id]["input_ids"])
        # Batched with padding vs alone: equal up to float32 kernel noise.
        torch.testing.assert_close(sample.aux, aux, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sample.final, final, rtol=1e-4, atol=1e-5)
        # The target's own greedy next token at every position, for the trainer's mask.
        assert sample.target_argmax.dtype == torch.int32
        assert sample.target_argmax.tolist() == logits.argmax(-1).tolist()
    assert 0 <= descriptor.figures["padding_waste"] < 0.2
    assert descriptor.figures["tokens_per_s"] > 0


def test_the_target_can_capture_in_bfloat16_while_it_stays_float32_elsewhere(
        tmp_path, merged, random_target, random_target_model):
    """extract.target_dtype: bf16 states for training (what a bf16 server computes) while
    target.dtype stays float32 for the embedded engine's exact identity check."""
    descriptor = extract(tmp_path, merged, random_target, target_dtype="bfloat16")
    sample = ShardReader(descriptor.path).sample("train-7")
    aux, final, _ = reference_states(random_target_model, sample.input_ids.tolist())
    # The bf16 target's states: near the float32 ones, and not equal to them.
    torch.testing.assert_close(sample.aux, aux, rtol=5e-2, atol=5e-2)
    assert not torch.allclose(sample.aux, aux, rtol=1e-4, atol=1e-5)
    assert sample.aux.dtype == torch.float32  # the store's dtype is extract.dtype


def test_rerun_of_a_finished_store_redoes_only_what_is_missing(tmp_path, single, merged,
                                                               random_target):
    _, reference = single
    descriptor = extract(tmp_path, merged, random_target)
    victim = sorted(reference)[2]
    (descriptor.dir / victim).unlink()  # a lost shard, receipt still there: redone
    (descriptor.dir / "manifest.json").unlink()
    (descriptor.dir / f".{sorted(reference)[3]}.tmp").write_bytes(b"half a shard")
    before = {p.name: p.stat().st_mtime_ns for p in descriptor.dir.glob("*.safetensors")}
    again = extract(tmp_path, merged, random_target)
    after = {p.name: p.stat().st_mtime_ns for p in again.dir.glob("*.safetensors")}
    assert shard_bytes(again.dir) == reference
    assert [n for n in after if before.get(n) != after[n]] == [victim]
    assert not list(again.dir.glob(".*.tmp"))
    assert again.fingerprint == single[0].fingerprint
    assert again.figures["tokens_per_s"] > 0  # the one shard it computed
    (again.dir / "manifest.json").unlink()  # every shard written: nothing to compute, no rate
    assert extract(tmp_path, merged, random_target).figures["tokens_per_s"] is None


def test_the_capture_rate_is_every_ranks_tokens_over_the_slowest_ranks_seconds():
    assert throughput([{"tokens": 100, "seconds": 2.0}, {"tokens": 300, "seconds": 4.0}]) == 100.0
    assert throughput([{"rank": 1, "shards": 0}, {"tokens": 50, "seconds": 0.5}]) == 100.0
    assert throughput([{"tokens": 0, "seconds": 0.0}]) is None
    assert throughput([]) is None


KILLED_RUN = """
import json, sys, time
from draftsmith.artifacts import Descriptor, StagePlan
from draftsmith.config import ExtractConfig, TargetConfig
from draftsmith.extract import capture
from draftsmith.extract.stage import run_extract

slow = capture.HiddenStateCapture.__call__
def throttled(self, *a, **k):
    time.sleep(0.05)  # long enough for the test to kill the run between two shards' writes
    return slow(self, *a, **k)
capture.HiddenStateCapture.__call__ = throttled
args = json.loads(sys.argv[1])
run_extract(ExtractConfig(**args["cfg"]), TargetConfig(model=args["target"]["path"]),
            Descriptor(**args["merged"]), Descriptor(**args["target"]),
            StagePlan(**args["plan"]))
"""


def test_kill_9_during_extraction_then_rerun_gives_byte_identical_shards(
        tmp_path, single, merged, random_target):
    descriptor, reference = single
    cfg = {"shard_tokens": 120, "batch_size": 4, "batch_tokens": 64}
    plan = plan_stage(tmp_path, "extract", {"k": 1}, [merged, random_target])
    payload = json.dumps({"cfg": cfg, "merged": merged.model_dump(),
                          "target": random_target.model_dump(), "plan": plan.model_dump()})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", KILLED_RUN, payload], env=env, cwd=REPO)
    receipts = plan.dir / RECEIPTS
    deadline = time.monotonic() + 120
    while len(list(receipts.glob("*.json"))) < 2:
        assert child.poll() is None, "the extraction ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    done = len(list(receipts.glob("*.json")))
    assert 2 <= done < len(reference), "kill landed after the last shard: nothing was tested"
    assert not (plan.dir / "store.json").exists()
    with pytest.raises(ValueError, match="did not finish"):
        ShardReader(plan.dir)
    resumed = run_extract(ExtractConfig(**cfg), TargetConfig(model=random_target.path), merged,
                          random_target, plan)
    assert shard_bytes(resumed.dir) == reference
    assert resumed.fingerprint == descriptor.fingerprint
    assert len(list(ShardReader(resumed.dir).samples("train"))) == 30


def test_two_processes_write_the_same_shards_as_one(tmp_path, single, merged, random_target):
    descriptor, reference = single
    parallel = extract(tmp_path, merged, random_target, data_parallel=2)
    assert shard_bytes(parallel.dir) == reference
    ours = json.loads((parallel.dir / "store.json").read_text())
    theirs = json.loads((descriptor.dir / "store.json").read_text())
    assert ours == theirs
    assert parallel.fingerprint == descriptor.fingerprint


def test_progress_reports_tokens_rate_eta_bytes_and_free_disk(tmp_path, merged, random_target,
                                                              caplog, monkeypatch):
    from draftsmith import progress

    seen = []
    progress.add_listener(seen.append)
    monkeypatch.setattr(progress.Progress.__init__, "__defaults__", ("item", 0.0))  # every update
    try:
        with caplog.at_level(logging.INFO, logger="draftsmith"):
            extract(tmp_path, merged, random_target)
    finally:
        progress.remove_listener(seen.append)
    lines = [r.getMessage() for r in caplog.records if r.name == "draftsmith.progress"]
    assert lines, "no progress lines"
    last = lines[-1]
    for field in ("tokens", "token/s", "samples 36", "written", "free_disk"):
        assert field in last, (field, last)
    assert any("ETA" in line for line in lines)
    assert seen and seen[-1].done == seen[-1].total


def test_config_refuses_device_map_with_data_parallel():
    with pytest.raises(ValueError, match="device_map"):
        ExtractConfig(device_map="auto", data_parallel=2)


def test_plan_key_ignores_how_many_processes_compute_the_shards():
    from draftsmith.config import PipelineConfig
    from draftsmith.plan import key_material

    base = PipelineConfig(data={"sources": [{"name": "a", "path": "x.jsonl"}]})
    other = base.model_copy(deep=True)
    other.extract.data_parallel, other.extract.writer_threads = 4, 3
    assert key_material(base, "extract") == key_material(other, "extract")
    other.extract.shard_tokens = 7
    assert key_material(base, "extract") != key_material(other, "extract")


TORCHRUN_SCRIPT = """
import json, os, sys
from draftsmith.artifacts import Descriptor, StagePlan
from draftsmith.config import ExtractConfig, TargetConfig
from draftsmith.extract.stage import run_extract

args = json.loads(open(sys.argv[1]).read())
d = run_extract(ExtractConfig(**args["cfg"]), TargetConfig(model=args["target"]["path"]),
                Descriptor(**args["merged"]), Descriptor(**args["target"]),
                StagePlan(**args["plan"]))
# One write per line: print's pieces, unbuffered (PYTHONUNBUFFERED), interleave between the
# ranks' shared stdout ("rank 0 rank fingerprint1 fingerprint ...", CI of d666edf).
sys.stdout.write(f"rank {os.environ['RANK']} fingerprint {d.fingerprint}\\n")
sys.stdout.flush()
"""


def test_torchrun_world_of_two_writes_the_same_store(tmp_path, single, merged, random_target):
    descriptor, reference = single
    plan = plan_stage(tmp_path / "run", "extract", {"k": 1}, [merged, random_target])
    (tmp_path / "args.json").write_text(json.dumps({
        "cfg": {"shard_tokens": 120, "batch_size": 4, "batch_tokens": 64},
        "merged": merged.model_dump(), "target": random_target.model_dump(),
        "plan": plan.model_dump()}))
    (tmp_path / "script.py").write_text(TORCHRUN_SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(tmp_path / "script.py"),
         str(tmp_path / "args.json")],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO,
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"fingerprint {descriptor.fingerprint}") == 2, result.stdout
    assert shard_bytes(plan.dir) == reference


def test_each_rank_gets_an_indexed_device():
    """`target.device: cuda` must reach torch.cuda.set_device with an index (it refuses a bare
    "cuda"; seen on the H200)."""
    from draftsmith.distributed import Dist

    def _rank_device(device: str, local_rank: int, world: int) -> str:  # as extract asks
        return Dist(local_rank, world, local_rank).device_name(device)

    assert _rank_device("cuda", 0, 1) == "cuda:0"
    assert _rank_device("cuda:3", 0, 1) == "cuda:3"
    assert [_rank_device("cuda", r, 2) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert _rank_device("cpu", 1, 2) == "cpu"
