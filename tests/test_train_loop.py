"""The training loop as a user runs it: resume after a kill, 2-process torchrun (gloo),
fine-tuning from an existing drafter, frozen lm_head, metrics visible from the first step."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.artifacts import plan_stage
from draftsmith.config import (
    DrafterConfig,
    ExtractConfig,
    TargetConfig,
    TrainConfig,
)
from draftsmith.train import trainer
from draftsmith.train.optim import MasterWeightAdamW
from tests.conftest import REPO


@pytest.fixture(scope="module")
def inputs(train_inputs):
    """generate -> merge -> extract once on the random tiny target (tests/conftest.py)."""
    return train_inputs


def train(inputs, root, cfg: TrainConfig, drafter: DrafterConfig | None = None):
    plan = plan_stage(root, "train", {"train": cfg.model_dump()}, [inputs["hidden"]])
    return trainer.run_train(cfg, inputs["hidden"], inputs["merged"], inputs["target"], plan,
                             drafter_settings=drafter)


def small_cfg(**kw) -> TrainConfig:
    base = dict(ttt_steps=2, lr=3e-3, epochs=2, batch_tokens=128, log_every=1, warmup_ratio=0.2)
    return TrainConfig(**{**base, **kw})


def history(descriptor) -> list[dict]:
    return [json.loads(line) for line in
            (descriptor.dir / trainer.METRICS_FILE).read_text().splitlines()]


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs, no handler catches it."""


def test_killed_run_resumes_to_the_same_weights_and_metrics(inputs, tmp_path, monkeypatch,
                                                            caplog):
    cfg = small_cfg(checkpoint_every=2, aux_noise_std=0.05, dtype="bfloat16")
    straight = train(inputs, tmp_path / "a", cfg)

    real_step = MasterWeightAdamW.step
    calls = {"n": 0}

    def dying_step(self, clip):
        calls["n"] += 1
        if calls["n"] == 5:  # after the checkpoint at step 4, before step 5 lands
            raise Killed()
        return real_step(self, clip)

    monkeypatch.setattr(MasterWeightAdamW, "step", dying_step)
    with pytest.raises(Killed):
        train(inputs, tmp_path / "b", cfg)
    partial = next((tmp_path / "b" / "train").iterdir())
    assert (partial / trainer.RESUME_DIR / trainer.STATE_FILE).is_file()
    monkeypatch.setattr(MasterWeightAdamW, "step", real_step)
    caplog.set_level("INFO", logger="draftsmith")
    resumed = train(inputs, tmp_path / "b", cfg)
    assert "resuming from" in caplog.text and "at step 4" in caplog.text
    assert not (resumed.dir / trainer.RESUME_DIR).exists()  # finished: resume state removed

    a, b = history(straight), history(resumed)
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if isinstance(x[key], str):
                assert x[key] == y[key]
            elif key not in ("tokens_per_s", "seconds", "gpu_memory_gib"):
                assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), (x["step"], key)
    wa = load_file(str(straight.dir / "drafter.safetensors"))
    wb = load_file(str(resumed.dir / "drafter.safetensors"))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=0, msg=name)
    # and the run did train: the loss fell
    losses = [h["loss_0"] for h in a if h["split"] == "train"]
    assert losses[-1] < losses[0]


def test_the_first_metrics_line_after_a_resume_averages_the_uninterrupted_window(
        inputs, tmp_path, monkeypatch):
    """log_every 3, checkpoints every 2 steps, killed before step 5: the resumed run's line at
    step 6 must average steps 4-6, as the uninterrupted run's does, although step 4 ran in the
    killed process (its counts come back from the checkpoint)."""
    cfg = small_cfg(checkpoint_every=2, log_every=3, epochs=1)
    straight = train(inputs, tmp_path / "a", cfg)

    real_step = MasterWeightAdamW.step
    calls = {"n": 0}

    def dying_step(self, clip):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Killed()
        return real_step(self, clip)

    monkeypatch.setattr(MasterWeightAdamW, "step", dying_step)
    with pytest.raises(Killed):
        train(inputs, tmp_path / "b", cfg)
    monkeypatch.setattr(MasterWeightAdamW, "step", real_step)
    resumed = train(inputs, tmp_path / "b", cfg)

    a = [h for h in history(straight) if h["split"] == "train"]
    b = [h for h in history(resumed) if h["split"] == "train"]
    assert [h["step"] for h in a] == [h["step"] for h in b]
    assert [h["step"] for h in a][:3] == [1, 3, 6]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if key not in ("tokens_per_s", "seconds", "gpu_memory_gib", "split"):
                assert y[key] == pytest.approx(x[key], rel=1e-9, abs=1e-12), (x["step"], key)
        assert y["tokens_per_s"] > 0


