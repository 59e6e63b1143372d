"""A stage spread over several GPU hosts, in the engine (draftsmith/hosts.py and each stage's
parts): ranges that cover the work once, the proof a host must read back, generate and extract
split into ranges and joined into what one host writes, a range that failed redone alone, and
training's nodes refused where no hosts are. Through Prefect workers and torchrun on two
"hosts": tests/test_multi_host.py."""

from __future__ import annotations

import json

import pytest

from draftsmith import hosts
from draftsmith.artifacts import plan_stage
from draftsmith.config import ConfigError, parse_config
from draftsmith.hosts import HostPart, SharedStorageError
from tests.conftest import REPO, TRAIN_INPUT_SECTIONS, TRAIN_INPUT_SOURCES


def two_host_config(target_dir, run_root, **train) -> dict:
    return {"run_root": str(run_root), "target": {"model": str(target_dir)},
            "data": {"sources": TRAIN_INPUT_SOURCES}, **TRAIN_INPUT_SECTIONS,
            "train": train,
            "orchestration": {"mode": "distributed", "gpu_hosts": ["gpu-a", "gpu-b"]}}


def parts(plan, kind: str = "range", count: int = 2) -> list[HostPart]:
    run_id = hosts.write_proof(plan)
    return [HostPart(index=k, count=count, host=f"gpu-{'ab'[k]}", run_id=run_id, kind=kind)
            for k in range(count)]


@pytest.mark.parametrize("items,count", [(3, 2), (2, 3), (10, 4), (7, 7), (0, 2)])
def test_ranges_cover_the_work_once_and_differ_by_at_most_one(items, count):
    bounds = [hosts.range_bounds(items, count, k) for k in range(count)]
    covered = [i for start, end in bounds for i in range(start, end)]
    assert covered == list(range(items))  # in order, each once
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_a_host_that_does_not_see_the_pipelines_file_refuses_naming_it(tmp_path):
    plan = plan_stage(tmp_path / "shared", "train", {}, [])
    node = parts(plan, "node")[1]
    hosts.check_shared(plan, node, str(tmp_path / "shared"), wait_s=1)  # it sees it
    # Host b's view of the same run root: a directory the pipeline never wrote to.
    elsewhere = plan_stage(tmp_path / "local-disk-of-b", "train", {}, [])
    with pytest.raises(SharedStorageError) as refused:
        hosts.check_shared(elsewhere, node, "/mnt/shared/runs", wait_s=0.2, poll_s=0.05)
    message = " ".join(str(refused.value).split())
    assert "train node 1 of 2 (GPU host gpu-b)" in message
    assert str(hosts.proof_path(elsewhere, node.run_id)) in message
    assert "run_root (/mnt/shared/runs) must be one storage" in message
    # An earlier dispatch's proof does not count for this one.
    stale = node.model_copy(update={"run_id": "train-earlier-00000000"})
    with pytest.raises(SharedStorageError):
        hosts.check_shared(plan, stale, "/mnt/shared/runs", wait_s=0.1, poll_s=0.05)


