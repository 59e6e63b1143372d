"""Stage `train`: fit the drafter to the target's distribution: EAGLE-3 (and EAGLE-3.1) with
test-time training, DFlash on anchored blocks (`drafter.kind`, draftsmith/model/registry.py: the
kind decides the model, the row loss and how many positions the counts have; the rest is
shared).

The trainer in parts, each readable alone:
- `Trainer.prepare`: the store's samples (or, with `train.mode: online`, the merged data's
  token samples and the target whose prefill fills each row, `online.py`), the drafter built
  and placed by its parallel mode (`parallel.py`) and the row runner (`runner.py`); then the
  row plans, optimiser, schedule, checkpointer (`checkpoint.py`) and, when the run resumes,
  the saved state (`state.py`);
- `Trainer.train_epoch`: the optimiser steps of one epoch, metrics lines and checkpoints;
- `Trainer.validate`: validation counts summed over ranks, the best drafter by tau;
- `Trainer.run`: epochs, each followed by validation and a checkpoint.

One optimiser step takes one packed row per process (torchrun: rank r takes rows r, r+W, ...
of the epoch's plan, so an epoch's rows are neither skipped nor repeated). The run resumes from
its last checkpoint (every `checkpoint_every` steps and at each epoch end) to the same weights
and metrics an uninterrupted run reaches: the row plan, the aux noise and the schedule all
follow from the seed and the step, and the checkpoint holds model, optimiser, scheduler, RNG
states, the data position and the metrics window.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage
from draftsmith.config import DrafterConfig, ExtractConfig, TargetConfig, TrainConfig
from draftsmith.distributed import Dist
from draftsmith.errors import CheckpointError, ConfigValueError
from draftsmith.extract.store import Sample, ShardReader
from draftsmith.figures import TRAIN_METRICS_FILE
from draftsmith.model.kinds import Drafter, DrafterShape, kind_named, kind_of
from draftsmith.progress import Progress
from draftsmith.train.checkpoint import RESUME_DIR, STATE_FILE, Checkpointer, checkpointer_for
from draftsmith.train.loss import TargetHead
from draftsmith.train.metrics import StepCounts
from draftsmith.train.online import OnlineTarget, token_samples
from draftsmith.train.optim import MasterWeightAdamW, lr_factor
from draftsmith.train.packing import RowPrefetcher, plan_rows
from draftsmith.train.parallel import DDP, parallel_mode
from draftsmith.train.runner import RowRunner, resolve_attention, step_weights_of
from draftsmith.train.state import MetricsWindow, TrainState

log = logging.getLogger(__name__)

METRICS_FILE = TRAIN_METRICS_FILE
__all__ = ["METRICS_FILE", "RESUME_DIR", "STATE_FILE", "Trainer", "run_train", "train_loop",
           "step_weights_of"]


# --------------------------------------------------------------------------- preparation


def compile_enabled(cfg: TrainConfig, device: torch.device) -> bool:
    """torch.compile pays off on CUDA; on a CPU compiling costs more than it saves here."""
    return cfg.compile and device.type == "cuda"


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32


@dataclass(frozen=True)
class OnlineInputs:
    """train.mode: online: how the target runs (its dtype) and what it captures (aux layers,
    store dtype, batch limits), the settings the extract stage would have used."""

    extract: ExtractConfig
    target: TargetConfig


def row_runner(cfg: TrainConfig, drafter: Drafter, head: torch.Tensor,
               device: torch.device, mode: DDP, padding_like: Sample | None = None,
               prepare_samples=None, settings: DrafterConfig | None = None) -> RowRunner:
    """The drafter placed on the device by its parallel mode (cast to the compute dtype, or
    sharded), the target head split for the loss, the attention path and compiled layer."""
    dtype = compute_dtype(cfg)
    mode.place(drafter, dtype, device)
    target_head = TargetHead(head, drafter.draft_to_target_ids().cpu(), dtype, device)
    return RowRunner(cfg, drafter, target_head, device, mode,
                     resolve_attention(cfg, kind_of(drafter)),
                     compile_enabled(cfg, device), padding_like, prepare_samples, settings)


def build_drafter(cfg: TrainConfig, drafter_cfg: DrafterShape, embed: torch.Tensor,
                  head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> Drafter:
    """From scratch (lm_head from the target head's draft rows unless lm_head_init is random)
    or fine-tuned from an existing drafter of the same kind in any layout export reads."""
    drafter = kind_of(drafter_cfg).model(drafter_cfg)
    drafter.load_target_parts(embed, d2t, t2d, head if cfg.lm_head_init == "target" else None)
    if cfg.init_from:
        from draftsmith.export.convert import ExportError, read_drafter

        try:
            ckpt = read_drafter(cfg.init_from, family=cfg.init_family)
        except (ExportError, ValueError, FileNotFoundError) as err:
            raise CheckpointError(f"train.init_from={cfg.init_from!r}: {err}") from None
        if ckpt.kind != kind_of(drafter_cfg).name:
            raise ConfigValueError(f"train.init_from={cfg.init_from!r} is a {ckpt.kind} "
                                   f"drafter, and drafter.kind is {kind_of(drafter_cfg).name!r}:"
                                   " fine-tune a drafter of the same kind, or set drafter.kind")
        theirs = ckpt.config.model_dump(exclude={"max_position_embeddings", "rope_scaling"})
        ours = drafter_cfg.model_dump(exclude={"max_position_embeddings", "rope_scaling"})
        diff = {k: (theirs[k], ours[k]) for k in ours if theirs.get(k) != ours[k]}
        if diff:
            raise ConfigValueError(
                f"train.init_from={cfg.init_from!r} does not fit this target and data (theirs, "
                f"ours): {diff}; fine-tune a drafter built for the same target, aux layers and "
                "draft vocab, or train from scratch")
        state = {k: v for k, v in ckpt.tensors.items() if k != "embed_tokens.weight"}
        missing = drafter.load_state_dict(state, strict=False)
        if set(missing.missing_keys) - {"embed_tokens.weight"} or missing.unexpected_keys:
            raise CheckpointError(f"train.init_from={cfg.init_from!r}: missing "
                                  f"{missing.missing_keys}, unexpected {missing.unexpected_keys}")
        if not torch.equal(drafter.d2t.cpu(), d2t.cpu()):
            raise ConfigValueError(f"train.init_from={cfg.init_from!r}: its draft vocab (d2t) "
                                   "differs from the one built from this data")
        log.info("train: fine-tuning %s drafter from %s", ckpt.layout, cfg.init_from)
    drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    return drafter


def epoch_plans(samples: list[Sample], cfg: TrainConfig) -> list[list[list[Sample]]]:
    """Row plans per epoch: a seeded shuffle then first-fit packing (no tensors copied)."""
    plans = []
    for epoch in range(cfg.epochs):
        order = samples[:]
        random.Random(cfg.seed * 1000003 + epoch).shuffle(order)
        plans.append(plan_rows(order, cfg.batch_tokens))
    return plans


def packing_efficiency(rows: list[list[Sample]], row_tokens: int) -> float:
    used = sum(min(len(s.input_ids), row_tokens) for row in rows for s in row)
    return used / max(1, len(rows) * row_tokens)


class MetricsLog:
    """metrics.jsonl (rank 0) and the history the checkpoint keeps: a resumed run's file
    first holds exactly the lines its checkpoint had seen."""

    def __init__(self, history: list[dict], path: Path | None):
        self.history = history
        self._file: IO[str] | None = open(path, "w", buffering=1) if path else None  # noqa: SIM115
        for entry in history:
            self._write(entry)

    def record(self, entry: dict) -> None:
        self.history.append(entry)
        self._write(entry)

    def _write(self, entry: dict) -> None:
        if self._file:
            self._file.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        if self._file:
            self._file.close()


class Trainer:
    """One rank of a training run. `prepare` builds it from the stage's inputs; `run` trains
    every epoch; `train_epoch` and `validate` are one epoch's two halves."""

    def __init__(self, cfg: TrainConfig, dist: Dist, out: Path, runner: RowRunner,
                 train_samples: list[Sample], validation_rows: list[list[Sample]],
                 provenance: dict, train_tokens: int = 0):
        """The row plans, optimiser, schedule and checkpointer over a prepared runner; the
        saved state is loaded when `out` holds a checkpoint."""
        self.cfg, self.dist, self.out, self.runner = cfg, dist, out, runner
        self.drafter = runner.drafter
        self.train_samples, self.train_tokens = train_samples, train_tokens
        self.validation_rows_all = validation_rows
        mine: list[list[Sample] | None] = list(validation_rows[dist.rank::dist.world])
        if runner.mode.sharded:  # every rank runs as many forwards (None: padding), or FSDP hangs
            mine += [None] * (math.ceil(len(validation_rows) / dist.world) - len(mine))
        self.validation_rows = mine
        self.plans = epoch_plans(train_samples, cfg)
        self.steps_per_epoch = [math.ceil(len(p) / dist.world) for p in self.plans]
        self.total_steps = sum(self.steps_per_epoch)
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = MasterWeightAdamW(self.trainable, cfg.lr, cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, lr_factor(cfg.warmup_ratio, cfg.scheduler,
                                                self.total_steps))
        self.checkpointer: Checkpointer = checkpointer_for(
            cfg.parallel, out, dist, self.drafter, self.optimizer, self.scheduler)
        self.provenance = provenance
        self.window = MetricsWindow(runner.positions, runner.device)
        self.state = self.checkpointer.load(self.window) or TrainState.start(dist.world)
        self._log: MetricsLog | None = None
        self._progress: Progress | None = None
        self._prefetcher: RowPrefetcher | None = None

    @classmethod
    def prepare(cls, cfg: TrainConfig, hidden: Descriptor, merged: Descriptor,
                target: Descriptor, out: Path, dist: Dist,
                online: OnlineInputs | None = None,
                drafter_settings: DrafterConfig | None = None) -> Trainer:
        """Everything a run needs, from the store (offline) or the merged data and the target
        model (online), the merged data's vocab map and the target's head; the saved state
        when `out` holds a checkpoint. drafter_settings: the `drafter` section (default:
        plain EAGLE-3)."""
        drafter_settings = drafter_settings or DrafterConfig()
        from draftsmith.data.merge import read_vocab_map
        from draftsmith.target import load_target_head_and_embedding

        mode = parallel_mode(cfg.parallel, dist)
        torch.manual_seed(cfg.seed)
        device = dist.device(cfg.device)
        if cfg.mode == "online":
            if online is None:
                raise ConfigValueError("train.mode=online needs the extract and target settings "
                                       "the target's prefill follows: run it through run_train")
            train_samples = token_samples(merged, "train", online.extract.shard_tokens)
            validation = token_samples(merged, "validation", online.extract.shard_tokens)
            aux_ids = hidden.figures["aux_layer_ids"]
            train_tokens = sum(len(s.input_ids) for s in train_samples)
        else:
            store = ShardReader(hidden.path)
            train_samples = list(store.samples("train"))
            validation = list(store.samples("validation"))
            aux_ids, train_tokens = store.aux_layer_ids, store.num_tokens("train")
        validation_rows = plan_rows(validation, cfg.batch_tokens)
        embed, head = load_target_head_and_embedding(target)
        d2t, t2d = read_vocab_map(merged)
        target_config = json.loads((Path(target.path) / "config.json").read_text())
        target_config = target_config.get("text_config", target_config)
        drafter_cfg = kind_named(drafter_settings.kind).build_config(
            target_config, aux_ids, d2t.numel(), drafter_settings, target.path)
        drafter = build_drafter(cfg, drafter_cfg, embed, head, d2t, t2d)
        if cfg.mode == "online":  # loaded after the drafter's seeded initialisation
            prefill = OnlineTarget(target.path, online.target, online.extract, aux_ids, device)
            runner = row_runner(cfg, drafter, head, device, mode, prefill.padding_like(),
                                prepare_samples=prefill.samples, settings=drafter_settings)
        else:
            runner = row_runner(cfg, drafter, head, device, mode,
                                train_samples[0] if train_samples else None,
                                settings=drafter_settings)
        del head
        provenance = {"target_fingerprint": target.fingerprint, "target_path": target.path,
                      "hidden_states": hidden.fingerprint, "data": merged.fingerprint,
                      "train_config": cfg.model_dump(),
                      "drafter_config": drafter_settings.model_dump()}
        return cls(cfg, dist, out, runner, train_samples, validation_rows, provenance,
                   train_tokens=train_tokens)

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        """Train the remaining epochs, validating after each (and where max_steps stops the
        run mid-epoch); returns the summary rank 0 builds the descriptor from."""
        cfg, dist, state = self.cfg, self.dist, self.state
        log.info("train: %d samples (%d tokens) in %d rows/epoch (packing %.1f%%) x %d epochs, "
                 "%d process(es) = %d steps; %d validation rows; %.2fM trainable parameters; "
                 "attention %s, compiled %s, %s", len(self.train_samples), self.train_tokens,
                 len(self.plans[0]), 100 * packing_efficiency(self.plans[0], cfg.batch_tokens),
                 cfg.epochs, dist.world, self.total_steps, len(self.validation_rows_all),
                 sum(p.numel() for p in self.trainable) / 1e6, self.runner.attention,
                 self.runner.compiled, cfg.dtype)
        # Online rows run the target on the training stream when they are needed.
        self._prefetcher = RowPrefetcher(self.runner.device,
                                         background=self.runner.prepare_samples is None)
        self._log = MetricsLog(state.history, self.out / METRICS_FILE if dist.is_main else None)
        self._progress = Progress("train", total=self.total_steps, unit="step", done=state.step)
        if self.runner.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.runner.device)
        try:
            for epoch in range(state.epoch, cfg.epochs):
                finished = self.train_epoch(epoch)
                self.validate(epoch)
                if not finished:
                    break
                state.epoch, state.step_in_epoch = epoch + 1, 0
                self.checkpoint()
        finally:
            self._prefetcher.close()
            self._progress.close()
            self._log.close()
        best = next(h for h in state.history if h["split"] == "validation"
                    and h["epoch"] == state.best_epoch)
        return {"steps": state.step, "best_epoch": state.best_epoch, "best": best,
                "history": state.history,
                "rows_trained": dist.gather_objects(state.trained[dist.rank]),
                "rows_per_epoch": [len(p) for p in self.plans],
                # DDP: each rank's copy, equal on every rank when gradients were averaged
                # right; FSDP: the sum over the whole (sharded) weights, the same on every rank.
                "weight_sums": dist.gather_objects(self.runner.mode.weight_sum(self.trainable))}

    def checkpoint(self) -> None:
        self.checkpointer.save(self.state, self.window)

    # ------------------------------------------------------------------ one epoch

    def train_epoch(self, epoch: int) -> bool:
        """The epoch's remaining steps (up to max_steps); True when it ran to its end."""
        cfg, dist, state, runner = self.cfg, self.dist, self.state, self.runner
        plan = self.plans[epoch]
        pending, tokens_next = self._start_row(epoch, state.step_in_epoch)
        while state.step_in_epoch < self.steps_per_epoch[epoch] and state.step < self.total_steps:
            index = state.step_in_epoch * dist.world + dist.rank
            row, tokens = self._prefetcher.wait(pending), tokens_next
            pending, tokens_next = self._start_row(epoch, state.step_in_epoch + 1)
            rows_in_step = min(dist.world, len(plan) - state.step_in_epoch * dist.world)
            noise_seed = (cfg.seed * 1_000_003 + epoch) * 10_000_019 + index
            counts = runner.guarded(lambda row=row, s=noise_seed: runner.train_row(row, s))
            if row is not None:
                state.trained[dist.rank].append([epoch, index])
            runner.mode.sync_gradients(self.trainable, rows_in_step)
            self.optimizer.step(cfg.grad_clip)
            self.scheduler.step()
            state.step_in_epoch += 1
            state.step += 1
            self.window.add(counts, tokens)
            self._progress.update(1)
            if state.step == 1 or state.step % cfg.log_every == 0 \
                    or state.step == self.total_steps:
                self._log_window(epoch)
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                self.checkpoint()
        return state.step_in_epoch >= self.steps_per_epoch[epoch]

    def _row_samples(self, epoch: int, step_in_epoch: int) -> list[Sample]:
        """This rank's samples of a step (none in an epoch's last step when rows run out)."""
        index = step_in_epoch * self.dist.world + self.dist.rank
        plan = self.plans[epoch]
        if step_in_epoch >= self.steps_per_epoch[epoch] or index >= len(plan):
            return []
        return plan[index]

    def _start_row(self, epoch: int, step_in_epoch: int):
        """Starts building this rank's row of a step on the prefetch thread; returns what
        the prefetcher's wait takes, and the row's real tokens."""
        samples = self._row_samples(epoch, step_in_epoch)
        tokens = sum(min(len(s.input_ids), self.cfg.batch_tokens) for s in samples)
        return self._prefetcher.start(lambda pin: self.runner.row(samples, pin)), tokens

    def _log_window(self, epoch: int) -> None:
        """One metrics line: the window's counts summed over the ranks (the only sync of a
        step), then a fresh window."""
        device = self.runner.device
        reduced = self.dist.sum_tensor(self.window.as_flat())
        summary = StepCounts.from_tensor(reduced[:-1].view(5, -1)).summary()
        entry = {"split": "train", "step": self.state.step, "epoch": epoch,
                 "lr": self.scheduler.get_last_lr()[0],
                 "tokens_per_s": float(reduced[-1]) / max(self.window.seconds, 1e-9),
                 "tokens": int(reduced[-1]), "seconds": round(self.window.seconds, 3),
                 "gpu_memory_gib": gpu_memory_gib(device), **summary}
        self._log.record(entry)
        log.info("train step %d/%d epoch %d: loss %s full_acc %s tau %.2f lr %.2e "
                 "%.0f tokens/s%s", self.state.step, self.total_steps, epoch,
                 [round(summary[f"loss_{j}"], 3) for j in range(self.runner.positions)],
                 [round(summary[f"full_acc_{j}"], 3) for j in range(self.runner.positions)],
                 summary["tau"], entry["lr"], entry["tokens_per_s"],
                 f" {entry['gpu_memory_gib']:.1f} GiB" if device.type == "cuda" else "")
        self.window.reset()

    # ------------------------------------------------------------------ validation

    def validate(self, epoch: int) -> dict:
        """Every rank its share of the validation rows, counts summed; the best drafter by tau
        is written (rank 0) as the stage's output."""
        cfg, dist, state = self.cfg, self.dist, self.state
        counts = self.runner.guarded(lambda: self.runner.evaluate(self.validation_rows))
        positions = self.runner.positions
        val = StepCounts.from_flat(dist.sum_tensor(counts.flat()), positions).summary()
        efficiency = packing_efficiency(self.plans[min(epoch, len(self.plans) - 1)],
                                        cfg.batch_tokens)
        self._log.record({"split": "validation", "step": state.step, "epoch": epoch,
                          "packing_efficiency": efficiency, **val})
        log.info("validation after epoch %d: tau %.3f, acceptance replayed %.3f, full_acc %s, "
                 "cond_acc %s; packing %.1f%%", epoch, val["tau"],
                 val.get("acceptance_replayed", float("nan")),
                 [round(val[f"full_acc_{j}"], 3) for j in range(positions)],
                 [round(val[f"cond_acc_{j}"], 3) for j in range(positions)],
                 100 * efficiency)
        if val["tau"] > state.best_tau:  # the same tau on every rank: they all come in here
            state.best_tau, state.best_epoch = val["tau"], epoch
            tensors = self.runner.mode.whole_state(self.drafter, compute_dtype(cfg))
            if dist.is_main:
                from draftsmith.export.native import save_native

                save_native(self.drafter, self.out, tensors=tensors, provenance={
                    **self.provenance, "epoch": epoch, "step": state.step, "validation": val})
        return val