def test_metrics_from_the_first_step_and_validation_each_epoch(inputs, tmp_path, caplog):
    caplog.set_level("INFO", logger="draftsmith")
    cfg = small_cfg(log_every=1000, step_weights=[1.0, 0.5])
    descriptor = train(inputs, tmp_path, cfg)
    rows = history(descriptor)
    train_rows = [h for h in rows if h["split"] == "train"]
    assert train_rows[0]["step"] == 1  # visible at once, not after log_every steps
    for key in ("loss_0", "loss_1", "full_acc_0", "cond_acc_1", "tau", "lr", "tokens_per_s",
                "gpu_memory_gib"):
        assert key in train_rows[0]
    val = [h for h in rows if h["split"] == "validation"]
    assert [h["epoch"] for h in val] == [0, 1]
    assert all(0 < h["packing_efficiency"] <= 1 for h in val)
    # Acceptance as greedy chain decoding would measure it: 1 + up to ttt_steps per round.
    assert all(1 <= h["acceptance_replayed"] <= 1 + cfg.ttt_steps for h in val)
    assert "acceptance replayed" in caplog.text
    assert "train step 1/" in caplog.text
    for name in ("training.png", "training.svg", "drafter.safetensors", "draftsmith.json"):
        assert (descriptor.dir / name).is_file()
    meta = json.loads((descriptor.dir / "draftsmith.json").read_text())
    best = max(val, key=lambda h: h["tau"])
    assert meta["provenance"]["epoch"] == best["epoch"]  # best checkpoint by validation tau


def test_eagle31_norms_are_trained_and_kept_in_the_checkpoint(inputs, tmp_path):
    """drafter.* EAGLE-3.1 options: the trainer builds the drafter with them, trains the new
    norm weights, and the checkpoint says so (export then writes the flags)."""
    from draftsmith.export.convert import read_drafter

    norms = DrafterConfig(norm_before_residual=True, norm_before_fc=True, fc_norm=True,
                          norm_output=True)
    descriptor = train(inputs, tmp_path, small_cfg(epochs=1), norms)
    ckpt = read_drafter(descriptor.dir)
    assert ckpt.config.norm_flags == norms.model_dump(
        include={"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"})
    for name in ("input_norm.weight", "fc_norm.0.weight", "fc_norm.2.weight"):
        assert not torch.equal(ckpt.tensors[name], torch.ones_like(ckpt.tensors[name])), name
    val = [h for h in history(descriptor) if h["split"] == "validation"]
    assert val and all(1 <= h["acceptance_replayed"] <= 3 for h in val)
    meta = json.loads((descriptor.dir / "draftsmith.json").read_text())
    assert meta["provenance"]["drafter_config"]["norm_output"] is True


def test_dflash_trains_on_the_same_store_and_saves_its_kind(inputs, tmp_path, caplog):
    """drafter.kind: dflash on the same store: metrics per block position (full_acc_k for
    drafts 1..k, tau, the replayed acceptance), the native checkpoint of a DFlash drafter, the
    mask token resolved from the target's tokenizer as speculators resolves it."""
    from draftsmith.export.convert import read_drafter
    from draftsmith.target import load_tokenizer

    caplog.set_level("INFO", logger="draftsmith")
    settings = DrafterConfig(kind="dflash", dflash={"block_size": 4, "num_layers": 1,
                                                     "max_anchors": 32})
    descriptor = train(inputs, tmp_path, small_cfg(epochs=2), settings)
    ckpt = read_drafter(descriptor.dir)
    assert ckpt.kind == "dflash" and ckpt.config.block_size == 4
    tokenizer = load_tokenizer(inputs["target"])
    vocab = ckpt.config.vocab_size
    expected = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else (
        len(tokenizer) if len(tokenizer) < vocab else tokenizer.pad_token_id)
    assert ckpt.config.mask_token_id == expected
    rows = history(descriptor)
    val = [h for h in rows if h["split"] == "validation"]
    assert [h["epoch"] for h in val] == [0, 1]
    for h in val:
        assert {"full_acc_0", "full_acc_1", "full_acc_2", "cond_acc_2", "loss_2"} <= set(h)
        assert "full_acc_3" not in h  # block 4: three drafted positions
        assert h["full_acc_0"] >= h["full_acc_1"] >= h["full_acc_2"]
        assert 1 <= h["acceptance_replayed"] <= 4 and 1 <= h["tau"] <= 4
    train_rows = [h for h in rows if h["split"] == "train"]
    assert train_rows[-1]["loss_0"] < train_rows[0]["loss_0"]  # it learns
    assert (descriptor.dir / "training.png").is_file()