def test_generate_split_over_two_hosts_writes_what_one_host_writes(
        train_inputs, random_target, random_target_dir, tmp_path):
    """Each host answers whole batches of the one-host order into its own journal files; the
    join asks nothing and writes the same records, byte for byte."""
    from draftsmith.data.records import RECORDS_FILE
    from draftsmith.errors import WorkerCrashError
    from draftsmith.generate.stage import run_generate

    config = parse_config(two_host_config(random_target_dir, tmp_path))
    spread = _stage("generate").spread
    assert _stage("generate").parts(config) == 2
    plan = plan_stage(tmp_path, "generate", {}, [random_target])
    inputs = {"target": random_target}
    first, second = parts(plan)
    reports = [spread.run(config, inputs, plan, first)]
    with pytest.raises(WorkerCrashError, match="16 of 32 prompts have no answer"):
        spread.finish(config, inputs, plan, first.run_id)  # host b's range is missing
    reports.append(spread.run(config, inputs, plan, second))
    assert [r["answered"] for r in reports] == [16, 16]  # two batches of 16, one each
    journals = {p.name for p in (plan.dir.parent / "answers").rglob("answers*.jsonl")}
    assert journals == {f"answers.{first.run_id}-0.jsonl", f"answers.{first.run_id}-1.jsonl"}
    joined = spread.finish(config, inputs, plan, first.run_id)
    alone = train_inputs["generated"]
    assert (joined.dir / RECORDS_FILE).read_bytes() == (alone.dir / RECORDS_FILE).read_bytes()
    summary = json.loads((joined.dir / "generation.json").read_text())
    assert (summary["answered_this_attempt"], summary["answered_before"]) == (32, 0)
    assert joined.counts == alone.counts
    assert not hosts.parts_dir(plan).exists()  # the parts' bookkeeping went with the join
    # A later run (one host) finds every answer in the hosts' journals.
    again = plan_stage(tmp_path / "again", "generate", {}, [random_target])
    again_answers = again.dir.parent / "answers"
    again_answers.parent.mkdir(parents=True)
    (plan.dir.parent / "answers").rename(again_answers)
    rerun = run_generate(config.generate, config.data, config.target, random_target, again)
    assert json.loads((rerun.dir / "generation.json").read_text())["answered_before"] == 32


def _stage(name: str):
    from draftsmith import stages

    return stages.get(name)


def test_extract_ranges_join_into_one_hosts_store_and_only_an_unfinished_range_reruns(
        train_inputs, random_target, random_target_dir, tmp_path):
    config = parse_config(two_host_config(random_target_dir, tmp_path))
    stage = _stage("extract")
    assert stage.parts(config) == 2
    merged = train_inputs["merged"]
    inputs = {"merge": merged, "target": random_target}
    plan = plan_stage(tmp_path, "extract", {}, [merged])
    stage.spread.prepare(config, inputs, plan)
    first, second = parts(plan)
    assert stage.spread.run(config, inputs, plan, first) == {"shards": 2, "computed": 2,
                                                             "tokens": 826}
    # Host b's range failed: the next dispatch starts it alone.
    assert hosts.parts_to_run(plan, [first, second], coupled=False) == [second]
    written = {p.name: p.stat().st_mtime_ns for p in plan.dir.glob("*.safetensors")}
    assert stage.spread.run(config, inputs, plan, second)["computed"] == 1
    assert {p.name: p.stat().st_mtime_ns for p in plan.dir.glob("*.safetensors")
            if p.name in written} == written  # range a's shards untouched
    # A range that crashed half way redoes only its missing shard.
    (plan.dir / ".receipts" / "train-00001.safetensors.json").unlink()
    assert stage.spread.run(config, inputs, plan, first)["computed"] == 1
    joined = stage.spread.finish(config, inputs, plan, first.run_id)
    alone = train_inputs["hidden"]
    assert joined.fingerprint == alone.fingerprint  # every file's sha256, the index included
    assert (joined.dir / "store.json").read_bytes() == (alone.dir / "store.json").read_bytes()
    assert joined.counts == alone.counts
    # The same figures but the capture rate: each host's part reports its own, the join none.
    assert joined.figures == {**alone.figures, "tokens_per_s": None}
    assert alone.figures["tokens_per_s"] > 0


def test_a_join_that_finds_a_shard_missing_forgets_which_ranges_finished(
        train_inputs, random_target, random_target_dir, tmp_path):
    from draftsmith.errors import WorkerCrashError

    config = parse_config(two_host_config(random_target_dir, tmp_path))
    spread = _stage("extract").spread
    merged = train_inputs["merged"]
    inputs = {"merge": merged, "target": random_target}
    plan = plan_stage(tmp_path, "extract", {}, [merged])
    ranges = parts(plan)
    for part in ranges:
        spread.run(config, inputs, plan, part)
    (plan.dir / "train-00000.safetensors").unlink()  # lost after its range finished
    with pytest.raises(WorkerCrashError, match=r"train-00000.safetensors.*not written \(a "
                                               r"host's range did not finish\)"):
        spread.finish(config, inputs, plan, ranges[0].run_id)
    assert hosts.parts_to_run(plan, ranges, coupled=False) == ranges  # each checks its shards