def train_loop(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
               out: Path, dist: Dist, online: OnlineInputs | None = None,
               drafter_settings: DrafterConfig | None = None) -> dict:
    """Train in this process (one rank of W). Writes metrics, checkpoints and the best drafter
    into `out` on rank 0; returns the summary rank 0 builds the descriptor from."""
    return Trainer.prepare(cfg, hidden, merged, target, out, dist, online,
                           drafter_settings).run()


def gpu_memory_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


# --------------------------------------------------------------------------- the stage


COMPILE_CACHE = "compile_cache"


def use_compile_cache(cfg: TrainConfig, plan: StagePlan) -> Path | None:
    """Point torch.compile's on-disk caches (inductor's FX graphs and Triton kernels) at
    train.compile_cache, or <run_root>/compile_cache: a resumed, retried or repeated run, and
    the torchrun workers, find the kernels compiled before and skip the 35-140 s of
    compiling (dynamo still traces, a few seconds)."""
    if not cfg.compile or not cfg.device.startswith("cuda"):
        return None
    path = Path(cfg.compile_cache) if cfg.compile_cache else plan.dir.parents[1] / COMPILE_CACHE
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve())  # inherited by torchrun
    log.info("train: compile cache %s", path)
    return path


def run_train(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
              plan: StagePlan, online: OnlineInputs | None = None,
              drafter_settings: DrafterConfig | None = None) -> Descriptor:
    """Train in this process, or under torchrun with cfg.nproc_per_node processes (always
    under torchrun with train.parallel=fsdp, which shards over a process group even of one). A
    partial directory from a killed attempt is resumed from its last checkpoint, not started
    over. Several hosts (train.nnodes > 1) train through draftsmith/train/nodes.py instead."""
    if cfg.nnodes > 1:
        raise ConfigValueError(
            f"train.nnodes={cfg.nnodes}: training across hosts runs as one flow run per GPU "
            "host, in distributed mode (orchestration.mode=distributed, orchestration.gpu_hosts "
            f"naming at least {cfg.nnodes} GPU host blocks); here, set train.nnodes=1")
    out = prepare_output(plan)
    use_compile_cache(cfg, plan)
    if cfg.nproc_per_node > 1 or cfg.parallel == "fsdp":
        from draftsmith.train.launch import run_torchrun

        result = run_torchrun(cfg, hidden, merged, target, out, online=online,
                              drafter_settings=drafter_settings)
    else:
        result = train_loop(cfg, hidden, merged, target, out, Dist.single(), online,
                            drafter_settings)
    return finish_train(cfg, plan, result, drafter_settings)