def test_the_train_key_follows_the_drafter_settings_and_keeps_plain_eagle3s(tmp_path):
    """Every non-default drafter setting changes train's key; the defaults add nothing, so a
    plain EAGLE-3 run keeps the key (and the cached result) it had before drafter kinds."""
    from draftsmith.config import parse_config
    from draftsmith.plan import key_material

    raw = {"target": {"model": "builtin:tiny"},
           "data": {"sources": [{"name": "a", "path": str(tmp_path / "a.jsonl")}]}}
    plain = key_material(parse_config(raw), "train")
    assert "drafter" not in plain
    assert key_material(parse_config({**raw, "drafter": {"kind": "eagle3"}}), "train") == plain
    seen = [plain]
    for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        # The export vLLM reads: SGLang cannot run norm_before_residual (refused at load).
        material = key_material(parse_config({**raw, "drafter": {name: True}, "export": {
            "format": "speculators"}}), "train")
        assert material not in seen, name
        seen.append(material)
    for stage in ("extract", "export"):  # they follow through train's output, not this key
        assert key_material(parse_config({**raw, "drafter": {"fc_norm": True}}), stage) == \
            key_material(parse_config(raw), stage)


def test_frozen_lm_head_keeps_the_target_rows_and_fine_tune_starts_from_a_drafter(
        inputs, tmp_path):
    from draftsmith.data.merge import read_vocab_map
    from draftsmith.export.convert import export_drafter, read_drafter
    from draftsmith.target import load_target_head_and_embedding

    frozen = train(inputs, tmp_path / "frozen", small_cfg(epochs=1, freeze_lm_head=True))
    _, head = load_target_head_and_embedding(inputs["target"])
    d2t, _ = read_vocab_map(inputs["merged"])
    weights = load_file(str(frozen.dir / "drafter.safetensors"))
    draft_ids = d2t + torch.arange(d2t.numel())
    torch.testing.assert_close(weights["lm_head.weight"], head[draft_ids].float())

    # Fine-tune from that drafter exported to the SGLang layout: step 1 starts from its weights.
    ckpt = read_drafter(frozen.dir)
    sglang_dir = tmp_path / "sglang"
    export_drafter(ckpt.tensors, ckpt.config, "sglang", "llama", sglang_dir)
    tuned = train(inputs, tmp_path / "tuned", small_cfg(epochs=1, init_from=str(sglang_dir),
                                                        lr=1e-9))
    scratch = history(frozen)
    first_tuned = [h for h in history(tuned) if h["split"] == "train"][0]
    val_before = [h for h in scratch if h["split"] == "validation"][-1]
    # lr ~ 0: the fine-tuned run validates like the drafter it started from
    val_after = [h for h in history(tuned) if h["split"] == "validation"][-1]
    assert val_after["tau"] == pytest.approx(val_before["tau"], abs=1e-6)
    assert first_tuned["loss_0"] < scratch[0]["loss_0"]

    with pytest.raises(ValueError, match="train.init_from="):
        train(inputs, tmp_path / "bad", small_cfg(epochs=1, init_from=str(tmp_path / "none")))


def torchrun_cfg(**kw) -> TrainConfig:
    """2 gloo processes; batch_tokens 112 gives odd row counts, so in an epoch's last step
    one rank has no row."""
    return small_cfg(nproc_per_node=2, batch_tokens=112, checkpoint_every=2, **kw)


def run_in(inputs, out, cfg: TrainConfig) -> dict:
    from draftsmith.train.launch import run_torchrun

    out.mkdir(parents=True, exist_ok=True)
    return run_torchrun(cfg, inputs["hidden"], inputs["merged"], inputs["target"], out)


@pytest.fixture(scope="module")
def ddp_run(one_host_two_processes):
    return one_host_two_processes  # tests/conftest.py: shared with tests/test_multi_host.py