def test_nodes_join_the_c10d_rendezvous_served_by_the_first_host(tmp_path):
    from draftsmith.config import TrainConfig
    from draftsmith.train.launch import torchrun_argv

    cfg = TrainConfig(nnodes=2, nproc_per_node=8, rdzv_endpoint="gpu-a:29400",
                      rdzv_timeout_s=900)
    job = tmp_path / "job.json"
    first, second = (HostPart(index=k, count=2, host=f"gpu-{'ab'[k]}", run_id="train-k-1",
                              kind="node", address=f"10.0.0.{k + 1}" if k else None)
                     for k in range(2))
    argv = torchrun_argv(cfg, job, first)
    assert argv[1:3] == ["-m", "torch.distributed.run"] and "--standalone" not in argv
    for flag in ("--nnodes=2", "--nproc_per_node=8", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=gpu-a:29400", "--rdzv-id=train-k-1"):
        assert flag in argv
    assert "--rdzv-conf=is_host=true,join_timeout=900,read_timeout=900" in argv
    assert not any(flag.startswith("--local-addr") for flag in argv)  # its host name
    argv = torchrun_argv(cfg, job, second)
    assert "--rdzv-conf=is_host=false,join_timeout=900,read_timeout=900" in argv
    assert "--local-addr=10.0.0.2" in argv  # the block's address: where the others reach it
    assert "--standalone" in torchrun_argv(TrainConfig(nproc_per_node=2), job)


def test_training_across_hosts_needs_an_endpoint_and_distributed_mode(train_inputs, tmp_path):
    from pydantic import ValidationError

    from draftsmith.config import TrainConfig
    from draftsmith.errors import InputError
    from draftsmith.train.trainer import run_train

    with pytest.raises(ValidationError, match=r"train.nnodes=2 needs train.rdzv_endpoint="
                                              r"HOST:PORT \(got None\)"):
        TrainConfig(nnodes=2)
    with pytest.raises(ValidationError, match="got 'gpu-a'"):
        TrainConfig(nnodes=2, rdzv_endpoint="gpu-a")
    cfg = TrainConfig(nnodes=2, rdzv_endpoint="127.0.0.1:29400")
    plan = plan_stage(tmp_path, "train", {}, [train_inputs["hidden"]])
    with pytest.raises(InputError, match="orchestration.mode=distributed"):
        run_train(cfg, train_inputs["hidden"], train_inputs["merged"], train_inputs["target"],
                  plan)
    assert not plan.dir.exists()  # refused before anything was written


def test_node_count_enters_the_train_key_only_above_one(tmp_path):
    from draftsmith.plan import key_material

    raw = {"data": {"sources": [{"name": "a", "path": str(REPO / "examples/data/openai.jsonl")}]},
           "run_root": str(tmp_path)}
    one = key_material(parse_config(raw), "train")
    assert "nnodes" not in one  # one host's keys are what they were
    two = key_material(parse_config({**raw, "train": {
        "nnodes": 2, "rdzv_endpoint": "gpu-a:29400"}}), "train")
    assert two["nnodes"] == 2 and two["train"] == one["train"]
    # Where the rendezvous runs changes nothing trained.
    moved = key_material(parse_config({**raw, "train": {
        "nnodes": 2, "rdzv_endpoint": "gpu-c:29500", "rdzv_timeout_s": 60}}), "train")
    assert moved == two


def test_gpu_hosts_are_named_once_each():
    with pytest.raises(ConfigError, match=r"orchestration.gpu_hosts names \['gpu-a'\] more "
                                          "than once"):
        parse_config({"data": {"sources": [{"name": "a", "path": "x"}]},
                      "orchestration": {"gpu_hosts": ["gpu-a", "gpu-b", "gpu-a"]}})