def prepare_output(plan: StagePlan) -> Path:
    """The stage directory, kept when a killed attempt left a checkpoint to resume from."""
    if plan.is_complete():
        raise RuntimeError(f"{plan.dir} is already complete; refusing to overwrite it")
    out = plan.dir
    if out.exists() and not (out / RESUME_DIR / STATE_FILE).is_file():
        import shutil

        shutil.rmtree(out)  # a crashed attempt with nothing to resume from
    out.mkdir(parents=True, exist_ok=True)
    return out


def steady_tokens_per_s(history: list[dict]) -> float | None:
    """Training tokens a second, all ranks, over the logged windows after the first two: the
    first holds compiling and the second can hold a late compile (seen on an H200 with a cold
    cache). Validation and checkpoints at epoch ends fall in the windows they interrupt. None
    with fewer than three windows (or a metrics log written before windows kept their counts)."""
    windows = [h for h in history if h["split"] == "train" and "seconds" in h][2:]
    seconds = sum(h["seconds"] for h in windows)
    return round(sum(h["tokens"] for h in windows) / seconds, 1) if seconds > 0 else None


def finish_train(cfg: TrainConfig, plan: StagePlan, result: dict,
                 drafter_settings: DrafterConfig | None = None) -> Descriptor:
    """The chart, the resume state removed, the manifest: the stage's output from rank 0's
    result."""
    from draftsmith.train.charts import plot_metrics

    out = plan.dir
    settings = drafter_settings or DrafterConfig()
    plot_metrics(result["history"], kind_named(settings.kind).positions(settings, cfg), out)
    best = result["best"]
    log.info("train: best epoch %d, validation tau %.3f, acceptance replayed %.3f",
             result["best_epoch"], best["tau"], best.get("acceptance_replayed", float("nan")))
    ranks = {k: result[k] for k in ("ranks_finished", "torchrun_exit_code") if k in result}
    figures = {k: round(v, 4) for k, v in best.items() if k not in ("split", "step", "epoch")}
    descriptor = finish_stage(
        plan,
        counts={"steps": result["steps"], "epochs": result["best_epoch"] + 1},
        figures={**figures, "tokens_per_s": steady_tokens_per_s(result["history"])},
        extra=ranks or None,  # under torchrun: every rank finished (how torchrun exited)
        leave_out=RESUME_DIR,
    )
    # Finished: nothing left to resume. Deleted only now: a manifest that could not be written
    # (a full disk) leaves the last checkpoint, and the rerun trains no step again.
    import shutil

    shutil.rmtree(out / RESUME_DIR, ignore_errors=True)
    return descriptor