@pytest.fixture(scope="module")
def fsdp_run(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return run_in(inputs, out, torchrun_cfg(parallel="fsdp")), out


def test_torchrun_two_gloo_processes_share_each_epochs_rows(ddp_run):
    from draftsmith.train.launch import LOG_FILE

    result, out = ddp_run
    assert len(result["rows_trained"]) == 2
    for epoch, n_rows in enumerate(result["rows_per_epoch"]):
        per_rank = [[i for e, i in ranks if e == epoch] for ranks in result["rows_trained"]]
        assert all(per_rank), "each rank trained rows"
        together = sorted(per_rank[0] + per_rank[1])
        assert together == list(range(n_rows)), "every row once: none skipped, none repeated"
    sums = result["weight_sums"]
    assert sums[0] == pytest.approx(sums[1], rel=1e-12)  # gradients averaged across ranks
    log_text = (out / LOG_FILE).read_text()
    assert "rank0" in log_text and "rank1" in log_text
    assert result["steps"] == sum((n + 1) // 2 for n in result["rows_per_epoch"])


def weights_of(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "drafter.safetensors"))


def test_fsdp_trains_what_ddp_trains(ddp_run, fsdp_run):
    """Same data, same 2 processes: sharded parameters, gradients reduce-scattered and
    rescaled to the step's rows, padding rows where a rank has none, reach DDP's weights."""
    (ddp, ddp_out), (fsdp, fsdp_out) = ddp_run, fsdp_run
    assert any(n % 2 for n in fsdp["rows_per_epoch"]), "a step where one rank has no row"
    assert fsdp["rows_trained"] == ddp["rows_trained"]  # the same rows, on the same ranks
    for epoch, n_rows in enumerate(fsdp["rows_per_epoch"]):
        rows = sorted(i for ranks in fsdp["rows_trained"] for e, i in ranks if e == epoch)
        assert rows == list(range(n_rows)), "every row once: none skipped, none repeated"
    assert fsdp["steps"] == ddp["steps"]
    a, b = ddp["history"], fsdp["history"]
    assert [(h["split"], h["step"]) for h in a] == [(h["split"], h["step"]) for h in b]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if key.startswith(("loss_", "full_acc_", "cond_acc_", "tau", "lr")):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    wa, wb = weights_of(ddp_out), weights_of(fsdp_out)
    assert set(wa) == set(wb)
    for name in wa:  # float32; only the order of the reductions differs
        assert wb[name].dtype == wa[name].dtype
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5, msg=name)
    assert fsdp["weight_sums"][0] == pytest.approx(ddp["weight_sums"][0], rel=1e-6)


def test_dflash_trains_under_fsdp_over_two_processes(inputs, tmp_path):
    """drafter.kind: dflash through torchrun with train.parallel=fsdp: each DFlash layer is
    its own shard unit (its context keys and values gathered through a registered forward
    method), a rank without a row runs a padding row with no anchors, the whole drafter
    reads back as DFlash."""
    from draftsmith.export.convert import read_drafter
    from draftsmith.train.launch import run_torchrun

    settings = DrafterConfig(kind="dflash", dflash={"block_size": 3, "num_layers": 2,
                                                     "max_anchors": 16})
    out = tmp_path / "fsdp-dflash"
    out.mkdir()
    result = run_torchrun(torchrun_cfg(parallel="fsdp", epochs=1), inputs["hidden"],
                          inputs["merged"], inputs["target"], out, drafter_settings=settings)
    assert any(n % 2 for n in result["rows_per_epoch"]), "a step where one rank has no row"
    sums = result["weight_sums"]
    assert sums[0] == pytest.approx(sums[1], rel=1e-12)
    val = [h for h in result["history"] if h["split"] == "validation"]
    assert val and {"full_acc_0", "full_acc_1"} <= set(val[-1]) and "full_acc_2" not in val[-1]
    drafter = read_drafter(out)
    assert drafter.kind == "dflash" and drafter.config.num_hidden_layers == 2


def test_fsdp_best_drafter_is_whole_and_reads_back_in_sglang_names(fsdp_run, tmp_path):
    from draftsmith.export.convert import export_drafter, read_drafter
    from draftsmith.export.formats import drafter_tensors

    _, out = fsdp_run
    ckpt = read_drafter(out)  # the reader every later stage uses
    assert ckpt.layout == "native"
    specs = drafter_tensors(ckpt.config)
    assert set(ckpt.tensors) == set(specs)  # midlayer.*, fc, norm, lm_head, d2t, t2d
    for name, spec in specs.items():  # whole tensors, not one rank's shard
        assert tuple(ckpt.tensors[name].shape) == spec.shape, name
    export_drafter(ckpt.tensors, ckpt.config, "sglang", "llama", tmp_path / "sglang")
    assert read_drafter(tmp_path / "sglang").layout == "sglang"


