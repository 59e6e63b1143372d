"""Every stage's engine function, chained without Prefect, on the random tiny target.

Quality does not matter here (the e2e test trains a real target); what a user relies on does:
each stage writes a complete directory with a manifest, its descriptor says what it wrote, and
the next stage can read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from draftsmith.artifacts import MANIFEST, plan_stage
from draftsmith.config import (
    BenchmarkConfig,
    DataConfig,
    DeployConfig,
    ExportConfig,
    ExtractConfig,
    GenerateConfig,
    MergeConfig,
    TargetConfig,
    TrainConfig,
)
from tests.conftest import REPO
from tests.scripts import benchmark_script


@pytest.fixture(scope="module")
def chain(tmp_path_factory, random_target, random_target_dir):
    """Run generate..benchmark once; tests inspect the descriptors."""
    from draftsmith.bench.benchmark import run_benchmark
    from draftsmith.data.merge import run_merge
    from draftsmith.export.stage import run_export
    from draftsmith.extract.stage import run_extract
    from draftsmith.generate.stage import run_generate
    from draftsmith.serve.deploy import run_deploy
    from draftsmith.train.trainer import run_train

    root = tmp_path_factory.mktemp("stages")
    target_cfg = TargetConfig(model=str(random_target_dir))
    data = DataConfig(sources=[
        {"name": "sg", "path": str(REPO / "examples/data/sharegpt.jsonl"), "limit": 12},
        {"name": "oa", "path": str(REPO / "examples/data/openai.jsonl"), "limit": 12},
    ])
    out = {}

    def plan(stage, material, *inputs):
        return plan_stage(root, stage, material, list(inputs))

    t = random_target
    out["generate"] = run_generate(GenerateConfig(max_new_tokens=12, batch_size=8), data,
                                   target_cfg, t, plan("generate", {}, t))
    merge_cfg = MergeConfig(max_length=96, validation_fraction=0.3, draft_vocab_size=128)
    out["merge"] = run_merge(merge_cfg, out["generate"], t, plan("merge", {}, out["generate"]))
    out["extract"] = run_extract(ExtractConfig(shard_tokens=300), target_cfg, out["merge"], t,
                                 plan("extract", {}, out["merge"]))
    train_cfg = TrainConfig(ttt_steps=2, lr=1e-3, epochs=2, batch_tokens=256, log_every=1)
    out["train"] = run_train(train_cfg, out["extract"], out["merge"], t,
                             plan("train", {}, out["extract"]))
    out["export"] = run_export(ExportConfig(), target_cfg, out["train"], t,
                               plan("export", {}, out["train"]))
    deploy_cfg = DeployConfig(num_steps=2, num_draft_tokens=3)
    out["deploy"] = run_deploy(deploy_cfg, target_cfg, out["export"], out["merge"], t,
                               plan("deploy", {}, out["export"]))
    out["benchmark"] = run_benchmark(BenchmarkConfig(num_prompts=3, max_new_tokens=10),
                                     target_cfg, out["deploy"], out["merge"], t,
                                     plan("benchmark", {}, out["deploy"]))
    return out


def test_every_stage_writes_a_complete_directory(chain):
    for stage, descriptor in chain.items():
        assert (descriptor.dir / MANIFEST).is_file(), stage
        manifest = json.loads((descriptor.dir / MANIFEST).read_text())
        assert manifest["descriptor"]["fingerprint"] == descriptor.fingerprint


def test_generate_answers_every_prompt_only_record(chain):
    counts = chain["generate"].counts
    assert counts["records"] == 24 and counts["generated"] == 24
    lines = (chain["generate"].dir / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)
    assert {r["source"] for r in records} == {"sg", "oa"}
    # ShareGPT's system turn and "human" speaker arrive in the common roles.
    assert [m["role"] for m in records[0]["messages"]][:2] == ["system", "user"]


def test_generate_with_a_cache_length_per_batch_and_a_compiled_prefill_answers_the_same(
        chain, random_target, random_target_dir, tmp_path, monkeypatch):
    """The fast path's settings reach the generator, and in float32 change no answer."""
    from draftsmith.generate import transformers_backend
    from draftsmith.generate.stage import run_generate

    made = []

    class Recorded(transformers_backend.TransformersGenerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(transformers_backend, "TransformersGenerator", Recorded)

    target_cfg = TargetConfig(model=str(random_target_dir))
    data = DataConfig(sources=[
        {"name": "sg", "path": str(REPO / "examples/data/sharegpt.jsonl"), "limit": 12},
        {"name": "oa", "path": str(REPO / "examples/data/openai.jsonl"), "limit": 12},
    ])
    fast = GenerateConfig(max_new_tokens=12, batch_size=8, cache="static",
                          cache_lengths="batch", compile_prefill=True)
    done = run_generate(fast, data, target_cfg, random_target,
                        plan_stage(tmp_path, "generate", {"fast": True}, [random_target]))

    def answers(descriptor) -> list[str]:
        lines = (descriptor.dir / "records.jsonl").read_text().splitlines()
        return [json.loads(line)["messages"][-1]["content"] for line in lines]

    assert answers(done) == answers(chain["generate"])
    (generator,) = made
    assert (generator.cache, generator.cache_lengths, generator.compile_prefill) == (
        "static", "batch", True)
    with pytest.raises(ValueError, match="generate.compile_prefill: true fills a static cache, "
                       "but generate.cache: dynamic is dynamic on cpu"):
        run_generate(GenerateConfig(max_new_tokens=12, cache="dynamic", compile_prefill=True),
                     data, target_cfg, random_target,
                     plan_stage(tmp_path, "generate", {"dynamic": True}, [random_target]))


def test_merge_writes_splits_and_a_consistent_vocab_map(chain):
    from draftsmith.data.merge import read_split, read_vocab_map

    merged = chain["merge"]
    train, val = read_split(merged, "train"), read_split(merged, "validation")
    assert len(train) == merged.counts["train_records"] > 0
    assert len(val) == merged.counts["validation_records"] > 0
    assert not {r["id"] for r in train} & {r["id"] for r in val}
    assert all(len(r["input_ids"]) <= 96 and any(r["loss_mask"]) for r in train)
    d2t, t2d = read_vocab_map(merged)
    assert d2t.numel() == 128 and t2d.sum() == 128
    assert t2d[d2t + torch.arange(128)].all()


def test_extract_stores_every_sample_with_the_aux_layers_of_the_target(chain, random_target):
    from draftsmith.extract.store import ShardReader

    reader = ShardReader(chain["extract"].path)
    assert reader.aux_layer_ids == [1, 3, 4]  # default for 8 layers: [1, L//2-1, L-4]
    samples = list(reader.samples("train")) + list(reader.samples("validation"))
    assert len(samples) == chain["extract"].counts["samples"]
    hidden = random_target.figures["hidden_size"]
    assert all(s.aux.shape[1] == 3 * hidden and s.final.shape[1] == hidden for s in samples)
    assert len(reader.index["splits"]["train"]) > 1  # shard_tokens=300 forces several shards


def test_train_logs_metrics_and_keeps_the_best_checkpoint(chain):
    trained = chain["train"]
    rows = [json.loads(line) for line in (trained.dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    val_rows = [r for r in rows if r["split"] == "validation"]
    assert train_rows and len(val_rows) == 2  # one validation per epoch
    for key in ("loss_0", "loss_1", "full_acc_0", "cond_acc_1", "tau", "lr", "tokens_per_s"):
        assert key in train_rows[0]
    best = max(val_rows, key=lambda r: r["tau"])
    assert trained.figures["tau"] == pytest.approx(best["tau"], abs=1e-4)
    assert (trained.dir / "training.png").is_file() and (trained.dir / "training.svg").is_file()
    meta = json.loads((trained.dir / "draftsmith.json").read_text())
    assert meta["provenance"]["hidden_states"] == chain["extract"].fingerprint
    state = load_file(str(trained.dir / "drafter.safetensors"))
    assert "embed_tokens.weight" not in state  # the target's, reloaded from the target
    assert all(torch.isfinite(v.float()).all() for v in state.values())


def test_export_writes_a_validated_sglang_drafter(chain):
    from draftsmith.export.convert import detect_layout, read_drafter

    drafter_dir = chain["export"].figures["drafter_dir"]
    assert detect_layout(drafter_dir) == "sglang"
    checkpoint = read_drafter(drafter_dir)  # validates keys, shapes, dtypes, config, d2t/t2d
    assert checkpoint.raw_config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert checkpoint.config.draft_vocab_size == 128


def test_export_to_speculators_serves_from_the_vllm_layout(chain, random_target,
                                                             random_target_dir, tmp_path):
    from draftsmith.export.convert import detect_layout
    from draftsmith.export.stage import run_export
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, plain_generate
    from draftsmith.target import load_target_model

    exported = run_export(ExportConfig(format="speculators"),
                          TargetConfig(model=str(random_target_dir), context_length=4096),
                          chain["train"], random_target,
                          plan_stage(tmp_path, "export", {}, [chain["train"]]))
    drafter_dir = exported.figures["drafter_dir"]
    assert detect_layout(drafter_dir) == "speculators"
    assert Path(drafter_dir) == exported.dir / "eagle3-drafter"  # vLLM 0.34 reads the method
    config = json.loads((exported.dir / "eagle3-drafter" / "config.json").read_text())
    assert config["transformer_layer_config"]["max_position_embeddings"] == 4096
    assert exported.figures["written_aux_layer_ids"] == [2, 4, 5]  # vLLM: inputs of c+1
    engine = EmbeddedSpeculativeEngine.load(load_target_model(random_target.path), drafter_dir,
                                            num_steps=2)
    prompt = list(range(5, 25))
    assert engine.generate(prompt, 12, None).tokens == plain_generate(
        engine.runner, prompt, 12, None).tokens


def test_deploy_and_benchmark_are_lossless(chain):
    assert chain["deploy"].figures["engine"] == "embedded"
    report = json.loads((chain["benchmark"].dir / "report.json").read_text())
    assert report["summary"]["lossless"] is True
    assert len(report["per_prompt"]) == 3
    assert 1.0 <= report["summary"]["acceptance_length"] <= 3.0  # at most num_steps + 1
    assert (chain["benchmark"].dir / "report.md").read_text().startswith("# draftsmith benchmark")
    assert (chain["benchmark"].dir / "benchmark.png").stat().st_size > 0
    assert (chain["benchmark"].dir / "benchmark.svg").stat().st_size > 0


def test_the_benchmark_says_where_decoding_time_goes(chain):
    """A speculative round's drafting, verification and the rest add up to the decoding time
    (prompts' forwards left out), and the limit is what the acceptance and the measured plain
    and verify steps imply."""
    report = json.loads((chain["benchmark"].dir / "report.json").read_text())
    summary, per_prompt = report["summary"], report["per_prompt"]
    rounds = sum(p["verify_rounds"] for p in per_prompt)
    parts = summary["ms_per_round"]
    assert parts["draft"] > 0 and parts["verify"] > 0 and parts["other"] >= 0
    decoding_ms = 1000 * sum(p["speculative_s"] - p["prefill_s"] for p in per_prompt)
    assert sum(parts.values()) * rounds == pytest.approx(decoding_ms, rel=1e-3)
    plain_ms = 1000 * sum(p["greedy_decode_s"] for p in per_prompt) / sum(
        p["plain_steps"] for p in per_prompt)
    assert summary["ms_per_plain_token"] == pytest.approx(plain_ms, rel=1e-3)
    assert summary["speedup_limit"] == pytest.approx(
        summary["acceptance_length"] * plain_ms / parts["verify"], rel=1e-2)
    assert all(p["prefill_s"] > 0 and p["greedy_prefill_s"] > 0 for p in per_prompt)
    import torch

    assert summary["measured_on"] == {  # where the figures were taken, in the row
        "device": f"cpu ({torch.get_num_threads()} threads)", "target_cache": "dynamic",
        "steps": "eager", "alone": None, "other_gpu_processes": None}


def test_a_gpu_measurement_says_whether_it_had_the_gpu_alone(monkeypatch):
    import torch

    from draftsmith.bench import benchmark
    from draftsmith.serve import gpus

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert benchmark.measured_on(cuda, "static", [], "cuda graphs") == {
        "device": "NVIDIA H200", "target_cache": "static", "steps": "cuda graphs",
        "alone": True, "other_gpu_processes": []}
    assert benchmark.measured_on(cuda, "static", ["5120 python3"])["alone"] is False
    assert benchmark.measured_on(cuda, "static", None)["alone"] is None  # no nvidia-smi
    import os

    monkeypatch.setattr(gpus, "gpu_processes", lambda: [
        gpus.GpuProcess("0", os.getpid(), "python3", 900),  # this process: not another
        gpus.GpuProcess("0", 5120, "python3", 70000), gpus.GpuProcess("1", 4242, "vllm", 10)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert benchmark.other_gpu_processes() == ["5120 python3", "4242 vllm"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert benchmark.other_gpu_processes() == ["4242 vllm"]


def test_step_costs_of_rounds_and_plain_steps():
    from draftsmith.bench.benchmark import step_costs

    per_prompt = [{"verify_rounds": 4, "plain_steps": 10, "draft_s": 0.004, "verify_s": 0.02,
                   "speculative_s": 0.03, "prefill_s": 0.002, "greedy_decode_s": 0.05,
                   "greedy_prefill_s": 0.003}]
    costs = step_costs(per_prompt, acceptance=2.5)
    assert costs["ms_per_plain_token"] == 5.0
    assert costs["ms_per_round"] == {"draft": 1.0, "verify": 5.0, "other": 1.0}
    assert costs["speedup_limit"] == 2.5  # 2.5 tokens a round at the cost of one plain step
    # the median prompt's forward, outside the figures above but in both sides' wall time
    more = [per_prompt[0], {**per_prompt[0], "prefill_s": 0.004, "greedy_prefill_s": 0.009},
            {**per_prompt[0], "prefill_s": 0.1, "greedy_prefill_s": 0.2}]
    assert step_costs(more, acceptance=2.5)["ms_per_prompt"] == {"plain": 9.0,
                                                                  "speculative": 4.0}
    empty = step_costs([{**per_prompt[0], "verify_rounds": 0}], acceptance=1.0)
    assert empty == {"ms_per_plain_token": None, "ms_per_round": None, "speedup_limit": None,
                     "ms_per_prompt": None}


@pytest.mark.parametrize(("dtype", "fails"), [("float32", True), ("bfloat16", False)])
def test_deploy_smoke_demands_identical_tokens_only_in_float32(chain, random_target,
                                                               random_target_dir, tmp_path,
                                                               monkeypatch, dtype, fails):
    """In reduced precision a multi-token verify and a one-token forward round differently
    (seen on an H200 in bf16), so only float32 deploys must match greedy token for token."""
    from draftsmith.serve import deploy as deploy_module
    from draftsmith.serve.embedded import Generation

    monkeypatch.setattr(deploy_module, "plain_generate",
                        lambda *a, **k: Generation(tokens=[7, 7, 7], seconds=0.0))
    target_cfg = TargetConfig(model=str(random_target_dir), dtype=dtype)
    plan = plan_stage(tmp_path, "deploy", {}, [chain["export"]])
    run = lambda: deploy_module.run_deploy(  # noqa: E731
        DeployConfig(num_steps=2, num_draft_tokens=3), target_cfg, chain["export"],
        chain["merge"], random_target, plan)
    if fails:
        with pytest.raises(RuntimeError, match="does not match plain greedy decoding"):
            run()
    else:
        assert run().figures["engine"] == "embedded"


def test_deploy_and_benchmark_run_the_static_cache_when_set(chain, random_target,
                                                             random_target_dir, tmp_path,
                                                             monkeypatch):
    """deploy.embedded_cache=static reaches the deploy smoke, the benchmark's engine and its
    sweep points, a tree's too (the static path drafts and verifies trees on the device)."""
    from draftsmith.bench import benchmark as bench_module
    from draftsmith.serve.deploy import run_deploy

    runners: list[tuple[str, str]] = []
    real = bench_module.measure_embedded

    def recording(engine, prompts, cfg, eos, label, plain):
        runners.append((label, type(engine.runner).__name__))
        return real(engine, prompts, cfg, eos, label, plain)

    monkeypatch.setattr(bench_module, "measure_embedded", recording)
    target_cfg = TargetConfig(model=str(random_target_dir))
    deployed = run_deploy(DeployConfig(num_steps=2, num_draft_tokens=3, embedded_cache="static"),
                          target_cfg, chain["export"], chain["merge"], random_target,
                          plan_stage(tmp_path, "deploy", {}, [chain["export"]]))
    assert json.loads((deployed.dir / "deployment.json").read_text())["embedded_cache"] == \
        "static"
    sweep = [{"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 5},
             {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}]
    bench = bench_module.run_benchmark(
        BenchmarkConfig(num_prompts=2, max_new_tokens=10, sweep=sweep), target_cfg, deployed,
        chain["merge"], random_target, plan_stage(tmp_path, "benchmark", {}, [deployed]))
    assert runners == [("chain, 2 steps", "StaticTargetRunner"),
                       ("tree 2x2/5", "StaticTargetRunner"), ("chain 3", "StaticTargetRunner")]
    assert bench.figures["lossless"] is True


def test_the_benchmark_measures_several_prompts_at_once(chain, random_target,
                                                      random_target_dir, tmp_path):
    """benchmark.batch_sizes: a row per size, whose rows decode as their prompts alone do (the
    same outputs, so the same acceptance), with the batch's step costs; a group smaller than
    the batch (3 prompts in 2s) is measured too."""
    from draftsmith.bench.benchmark import run_benchmark

    target_cfg = TargetConfig(model=str(random_target_dir))
    bench = run_benchmark(BenchmarkConfig(num_prompts=3, max_new_tokens=10, batch_sizes=[2, 4]),
                          target_cfg, chain["deploy"], chain["merge"], random_target,
                          plan_stage(tmp_path, "benchmark", {}, [chain["deploy"]]))
    report = json.loads((bench.dir / "report.json").read_text())
    summary, batched = report["summary"], report["batched"]
    assert [b["batch"] for b in batched] == [2, 4]
    for row in batched:
        assert row["prompts"] == 3 and row["lossless"] is True
        assert row["groups"] == ([2, 1] if row["batch"] == 2 else [3])
        assert row["identical_outputs"] == row["plain_identical_outputs"] == "3/3"
        assert row["differences"] == [] and row["near_ties"] == 0
        assert row["acceptance_length"] == summary["acceptance_length"]
        assert row["accepted_per_position"] == summary["accepted_per_position"]
        assert row["completion_tokens"] == summary["completion_tokens"]
        assert row["ms_per_plain_token"] > 0 and row["ms_per_round"]["verify"] > 0
        assert row["speedup"] > 0 and row["speedup_limit"] > 0
    assert bench.figures["batched"] == batched and bench.figures["lossless"] is True
    assert "## Several prompts at once" in (bench.dir / "report.md").read_text()


def test_a_batch_row_that_leaves_greedy_decoding_is_a_bug_unless_at_a_near_tie(
        chain, random_target, random_target_dir, tmp_path, monkeypatch):
    """A row whose token differs where the target clearly preferred its own fails the stage's
    check, with the prompt, position and logit gap in the row."""
    from draftsmith.bench import benchmark as bench_module
    from draftsmith.bench.report import problem
    from draftsmith.serve.embedded_batch import BatchedSpeculativeDecoder

    real = BatchedSpeculativeDecoder.generate

    def corrupted(self, prompts, max_new_tokens, eos_id, samplings=None):
        result = real(self, prompts, max_new_tokens, eos_id, samplings)
        row = result.rows[0]
        row.tokens = [*row.tokens[:2], (row.tokens[2] + 1) % 512, *row.tokens[3:]]
        return result

    monkeypatch.setattr(BatchedSpeculativeDecoder, "generate", corrupted)
    bench = bench_module.run_benchmark(
        BenchmarkConfig(num_prompts=2, max_new_tokens=6, batch_sizes=[2]),
        TargetConfig(model=str(random_target_dir)), chain["deploy"], chain["merge"],
        random_target, plan_stage(tmp_path, "benchmark", {}, [chain["deploy"]]))
    [row] = bench.figures["batched"]
    [difference] = row["differences"]
    assert (difference["prompt"], difference["position"]) == (0, 2)
    assert difference["gap"] > 0 and difference["near_tie"] is False
    assert row["lossless"] is False and row["near_ties"] == 0
    assert row["identical_outputs"] == "1/2"
    assert bench.figures["lossless"] is False
    assert problem(bench) == "speculative outputs differ from greedy decoding: this is a bug"


def test_a_difference_within_float32_rounding_is_a_near_tie():
    from draftsmith.bench.identity import first_difference

    class Runner:  # the target's logits after the prompt and the reference's first token
        def new_cache(self, capacity):
            return None

        def forward(self, ids, cache):
            logits = torch.zeros(len(ids), 8)
            logits[-1, 3], logits[-1, 5] = 22.281305, 22.281294  # SmolLM2's, batch 16
            return logits, None

    tie = first_difference(Runner(), [1, 2], [7, 3, 4], [7, 5, 4])
    assert tie["position"] == 1 and tie["near_tie"] is True
    assert tie["gap"] == pytest.approx(1.1e-5, abs=2e-6)
    clear = first_difference(Runner(), [1, 2], [7, 3], [7, 6])
    assert clear["near_tie"] is False and clear["gap"] == pytest.approx(22.281305)
    assert first_difference(Runner(), [1], [7, 3], [7])["near_tie"] is False  # a cut output


def test_a_served_output_that_differs_is_weighed_by_the_target(random_target, monkeypatch):
    """The vLLM benchmark's identity check: a served greedy output that leaves the plain
    server's is weighed by the target at the first difference, a near tie or a wrong token;
    identical outputs load nothing."""
    from draftsmith.bench import identity
    from draftsmith.config import TargetConfig
    from draftsmith.serve.embedded import TargetRunner, plain_generate
    from draftsmith.target import load_target_model

    cfg = TargetConfig(model=random_target.path)
    runner = TargetRunner(load_target_model(random_target.path), aux_layer_ids=[0])
    prompts = [[5, 6, 7], [8, 9]]
    reference = [plain_generate(runner, p, 6, None).tokens for p in prompts]
    logits, _ = runner.forward(prompts[1] + reference[1][:2], runner.new_cache(8))  # [T, V]
    least_likely = int(logits[-1].argmin())
    runner.close()
    served = [reference[0], reference[1][:2] + [least_likely] + reference[1][3:]]

    (wrong,) = identity.weigh_differences(random_target.path, cfg, prompts, reference, served)
    assert (wrong["prompt"], wrong["position"], wrong["near_tie"]) == (1, 2, False)
    assert wrong["gap"] == pytest.approx(float(logits[-1].max() - logits[-1].min()), rel=1e-4)
    monkeypatch.setattr(identity, "NEAR_TIE", 2.0)  # no gap exceeds twice the largest logit
    (tie,) = identity.weigh_differences(random_target.path, cfg, prompts, reference, served)
    assert tie["near_tie"] is True

    def no_target(*args, **kwargs):
        raise AssertionError("identical outputs need no target")

    monkeypatch.setattr("draftsmith.target.load_target_model", no_target)
    assert identity.weigh_differences(random_target.path, cfg, prompts, reference,
                                      reference) == []
    # In reduced precision differences are expected and unjudged: positions, no target loaded.
    bf16 = TargetConfig(model=random_target.path, dtype="bfloat16")
    assert identity.weigh_differences(random_target.path, bf16, prompts, reference, served) == [
        {"prompt": 1, "position": 2, "gap": None, "near_tie": False}]


def test_batches_with_a_tree_are_refused_naming_both_settings(chain, random_target,
                                                              random_target_dir, tmp_path):
    from draftsmith.bench.benchmark import run_benchmark
    from draftsmith.errors import InputError
    from draftsmith.serve.deploy import run_deploy

    target_cfg = TargetConfig(model=str(random_target_dir))
    tree = run_deploy(DeployConfig(num_steps=2, eagle_topk=2, num_draft_tokens=4), target_cfg,
                      chain["export"], chain["merge"], random_target,
                      plan_stage(tmp_path, "deploy", {}, [chain["export"]]))
    with pytest.raises(InputError, match=r"batch_sizes \[4\] with deploy.eagle_topk 2"):
        run_benchmark(BenchmarkConfig(num_prompts=2, max_new_tokens=4, batch_sizes=[4]),
                      target_cfg, tree, chain["merge"], random_target,
                      plan_stage(tmp_path, "benchmark", {}, [tree]))
    with pytest.raises(ValidationError, match="batch_sizes"):
        BenchmarkConfig(batch_sizes=[1])


def test_sampled_benchmark_compares_speed_without_demanding_identity(chain, random_target,
                                                                     random_target_dir,
                                                                     tmp_path):
    from draftsmith.bench.benchmark import run_benchmark

    bench = run_benchmark(BenchmarkConfig(num_prompts=2, max_new_tokens=8, temperature=0.8),
                          TargetConfig(model=str(random_target_dir)), chain["deploy"],
                          chain["merge"], random_target,
                          plan_stage(tmp_path, "benchmark", {}, [chain["deploy"]]))
    assert bench.figures["lossless"] is None and bench.figures["temperature"] == 0.8
    assert bench.figures["identical_outputs"].startswith("n/a")
    assert bench.figures["acceptance_length"] >= 1.0


def test_repeated_speed_pairs_alternate_and_the_speedup_is_their_median(
        chain, random_target, random_target_dir, tmp_path):
    """benchmark.repeats for the embedded engine: the measurement and two more pairs, the
    second speculative first; the speedup the report gives is the pairs' median."""
    import statistics

    from draftsmith.bench.benchmark import run_benchmark

    bench = run_benchmark(BenchmarkConfig(num_prompts=2, max_new_tokens=8, repeats=3),
                          TargetConfig(model=str(random_target_dir)), chain["deploy"],
                          chain["merge"], random_target,
                          plan_stage(tmp_path, "benchmark", {}, [chain["deploy"]]))
    figures = bench.figures
    pairs = figures["speedup_pairs"]
    assert [p["order"] for p in pairs] == ["plain first", "speculative first", "plain first"]
    for pair in pairs:  # tokens/s are rounded to 0.1
        assert pair["speedup"] == pytest.approx(
            pair["speculative_tokens_per_s"] / pair["greedy_tokens_per_s"], rel=0.02)
    speedups = [p["speedup"] for p in pairs]
    assert figures["speedup"] == round(statistics.median(speedups), 3)
    assert figures["speedup_spread"] == [min(speedups), max(speedups)]
    assert pairs[0]["greedy_tokens_per_s"] == figures["greedy_tokens_per_s"]
    assert figures["lossless"] is True
    # Every pair says where its time went; the report's step costs are the median pair's,
    # the one whose speedup it gives.
    for pair in pairs:
        assert pair["ms_per_plain_token"] > 0 and pair["speedup_limit"] > 0
        assert set(pair["ms_per_round"]) == {"draft", "verify", "other"}
    median = speedups.index(statistics.median_low(speedups))
    assert figures["step_costs_from"] == f"speed pair {median + 1} of 3"
    for key in ("ms_per_plain_token", "ms_per_round", "speedup_limit"):
        assert figures[key] == pairs[median][key]


def test_benchmark_sweep_measures_each_drafting_config_once(chain, random_target,
                                                            random_target_dir, tmp_path,
                                                            monkeypatch):
    """Each sweep point is measured with its own engine settings, lossless, and kept as its
    own finished directory: a rerun (or a longer sweep) measures only points not seen yet."""
    from draftsmith.bench import benchmark as bench_module

    measured: list[tuple] = []
    real = bench_module.measure_embedded

    def counting(engine, prompts, cfg, eos, label, plain):
        measured.append((label, engine.num_steps, engine.topk, engine.num_draft_tokens))
        return real(engine, prompts, cfg, eos, label, plain)

    monkeypatch.setattr(bench_module, "measure_embedded", counting)
    target_cfg = TargetConfig(model=str(random_target_dir))
    tree = {"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 5}
    chain3 = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}

    def run(points, name):
        cfg = BenchmarkConfig(num_prompts=2, max_new_tokens=10, sweep=points)
        plan = plan_stage(tmp_path, "benchmark", {"run": name}, [chain["deploy"]])
        return bench_module.run_benchmark(cfg, target_cfg, chain["deploy"], chain["merge"],
                                          random_target, plan)

    first = run([tree], "first")
    assert measured == [("chain, 2 steps", 2, 1, 3), ("tree 2x2/5", 2, 2, 5)]
    report = json.loads((first.dir / "report.json").read_text())
    assert [c["config"] for c in report["configs"]] == ["chain, 2 steps", "tree 2x2/5"]
    assert all(c["lossless"] for c in report["configs"]) and first.figures["lossless"] is True
    for c in report["configs"]:  # each round: 1 own token + its accepted drafts, by position
        assert len(c["accepted_per_position"]) == c["num_steps"]
        assert c["acceptance_length"] == pytest.approx(1 + sum(c["accepted_per_position"]),
                                                       abs=2e-3)
        assert c["accepted_per_position"] == sorted(c["accepted_per_position"], reverse=True)
    assert first.figures["best_config"] in ("chain, 2 steps", "tree 2x2/5")
    assert "## Drafting configs" in (first.dir / "report.md").read_text()
    assert len(list((tmp_path / "benchmark-point").glob("*/manifest.json"))) == 1

    measured.clear()
    second = run([tree, chain3], "second")
    # The deployed config's part is read back too (the sweep does not decide it): only the
    # new point is measured.
    assert measured == [("chain 3", 3, 1, 4)]
    report = json.loads((second.dir / "report.json").read_text())
    assert [c["config"] for c in report["configs"]] == ["chain, 2 steps", "tree 2x2/5", "chain 3"]


def test_a_benchmark_cut_off_keeps_what_it_measured(chain, random_target, random_target_dir,
                                                    tmp_path, monkeypatch):
    """Each part of the benchmark (one prompt at a time, each batch size) is kept on disk as it
    finishes: a stage cut off at batch 3 keeps batch 1 and 2, its re-run measures only batch 3,
    a batch size added later is the only one measured, and another GPU measures everything
    again."""
    from draftsmith.bench import benchmark as bench_module

    calls: list[str] = []
    real = {name: getattr(bench_module, name)
            for name in ("plain_decoding", "measure_embedded", "measure_batched")}
    lost_at: list[int] = [3]

    def plain_decoding(runner, prompts, cfg, eos):
        calls.append("plain")
        return real["plain_decoding"](runner, prompts, cfg, eos)

    def measure_embedded(engine, prompts, cfg, eos, label, plain):
        calls.append("batch 1")
        return real["measure_embedded"](engine, prompts, cfg, eos, label, plain)

    def measure_batched(engine, prompts, cfg, eos, batch, plain):
        if batch in lost_at:
            raise RuntimeError("the machine went away")
        calls.append(f"batch {batch}")
        return real["measure_batched"](engine, prompts, cfg, eos, batch, plain)

    for name, fn in (("plain_decoding", plain_decoding), ("measure_embedded", measure_embedded),
                     ("measure_batched", measure_batched)):
        monkeypatch.setattr(bench_module, name, fn)
    target_cfg = TargetConfig(model=str(random_target_dir))

    def run(batch_sizes, name):
        calls.clear()
        cfg = BenchmarkConfig(num_prompts=3, max_new_tokens=6, batch_sizes=batch_sizes)
        plan = plan_stage(tmp_path, "benchmark", {"run": name}, [chain["deploy"]])
        return bench_module.run_benchmark(cfg, target_cfg, chain["deploy"], chain["merge"],
                                          random_target, plan)

    with pytest.raises(RuntimeError, match="went away"):
        run([2, 3], "cut off")
    assert calls == ["plain", "batch 1", "batch 2"]
    kept = [m.parent for m in (tmp_path / "benchmark-part").glob("*/manifest.json")]
    assert len(kept) == 2
    assert not list(tmp_path.glob("benchmark/*/manifest.json"))
    first_part = next(json.loads((d / "part.json").read_text()) for d in kept
                      if "per_prompt" in json.loads((d / "part.json").read_text()))

    lost_at.clear()
    resumed = run([2, 3], "cut off")
    assert calls == ["batch 3"]  # neither plain decoding nor batch 1 or 2 again
    report = json.loads((resumed.dir / "report.json").read_text())
    assert [b["batch"] for b in report["batched"]] == [2, 3]
    assert report["per_prompt"] == first_part["per_prompt"]
    assert resumed.figures["acceptance_length"] == first_part["summary"]["acceptance_length"]
    assert resumed.figures["lossless"] is True
    assert resumed.figures["measured_on"] == first_part["measured_on"]
    assert first_part["measured_on"]["device"].startswith("cpu")
    assert first_part["target_dtype"] == "float32" and first_part["engine"] == "embedded"

    # The parts alone make the same rows as the report (gpu_speculative/summary.py).
    gpu_summary = benchmark_script("gpu_speculative/summary.py")
    part_files = sorted(tmp_path.glob("benchmark-part/*/part.json"))
    assert gpu_summary.rows_of(gpu_summary.read_reports(part_files), "d") == \
        gpu_summary.rows_of(gpu_summary.read_reports([resumed.dir / "report.json"]), "d")

    run([2, 3, 4], "a batch size added")
    assert calls == ["batch 4"]

    monkeypatch.setattr(bench_module, "device_label", lambda device: "another GPU")
    run([2], "another GPU")
    assert calls == ["plain", "batch 1", "batch 2"]


def test_sweep_points_are_checked_like_a_deploy():
    with pytest.raises(ValueError, match="num_draft_tokens=9: at most 7"):
        BenchmarkConfig(sweep=[{"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 9}])
    with pytest.raises(ValueError, match="chain drafting needs num_draft_tokens"):
        BenchmarkConfig(sweep=[{"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 3}])


def test_benchmark_prompts_can_come_from_a_file(chain, random_target, random_target_dir,
                                                 tmp_path):
    """benchmark.prompts_file: held-out prompts in any data format, up to num_prompts; the
    stage key follows the file's content."""
    from draftsmith.bench.benchmark import held_out_prompts, run_benchmark
    from draftsmith.config import PipelineConfig
    from draftsmith.plan import key_material
    from draftsmith.target import load_tokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n"
                               for i in range(5)))
    cfg = BenchmarkConfig(prompts_file=str(prompts), num_prompts=3, max_new_tokens=6)
    tokenizer = load_tokenizer(random_target)
    ids = held_out_prompts(cfg, chain["merge"], tokenizer)
    assert len(ids) == 3
    assert tokenizer.decode(ids[1]).count("def f1(x):") == 1
    bench = run_benchmark(cfg, TargetConfig(model=str(random_target_dir)), chain["deploy"],
                          chain["merge"], random_target,
                          plan_stage(tmp_path, "benchmark", {}, [chain["deploy"]]))
    assert bench.figures["prompts"] == 3 and bench.figures["lossless"] is True

    def key() -> dict:
        config = PipelineConfig.model_validate({
            "data": {"sources": [{"name": "a", "path": str(prompts)}]},
            "benchmark": {"prompts_file": str(prompts)}})
        return key_material(config, "benchmark")

    before = key()
    prompts.write_text(json.dumps({"prompt": "def g(y):"}) + "\n")
    assert key() != before


def test_benchmark_also_measures_a_sampled_setting(chain, random_target, random_target_dir,
                                                   tmp_path):
    from draftsmith.bench.benchmark import run_benchmark

    cfg = BenchmarkConfig(num_prompts=2, max_new_tokens=8, sampled_temperature=0.8)
    bench = run_benchmark(cfg, TargetConfig(model=str(random_target_dir)), chain["deploy"],
                          chain["merge"], random_target,
                          plan_stage(tmp_path, "benchmark", {}, [chain["deploy"]]))
    configs = json.loads((bench.dir / "report.json").read_text())["configs"]
    greedy, sampled = configs
    assert greedy["lossless"] is True and bench.figures["lossless"] is True
    assert sampled["config"] == "chain, 2 steps @ T=0.8" and sampled["temperature"] == 0.8
    assert sampled["lossless"] is None and sampled["identical_outputs"].startswith("n/a")
    assert sampled["acceptance_length"] >= 1.0


def test_the_suite_gives_each_set_and_part_a_row(chain, random_target, random_target_dir,
                                                 tmp_path):
    """benchmark.suite: every set's part is measured, tabulated with its interval and
    identity, and published as its own artifact; the key follows the sets' content."""
    from draftsmith.bench.benchmark import run_benchmark

    own = tmp_path / "support.jsonl"
    own.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}: why?",
                                       "split": "dev" if i < 2 else "test"}) + "\n"
                           for i in range(5)))
    cfg = BenchmarkConfig(suite=["chat", "code", {"name": "support", "path": str(own)}],
                          splits=["dev", "test"], prompts_per_set=2, max_new_tokens=6)
    bench = run_benchmark(cfg, TargetConfig(model=str(random_target_dir)), chain["deploy"],
                          chain["merge"], random_target,
                          plan_stage(tmp_path, "benchmark", {}, [chain["deploy"]]))
    report = json.loads((bench.dir / "report.json").read_text())
    sets = report["sets"]
    assert [(r["set"], r["split"], r["prompts"]) for r in sets] == [
        ("chat", "dev", 2), ("chat", "test", 2), ("code", "dev", 2), ("code", "test", 2),
        ("support", "dev", 2), ("support", "test", 2)]
    per_prompt = report["per_prompt"]
    assert [p["id"] for p in per_prompt[4:6]] == ["HumanEval-48", "HumanEval-49"]
    for row in sets:
        chosen = [p for p in per_prompt if (p["set"], p["split"]) == (row["set"], row["split"])]
        rounds = sum(p["verify_rounds"] for p in chosen)
        assert row["acceptance"] == round(sum(p["round_tokens"] for p in chosen) / rounds, 4)
        assert row["ci95"][0] <= row["acceptance"] <= row["ci95"][1]
        assert row["identical"] == "2/2" and len(row["per_position"]) == 2
    assert bench.figures["sets"] == sets and bench.figures["prompts"] == 12
    assert "## By prompt set" in (bench.dir / "report.md").read_text()
    from draftsmith import stages

    table = next(r for r in stages.get("benchmark").reports(bench) if r.key == "benchmark-sets")
    assert [(r["set"], r["part"]) for r in table.rows][:2] == [("chat", "dev"), ("chat", "test")]
    assert "chat dev" in stages.get("benchmark").describe(bench)