def test_killed_fsdp_run_resumes_to_the_same_weights(inputs, tmp_path, monkeypatch):
    """bf16 compute over float32 shards; every rank SIGKILLs itself before step 8, after the
    checkpoint at the end of epoch 0 (step 7, written right after validation's forwards); the
    rerun reads each rank's shards back and ends where an uninterrupted run ends, bit for
    bit."""
    import sys

    from draftsmith.train import launch

    cfg = torchrun_cfg(parallel="fsdp", dtype="bfloat16", aux_noise_std=0.05)
    straight = run_in(inputs, tmp_path / "straight", cfg)

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(launch, "torchrun_argv", lambda cfg, job: [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(REPO / "tests" / "train_worker_killed.py"), "8", str(job)])
    out = tmp_path / "killed"
    with pytest.raises(launch.TrainCrashError):  # a crash: transient, the task retries it
        run_in(inputs, out, cfg)
    resume = out / trainer.RESUME_DIR
    assert sorted(p.name for p in resume.iterdir()) == [
        "rank0-step7.pt", "rank1-step7.pt", trainer.STATE_FILE]
    monkeypatch.undo()
    resumed = run_in(inputs, out, cfg)
    assert "resuming from" in (out / launch.LOG_FILE).read_text()

    a, b = straight["history"], resumed["history"]
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if key not in ("tokens_per_s", "seconds", "gpu_memory_gib", "split"):
                assert y[key] == pytest.approx(x[key], rel=1e-6, abs=1e-9), (x["step"], key)
    wa, wb = weights_of(tmp_path / "straight"), weights_of(out)
    for name in wa:
        if wa[name].is_floating_point():  # written in the training dtype, as DDP writes
            assert wa[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=0, msg=name)
    assert resumed["rows_trained"] == straight["rows_trained"]


def test_a_rank_that_dies_at_the_end_of_a_run_costs_no_training(inputs, fsdp_run, tmp_path,
                                                                monkeypatch, caplog):
    """Issue 29, with real torchrun processes. Rank 0 is killed once its training is done,
    before the result is recorded: the attempt is a crash (the task retries it) and nothing
    is kept. The retry resumes from the last checkpoint, at the last step, and trains nothing;
    its rank 1 then aborts (SIGABRT) after the final barrier and close, as the FSDP rank of
    the issue did: the result every rank finished is kept, and the manifest says so. The
    weights are the uninterrupted run's. Each rank's close joined its gloo worker threads."""
    import re
    import sys

    from draftsmith.train import launch

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(REPO), os.environ.get("PYTHONPATH")])))

    def ranks_die(rank: int, signal: str, when: str) -> None:
        monkeypatch.setattr(launch, "torchrun_argv", lambda cfg, job: [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=2", str(REPO / "tests" / "train_worker_dies_at_exit.py"),
            str(rank), signal, when, str(job)])

    cfg = torchrun_cfg(parallel="fsdp")
    plan = plan_stage(tmp_path, "train", {"train": cfg.model_dump()}, [inputs["hidden"]])
    ranks_die(0, "SIGKILL", "before-result")
    with pytest.raises(launch.TrainCrashError):
        train(inputs, tmp_path, cfg)
    assert not plan.is_complete()
    assert (plan.dir / trainer.RESUME_DIR / trainer.STATE_FILE).is_file()

    ranks_die(1, "SIGABRT", "after-close")
    caplog.set_level("WARNING", logger="draftsmith")
    descriptor = train(inputs, tmp_path, cfg)
    attempt = (plan.dir / launch.LOG_FILE).read_text().split("\n$ ")[-1]  # the retry's lines
    assert "Signal 6 (SIGABRT)" in attempt  # rank 1 did die
    assert "after all 2 ranks had finished the run" in caplog.text
    expected, fsdp_out = fsdp_run
    assert f"at step {expected['steps']} " in attempt and "resuming from" in attempt
    assert "train step " not in attempt and "validation after epoch" not in attempt
    joined = re.findall(r"gloo worker threads: (\d+) before close, (\d+) after", attempt)
    # A rank that logged its close had joined its threads. Rank 0 may not get to log it:
    # torchrun stops the other ranks once rank 1 aborts, which on a busy machine can come first.
    assert 1 <= len(joined) <= 2 and all(int(b) > 0 and a == "0" for b, a in joined), joined
    manifest = json.loads((plan.dir / "manifest.json").read_text())
    assert manifest["ranks_finished"] == [0, 1] and manifest["torchrun_exit_code"] != 0
    wa, wb = weights_of(fsdp_out), weights_of(plan.dir)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=0, msg=name)
    assert descriptor.figures["tau"] == round(expected["best"]["tau"], 4)


def test_only_a_result_that_records_every_rank_is_accepted(tmp_path):
    """What the parent reads back: a result cut short, or one that does not record every
    rank as finished, is no result (the attempt is a crash and its retry resumes)."""
    from draftsmith.train.launch import finished_result

    path = tmp_path / "torchrun_result.json"
    assert finished_result(path) is None
    whole = {"steps": 7, "world": 2, "ranks_finished": [0, 1]}
    text = json.dumps(whole)
    path.write_text(text[: len(text) // 2])
    assert finished_result(path) is None
    for partial in ({**whole, "ranks_finished": [0]}, {**whole, "world": 3},
                    {k: v for k, v in whole.items() if k != "world"}):
        path.write_text(json.dumps(partial))
        assert finished_result(path) is None, partial
    path.write_text(text)
    assert finished_result(path) == whole


def test_fsdp_misconfiguration_names_the_key_and_the_fix(inputs, tmp_path):
    from pydantic import ValidationError

    from draftsmith.distributed import Dist
    from draftsmith.train.launch import TrainLaunchError

    with pytest.raises(ValidationError, match=r"train.parallel=fsdp with train.device=mps.*"
                                              r"set train.device to cuda or cpu"):
        small_cfg(parallel="fsdp", device="mps")
    with pytest.raises(ValidationError, match=r"train.device=cuda:1 names one GPU.*"
                                              r"set train.device=cuda"):
        small_cfg(parallel="fsdp", device="cuda:1", nproc_per_node=2)
    with pytest.raises(ValueError, match="train.parallel=fsdp shards the drafter over a process "
                                         "group"):
        trainer.train_loop(small_cfg(parallel="fsdp"), inputs["hidden"], inputs["merged"],
                           inputs["target"], tmp_path, Dist.single())
    if not torch.cuda.is_available():
        with pytest.raises(TrainLaunchError, match="train.device=cuda: .* sees no CUDA device"):
            run_in(inputs, tmp_path / "cuda", small_cfg(parallel="fsdp", device="cuda"))


def test_torchrun_failure_kills_the_group_and_names_the_cause(inputs, tmp_path):
    from draftsmith.train.launch import TrainInputError, run_torchrun

    cfg = small_cfg(nproc_per_node=2, init_from=str(tmp_path / "no-such-drafter"))
    out = tmp_path / "ddp"
    out.mkdir()
    started = []
    # A rank refused its input: an input error in the parent too, never retried.
    with pytest.raises(TrainInputError, match="no-such-drafter"):
        run_torchrun(cfg, inputs["hidden"], inputs["merged"], inputs["target"], out,
                     on_start=started.append)
    with pytest.raises(ProcessLookupError):
        os.killpg(started[0].pid, 0)  # no process of the group is left


def test_a_failing_compiled_path_falls_back_with_a_warning(inputs, tmp_path, monkeypatch,
                                                           caplog):
    """As on a GPU whose Triton build fails to compile the kernels (the seeds' Blackwell
    shared-memory error): the run warns, drops to the eager layer and finishes."""
    from draftsmith.model.eagle3.model import Eagle3Drafter

    def compile_that_fails(self, enabled=True):
        def broken(*args, **kwargs):
            raise RuntimeError("No valid triton configs. OutOfResources: out of resource: "
                               "shared memory, Required: 262144, Hardware limit: 232448")
        if enabled:
            self.__dict__["_compiled_layer"] = broken
        else:
            self.__dict__.pop("_compiled_layer", None)

    monkeypatch.setattr(Eagle3Drafter, "compile_layer", compile_that_fails)
    monkeypatch.setattr(trainer, "compile_enabled", lambda cfg, device: True)
    caplog.set_level("WARNING", logger="draftsmith")
    descriptor = train(inputs, tmp_path, small_cfg(epochs=1))
    assert "compiled path failed (RuntimeError: No valid triton configs" in caplog.text
    assert "falling back to eager decoder layer" in caplog.text
    assert descriptor.figures["tau"] >= 1.0


def test_cancelling_the_launch_kills_the_torchrun_group(inputs, tmp_path):
    from draftsmith.train.launch import run_torchrun

    out = tmp_path / "ddp"
    out.mkdir()
    started = []

    def cancel(process):  # a cancelled task gets KeyboardInterrupt-like exceptions
        started.append(process)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_torchrun(small_cfg(nproc_per_node=2), inputs["hidden"], inputs["merged"],
                     inputs["target"], out, on_start=cancel)
    with pytest.raises(ProcessLookupError):
        os.killpg(started[0].pid, 0)


def test_the_train_key_follows_the_content_of_the_drafter_to_fine_tune(tmp_path):
    from draftsmith.config import ConfigError, parse_config
    from draftsmith.plan import key_material

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"one")
    raw = {"target": {"model": "builtin:tiny"},
           "data": {"sources": [{"name": "a", "path": str(tmp_path / "a.jsonl")}]},
           "train": {"init_from": str(drafter)}}
    before = key_material(parse_config(raw), "train")
    (drafter / "model.safetensors").write_bytes(b"two")
    assert key_material(parse_config(raw), "train") != before
    raw["train"]["init_from"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="train.init_from="):
        key_material(parse_config(raw), "train")


def test_the_compile_cache_lives_in_the_run_root_or_where_configured(tmp_path, monkeypatch):
    """A resumed, retried or repeated run on a GPU must find the kernels compiled before: the
    inductor cache is pointed at <run_root>/compile_cache (or train.compile_cache)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    plan = plan_stage(tmp_path / "run", "train", {"k": 1}, [])
    assert trainer.use_compile_cache(small_cfg(device="cpu"), plan) is None  # nothing compiles
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    path = trainer.use_compile_cache(small_cfg(device="cuda"), plan)
    assert path == tmp_path / "run" / trainer.COMPILE_CACHE and path.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path.resolve())
    mine = tmp_path / "elsewhere"
    assert trainer.use_compile_cache(small_cfg(device="cuda", compile_cache=str(mine)),
                                     plan) == mine
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine.resolve())
    assert trainer.use_compile_cache(small_cfg(device="cuda", compile=False), plan) is None


# --------------------------------------------------------------------------- online


EXTRACT = ExtractConfig(shard_tokens=400)  # what the `inputs` store was extracted with


def online_inputs(inputs, root):
    """The extract stage's output in online mode (no store), and what the trainer needs."""
    from draftsmith.artifacts import read_descriptor
    from draftsmith.extract.stage import record_online_capture
    from draftsmith.train.trainer import OnlineInputs

    plan = plan_stage(root, "extract", {"online": True}, [inputs["merged"]])
    hidden = read_descriptor(plan) if plan.is_complete() else \
        record_online_capture(EXTRACT, inputs["merged"], inputs["target"], plan)
    return hidden, OnlineInputs(EXTRACT, TargetConfig(model=inputs["target"].path))


def train_online(inputs, root, cfg: TrainConfig, drafter: DrafterConfig | None = None):
    hidden, online = online_inputs(inputs, root)
    plan = plan_stage(root, "train", {"train": cfg.model_dump()}, [hidden])
    return trainer.run_train(cfg, hidden, inputs["merged"], inputs["target"], plan, online,
                             drafter_settings=drafter)


def test_dflash_online_rows_train_what_the_store_trains(inputs, tmp_path):
    """DFlash's objective on online rows (the target's prefill) equals it on the store: the
    same anchors (seeded by the step), losses, counts and weights."""
    settings = DrafterConfig(kind="dflash", dflash={"block_size": 4, "num_layers": 1,
                                                     "max_anchors": 24})
    offline = train(inputs, tmp_path / "offline", small_cfg(epochs=1), settings)
    online = train_online(inputs, tmp_path / "online", small_cfg(epochs=1, mode="online"),
                          settings)
    a, b = history(offline), history(online)
    assert [(h["split"], h["step"]) for h in a] == [(h["split"], h["step"]) for h in b]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if key.startswith(("loss_", "full_acc_", "cond_acc_", "tau", "acceptance")):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    wa = load_file(str(offline.dir / "drafter.safetensors"))
    wb = load_file(str(online.dir / "drafter.safetensors"))
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-3, atol=1e-5, msg=name)


def test_online_training_equals_offline_on_the_same_rows(inputs, tmp_path):
    """The target's prefill feeding the rows gives what the store gives: the same rows in
    the same order, the same loss and counts at every step, the same validation."""
    offline = train(inputs, tmp_path / "offline", small_cfg())
    online = train_online(inputs, tmp_path / "online", small_cfg(mode="online"))
    hidden = json.loads((tmp_path / "online" / "extract").glob("*/manifest.json").__next__()
                        .read_text())
    assert hidden["descriptor"]["counts"]["bytes"] == 0  # nothing stored
    a, b = history(offline), history(online)
    assert [(h["split"], h["step"]) for h in a] == [(h["split"], h["step"]) for h in b]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if key.startswith(("loss_", "full_acc_", "cond_acc_", "tau", "acceptance", "lr",
                               "packing")):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    wa = load_file(str(offline.dir / "drafter.safetensors"))
    wb = load_file(str(online.dir / "drafter.safetensors"))
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-3, atol=1e-5, msg=name)


def test_killed_online_run_resumes_to_the_same_weights(inputs, tmp_path, monkeypatch):
    cfg = small_cfg(mode="online", checkpoint_every=2, aux_noise_std=0.05)
    straight = train_online(inputs, tmp_path / "a", cfg)
    real_step = MasterWeightAdamW.step
    calls = {"n": 0}

    def dying_step(self, clip):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Killed()
        return real_step(self, clip)

    monkeypatch.setattr(MasterWeightAdamW, "step", dying_step)
    with pytest.raises(Killed):
        train_online(inputs, tmp_path / "b", cfg)
    monkeypatch.setattr(MasterWeightAdamW, "step", real_step)
    resumed = train_online(inputs, tmp_path / "b", cfg)
    a, b = history(straight), history(resumed)
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if key not in ("tokens_per_s", "seconds", "gpu_memory_gib", "split"):
                assert y[key] == pytest.approx(x[key], rel=1e-9, abs=1e-12), (x["step"], key)
    wa = load_file(str(straight.dir / "drafter.safetensors"))
    wb = load_file(str(resumed.dir / "drafter.safetensors"))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=0, msg=name)


def test_online_under_torchrun_trains_what_offline_ddp_trains(inputs, ddp_run, tmp_path):
    """Two gloo processes, each with its own target: the job file carries the capture
    settings, and the ranks train the rows (and reach the weights) offline DDP reaches."""
    from draftsmith.train.launch import run_torchrun

    hidden, online = online_inputs(inputs, tmp_path)
    out = tmp_path / "online-ddp"
    out.mkdir()
    result = run_torchrun(torchrun_cfg(mode="online"), hidden, inputs["merged"],
                          inputs["target"], out, online=online)
    reference, reference_out = ddp_run
    assert result["rows_trained"] == reference["rows_trained"]
    for x, y in zip(reference["history"], result["history"], strict=True):
        for key in x:
            if key.startswith(("loss_", "full_acc_", "tau")):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    wa, wb = weights_of(reference_out), weights_of(out)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-3, atol=1e-5, msg=name)


def test_online_under_fsdp_trains_what_offline_fsdp_trains(inputs, fsdp_run, tmp_path):
    """FSDP as offline: each rank runs its own target's prefill and the sharded drafter reaches
    the weights offline FSDP reaches, on the same rows."""
    from draftsmith.train.launch import run_torchrun

    hidden, online = online_inputs(inputs, tmp_path)
    out = tmp_path / "online-fsdp"
    out.mkdir()
    result = run_torchrun(torchrun_cfg(mode="online", parallel="fsdp"), hidden,
                          inputs["merged"], inputs["target"], out, online=online)
    reference, reference_out = fsdp_run
    assert result["rows_trained"] == reference["rows_trained"]
    for x, y in zip(reference["history"], result["history"], strict=True):
        for key in x:
            if key.startswith(("loss_", "full_acc_", "tau")):
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    wa, wb = weights_of(reference_out), weights_of(out)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-3, atol=1e-5, msg=name)


def test_preflight_suggests_the_mode_by_the_rule(inputs, tmp_path, monkeypatch, caplog):
    from draftsmith.extract import preflight

    caplog.set_level("WARNING", logger="draftsmith")
    merged, target = inputs["merged"], inputs["target"]
    args = (EXTRACT, merged, target, tmp_path, [1, 3, 4])
    monkeypatch.setattr(preflight, "free_bytes", lambda _d: 10)  # nearly no disk
    assert preflight.suggest_train_mode(EXTRACT, small_cfg(), *args[1:]) == "online"
    assert "set train.mode: online" in caplog.text
    monkeypatch.setattr(preflight, "free_bytes", lambda _d: 1 << 40)  # plenty
    assert preflight.suggest_train_mode(EXTRACT, small_cfg(mode="online", epochs=5),
                                        *args[1:]) == "offline"
    assert preflight.suggest_train_mode(EXTRACT, small_cfg(mode="online", epochs=1),
                                        *args[1:]) is None
    assert preflight.suggest_train_mode(EXTRACT, small_cfg(), *args[1:]) is None


def test_steady_throughput_leaves_out_the_windows_that_compile():
    from draftsmith.train.trainer import steady_tokens_per_s

    def window(step, tokens, seconds):
        return {"split": "train", "step": step, "tokens": tokens, "seconds": seconds}

    history = [window(1, 100, 50.0), window(10, 900, 9.0),  # compiling, a late compile
               {"split": "validation", "step": 10, "tau": 2.0},
               window(20, 1000, 1.0), window(30, 1000, 3.0)]
    assert steady_tokens_per_s(history) == 500.0  # 2000 tokens in 4 s
    assert steady_tokens_per_s(history[:3]) is None  # too few windows to say
    old_log = [{k: v for k, v in h.items() if k not in ("tokens", "seconds")} for h in history]
    assert steady_tokens_per_s(old_log) is None  # written before windows kept their counts
