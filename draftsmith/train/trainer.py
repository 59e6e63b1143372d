"""Stage `train`: fit the EAGLE-3 drafter to the target's distribution with test-time training.

Targets come from the stored final hidden states: softmax(lm_head(final_norm(h))) restricted
to the draft vocab and renormalised (`draftsmith/train/loss.py`, never full-vocab logits for a
whole row). A position carries a loss when its token is loss-masked (assistant text) and the
target's argmax is in the draft vocab; accuracy counts every loss-masked position, since a
target token outside the draft vocab is a real miss.

One optimiser step takes one packed row per process (torchrun: rank r takes rows r, r+W, ...
of the epoch's plan, so an epoch's rows are neither skipped nor repeated). The run resumes from
its last checkpoint (every `checkpoint_every` steps and at each epoch end) to the same weights
an uninterrupted run reaches: the row plan, the aux noise and the schedule all follow from the
seed and the step, and the checkpoint holds model, optimiser, scheduler, RNG states and the
data position.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.artifacts import Descriptor, StagePlan, atomic_path, finish_stage
from draftsmith.config import TrainConfig
from draftsmith.extract.store import Sample, ShardReader
from draftsmith.model.eagle3 import Eagle3Config, Eagle3Drafter, shift_left
from draftsmith.progress import Progress
from draftsmith.train.distributed import Dist
from draftsmith.train.loss import TargetHead, fused_linear_soft_ce
from draftsmith.train.metrics import StepCounts, replay_chain_decoding
from draftsmith.train.optim import MasterWeightAdamW, lr_factor
from draftsmith.train.packing import (
    PackedRow,
    RowPrefetcher,
    concat_row,
    padding_row,
    plan_rows,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RESUME_DIR = "resume"
STATE_FILE = "state.pt"


def step_weights_of(cfg: TrainConfig) -> list[float]:
    if cfg.step_weights is not None:
        return list(cfg.step_weights)
    return [cfg.step_weight_decay**j for j in range(cfg.ttt_steps)]


def row_loss(drafter: Eagle3Drafter, row: PackedRow, head: TargetHead | torch.Tensor,
             steps: int, step_weights: float | list[float], device: str,
             attention: str = "sdpa", aux_noise_std: float = 0.0, noise_seed: int = 0,
             chunk_tokens: int = 2048) -> tuple[torch.Tensor, StepCounts]:
    """Weighted TTT loss of one packed row, and its metric counts.

    step_weights: per-step loss weights, or a float d meaning d**j. aux_noise_std: Gaussian
    noise on the aux inputs (std relative to each position's RMS), seeded by noise_seed."""
    loss, counts = row_loss_on_device(drafter, row, head, steps, step_weights, device,
                                      attention, aux_noise_std, noise_seed, chunk_tokens)
    return loss, StepCounts.from_tensor(counts)


def row_loss_on_device(drafter: Eagle3Drafter, row: PackedRow, head: TargetHead | torch.Tensor,
                       steps: int, step_weights: float | list[float], device: str,
                       attention: str = "sdpa", aux_noise_std: float = 0.0, noise_seed: int = 0,
                       chunk_tokens: int = 2048, with_runs: bool = False):
    """row_loss with the counts left on the device ([5, steps], StepCounts.as_tensor's
    layout): reading them forces a sync, which the trainer leaves until after the step.
    with_runs: also return runs [T], the drafts in a row the target accepts at each anchor
    (what replay_chain_decoding walks).

    The row runs as the drafter's forward (`Eagle3Drafter.in_forward`): under FSDP that is
    where its parameters, lm_head's included, are whole."""
    if isinstance(step_weights, float | int):
        step_weights = [float(step_weights) ** j for j in range(steps)]
    if isinstance(head, torch.Tensor):
        head = TargetHead(head, drafter.draft_to_target_ids(), torch.float32, device)
    return drafter.in_forward(_row_loss, row, head, steps, step_weights, device, attention,
                              aux_noise_std, noise_seed, chunk_tokens, with_runs)


def _row_loss(drafter: Eagle3Drafter, row: PackedRow, head: TargetHead, steps: int,
              step_weights: list[float], device: str, attention: str, aux_noise_std: float,
              noise_seed: int, chunk_tokens: int, with_runs: bool = False):
    dtype = drafter.fc.weight.dtype  # the compute dtype (FSDP: of the all-gathered weights)
    probs, target_arg = head.targets(row.final.to(device), row.target_argmax,
                                     compiled=drafter.compiled)  # [T, D], [T] draft ids or -1
    aux = row.aux.to(device, dtype)  # [T, K*Ht]
    if aux_noise_std > 0:
        g = torch.Generator(device=device).manual_seed(noise_seed)
        rms = aux.float().pow(2).mean(-1, keepdim=True).sqrt()  # [T, 1]
        noise = torch.randn(aux.shape, generator=g, device=device)  # [T, K*Ht]
        aux = (aux.float() + aux_noise_std * rms * noise).to(dtype)  # [T, K*Ht]
    normed = drafter.forward_ttt_hidden(
        row.input_ids[None].to(device), aux[None], row.position_ids[None].to(device),
        row.document_ids[None].to(device), steps, attention,
    )  # steps x [1, T, H]
    T = row.num_tokens
    docs = row.document_ids.to(device)
    loss_mask = row.loss_mask.to(device)
    in_vocab = target_arg >= 0  # [T]
    chain_right = torch.ones_like(loss_mask)
    runs = torch.zeros(T, dtype=torch.long, device=device)  # [T]
    total = torch.zeros((), device=device)
    rows = []
    for j, x in enumerate(normed):
        n = T - j - 1  # anchors t < n have a target at t+j+1
        # Token t+j+2 must exist, be in the anchor's document and be assistant text.
        same_doc = shift_left(docs[None], j + 2, fill=-1)[0] == docs  # [T]
        mask = shift_left(loss_mask[None], j + 2)[0] & same_doc  # [T]
        with_loss = mask[:n] & in_vocab[j + 1:]  # [n]
        n_loss = with_loss.sum()
        weights = with_loss.float() * (step_weights[j] / n_loss.clamp(min=1))  # [n]
        loss, ce, guess = fused_linear_soft_ce(x[0, :n], drafter.lm_head.weight,
                                               probs[j + 1:], weights, chunk_tokens,
                                               compiled=drafter.compiled)
        total = total + loss
        right = torch.zeros_like(loss_mask)  # [T]
        right[:n] = guess == target_arg[j + 1:]
        prefix_right = chain_right
        chain_right = chain_right & right
        runs += chain_right  # steps 0..j all right: one more draft accepted in a row
        rows.append(torch.stack([
            (ce.double() * with_loss).sum(), n_loss.double(), mask.sum().double(),
            (mask & chain_right).sum().double(), (mask & prefix_right).sum().double(),
        ]))  # [5]
    if with_runs:
        return total, torch.stack(rows, dim=1), runs  # [5, steps], [T]
    return total, torch.stack(rows, dim=1)  # [5, steps]


# --------------------------------------------------------------------------- set-up


def compile_enabled(cfg: TrainConfig, device: torch.device) -> bool:
    """torch.compile pays off on CUDA; on a CPU compiling costs more than it saves here."""
    return cfg.compile and device.type == "cuda"


def resolve_attention(cfg: TrainConfig) -> str:
    if cfg.attention != "auto":
        return cfg.attention
    return "flex" if cfg.device.startswith("cuda") else "sdpa"


def build_drafter(cfg: TrainConfig, drafter_cfg: Eagle3Config, embed: torch.Tensor,
                  head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Drafter:
    """From scratch (lm_head from the target head's draft rows unless lm_head_init is random)
    or fine-tuned from an existing drafter in any layout export reads."""
    drafter = Eagle3Drafter(drafter_cfg)
    drafter.load_target_parts(embed, d2t, t2d, head if cfg.lm_head_init == "target" else None)
    if cfg.init_from:
        from draftsmith.export.convert import ExportError, read_drafter

        try:
            ckpt = read_drafter(cfg.init_from, family=cfg.init_family)
        except (ExportError, ValueError, FileNotFoundError) as err:
            raise ValueError(f"train.init_from={cfg.init_from!r}: {err}") from None
        theirs = ckpt.config.model_dump(exclude={"max_position_embeddings", "rope_scaling"})
        ours = drafter_cfg.model_dump(exclude={"max_position_embeddings", "rope_scaling"})
        diff = {k: (theirs[k], ours[k]) for k in ours if theirs.get(k) != ours[k]}
        if diff:
            raise ValueError(f"train.init_from={cfg.init_from!r} does not fit this target and "
                             f"data (theirs, ours): {diff}; fine-tune a drafter built for the "
                             "same target, aux layers and draft vocab, or train from scratch")
        state = {k: v for k, v in ckpt.tensors.items() if k != "embed_tokens.weight"}
        missing = drafter.load_state_dict(state, strict=False)
        if set(missing.missing_keys) - {"embed_tokens.weight"} or missing.unexpected_keys:
            raise ValueError(f"train.init_from={cfg.init_from!r}: missing "
                             f"{missing.missing_keys}, unexpected {missing.unexpected_keys}")
        if not torch.equal(drafter.d2t.cpu(), d2t.cpu()):
            raise ValueError(f"train.init_from={cfg.init_from!r}: its draft vocab (d2t) differs "
                             "from the one built from this data")
        log.info("train: fine-tuning %s drafter from %s", ckpt.layout, cfg.init_from)
    drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    return drafter


@dataclass
class Runtime:
    """How rows run on this device; `fallback` moves down one rung if compiling fails."""

    attention: str
    compiled: bool

    def fallback(self, drafter: Eagle3Drafter, err: BaseException) -> bool:
        if isinstance(err, torch.OutOfMemoryError):  # not a compiler problem: report it
            return False
        if self.compiled:
            rung = "eager decoder layer with compiled flex attention" \
                if self.attention == "flex" else "eager decoder layer"
            self.compiled = False
            drafter.compile_layer(False)
        elif self.attention == "flex":
            rung = "SDPA attention with a dense TTT mask"
            self.attention = "sdpa"
        else:
            return False
        log.warning("train: compiled path failed (%s: %s); falling back to %s", type(err).__name__,
                    str(err).splitlines()[0][:300] if str(err) else "", rung)
        return True


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


# --------------------------------------------------------------------------- the loop


def train_loop(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
               out: Path, dist: Dist) -> dict:
    """Train in this process (one rank of W). Writes metrics, checkpoints and the best drafter
    into `out` on rank 0; returns the summary rank 0 builds the descriptor from."""
    from draftsmith.data.merge import read_vocab_map
    from draftsmith.target import load_target_head_and_embedding

    sharded = cfg.parallel == "fsdp"
    if sharded and not dist.grouped:
        raise ValueError("train.parallel=fsdp shards the drafter over a process group: run it "
                         "through run_train (which starts torchrun), or set train.parallel=ddp")
    torch.manual_seed(cfg.seed)
    device = dist.device(cfg.device)
    store = ShardReader(hidden.path)
    train_samples = list(store.samples("train"))
    val_rows_all = plan_rows(list(store.samples("validation")), cfg.batch_tokens)
    val_rows: list[list[Sample] | None] = list(val_rows_all[dist.rank::dist.world])
    if sharded:  # every rank runs as many forwards (None: a padding row), or FSDP hangs
        val_rows += [None] * (math.ceil(len(val_rows_all) / dist.world) - len(val_rows))
    embed, head = load_target_head_and_embedding(target)
    d2t, t2d = read_vocab_map(merged)
    target_config = json.loads((Path(target.path) / "config.json").read_text())
    target_config = target_config.get("text_config", target_config)
    drafter_cfg = Eagle3Config.from_target(target_config, store.aux_layer_ids, d2t.numel())
    drafter = build_drafter(cfg, drafter_cfg, embed, head, d2t, t2d)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    if sharded:  # float32 shards, all-gathered in dtype for compute
        from draftsmith.train import fsdp

        fsdp.shard_drafter(drafter, dtype, device, dist.world)
    else:
        with torch.no_grad():  # parameters only: RoPE's inv_freq buffer stays float32
            for p in drafter.parameters():
                p.data = p.data.to(dtype)
        drafter.to(device)
    target_head = TargetHead(head, drafter.draft_to_target_ids().cpu(), dtype, device)
    del head
    runtime = Runtime(resolve_attention(cfg), compile_enabled(cfg, device))
    drafter.compile_layer(runtime.compiled)
    pad_to = cfg.batch_tokens if runtime.attention == "flex" else None  # static shapes
    # FSDP: what a rank without a row runs, so that it joins every collective (made when
    # needed: an 8192-token row of an 8B-shaped target is ~270 MB of zeros).
    padding = (lambda: padding_row(train_samples[0], pad_to or cfg.batch_tokens, device)) \
        if sharded and train_samples else None

    plans = epoch_plans(train_samples, cfg)
    steps_per_epoch = [math.ceil(len(p) / dist.world) for p in plans]
    total_steps = sum(steps_per_epoch)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = MasterWeightAdamW(trainable, cfg.lr, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lr_factor(cfg.warmup_ratio, cfg.scheduler, total_steps))
    weights = step_weights_of(cfg)
    if len(weights) != cfg.ttt_steps:
        raise ValueError(f"train.step_weights has {len(weights)} entries, ttt_steps is "
                         f"{cfg.ttt_steps}: give one weight per step")

    state = {"epoch": 0, "step_in_epoch": 0, "step": 0, "best_tau": -1.0, "best_epoch": -1,
             "history": [], "trained": [[] for _ in range(dist.world)]}
    state_path = out / RESUME_DIR / STATE_FILE
    if state_path.is_file():
        saved = torch.load(state_path, map_location="cpu", weights_only=False)
        saved_world = len(saved["position"]["trained"])
        if saved_world != dist.world:
            raise ValueError(f"{state_path} was written by {saved_world} process(es); resume "
                             f"with train.nproc_per_node={saved_world} (now {dist.world}), or "
                             "delete it to start over")
        saved_parallel = saved.get("parallel", "ddp")
        if saved_parallel != cfg.parallel:
            raise ValueError(f"{state_path} was written with train.parallel={saved_parallel}; "
                             f"resume with that setting (now {cfg.parallel}), or delete it to "
                             "start over")
        if sharded:  # this rank's shards of model and optimiser, from its own file
            shard_path = state_path.parent / saved["shards"][dist.rank]
            if not shard_path.is_file():
                raise ValueError(f"{state_path} names {shard_path}, which is missing; delete "
                                 f"{state_path.parent} to start over")
            shard = torch.load(shard_path, map_location="cpu", weights_only=False)
            fsdp.load_local_state(drafter, shard["model"])
            fsdp.load_local_optimizer_state(optimizer.optimizer, shard["optimizer"])
        else:
            drafter.load_state_dict(saved["model"], strict=False)
            optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        restore_rng(saved["rng"][min(dist.rank, len(saved["rng"]) - 1)])
        state = saved["position"]
        log.info("train: resuming from %s at step %d (epoch %d, row %d of the epoch)",
                 state_path, state["step"], state["epoch"], state["step_in_epoch"] * dist.world)

    trained: list[list[int]] = state["trained"][dist.rank]  # (epoch, row index) this rank ran

    def save_state() -> None:
        rng = dist.gather_objects(rng_state())
        state["trained"] = dist.gather_objects(trained)
        if sharded:
            save_shards(rng)
            return
        if not dist.is_main:
            return
        model = {k: v.cpu() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
        with atomic_path(state_path) as tmp:
            torch.save({"parallel": "ddp", "model": model, "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "rng": rng, "position": state}, tmp)

    def save_shards(rng: list[dict]) -> None:
        """FSDP: every rank writes its shards of model and optimiser to a file named by the
        step; once all are on disk rank 0 writes state.pt naming them (the switch to the new
        checkpoint, atomic), then deletes the previous step's files."""
        names = [f"rank{r}-step{state['step']}.pt" for r in range(dist.world)]
        with atomic_path(state_path.parent / names[dist.rank]) as tmp:
            torch.save({"model": fsdp.local_state(drafter, skip=("embed_tokens.weight",)),
                        "optimizer": fsdp.local_optimizer_state(optimizer.optimizer)}, tmp)
        dist.barrier()
        if not dist.is_main:
            return
        with atomic_path(state_path) as tmp:
            torch.save({"parallel": "fsdp", "shards": names, "scheduler": scheduler.state_dict(),
                        "rng": rng, "position": state}, tmp)
        for old in state_path.parent.glob("rank*-step*.pt"):
            if old.name not in names:
                old.unlink(missing_ok=True)

    def guarded(fn):
        """Run fn; on the first failure of a compiled path fall back one rung and retry."""
        while True:
            try:
                return fn()
            except Exception as err:  # noqa: BLE001 - any compiler error, reported in full
                if not runtime.fallback(drafter, err):
                    raise
                if sharded:
                    fsdp.reset_after_failure(drafter)
                for p in drafter.parameters():
                    p.grad = None

    def train_row(row: PackedRow | None, noise_seed: int) -> torch.Tensor:
        if row is None and padding is None:  # DDP: no row in the epoch's last step; its
            return StepCounts(cfg.ttt_steps).as_tensor()  # gradients are zeros in the sum
        loss, counts = row_loss_on_device(drafter, padding() if row is None else row,
                                          target_head, cfg.ttt_steps, weights, device,
                                          runtime.attention, cfg.aux_noise_std, noise_seed)
        loss.backward()  # a padding row (FSDP): zero loss, zero gradients, counts dropped
        return counts if row is not None else StepCounts(cfg.ttt_steps).as_tensor()

    def row_samples(epoch: int, step_in_epoch: int) -> list[Sample]:
        """This rank's samples of a step (none in an epoch's last step when rows run out)."""
        index = step_in_epoch * dist.world + dist.rank
        if step_in_epoch >= steps_per_epoch[epoch] or index >= len(plans[epoch]):
            return []
        return plans[epoch][index]

    def start_row(epoch: int, step_in_epoch: int):
        """Starts building this rank's row of a step (padded where shapes must be static);
        returns what prefetcher.wait takes, and the row's real tokens."""
        samples = row_samples(epoch, step_in_epoch)
        tokens = sum(min(len(s.input_ids), cfg.batch_tokens) for s in samples)
        return prefetcher.start(lambda pin: concat_row(samples, cfg.batch_tokens, pad_to, pin)
                                if samples else None), tokens

    prefetcher = RowPrefetcher(device)

    history: list[dict] = state["history"]
    metrics_file = open(out / METRICS_FILE, "w", buffering=1) if dist.is_main else None  # noqa: SIM115
    for entry in history:  # a resumed run's file holds exactly what its checkpoint had seen
        metrics_file and metrics_file.write(json.dumps(entry) + "\n")

    def record(entry: dict) -> None:
        history.append(entry)
        if metrics_file:
            metrics_file.write(json.dumps(entry) + "\n")

    log.info("train: %d samples (%d tokens) in %d rows/epoch (packing %.1f%%) x %d epochs, "
             "%d process(es) = %d steps; %d validation rows; %.2fM trainable parameters; "
             "attention %s, compiled %s, %s", len(train_samples), store.num_tokens("train"),
             len(plans[0]), 100 * packing_efficiency(plans[0], cfg.batch_tokens), cfg.epochs,
             dist.world, total_steps, len(val_rows_all),
             sum(p.numel() for p in trainable) / 1e6, runtime.attention, runtime.compiled,
             cfg.dtype)
    progress = Progress("train", total=total_steps, unit="step")
    progress.update(state["step"])
    # The window's counts stay on the device and are read (the only sync of a step) when
    # logged, so the GPU never idles while the CPU queues the next step.
    window = torch.zeros(5, cfg.ttt_steps, dtype=torch.float64, device=device)  # [5, S]
    window_tokens, window_started = 0, time.monotonic()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        for epoch in range(state["epoch"], cfg.epochs):
            plan = plans[epoch]
            pending, tokens_next = start_row(epoch, state["step_in_epoch"])
            while state["step_in_epoch"] < steps_per_epoch[epoch] and state["step"] < total_steps:
                index = state["step_in_epoch"] * dist.world + dist.rank
                row, tokens = prefetcher.wait(pending), tokens_next
                pending, tokens_next = start_row(epoch, state["step_in_epoch"] + 1)
                rows_in_step = min(dist.world, len(plan) - state["step_in_epoch"] * dist.world)
                noise_seed = (cfg.seed * 1_000_003 + epoch) * 10_000_019 + index
                counts = guarded(lambda row=row, s=noise_seed: train_row(row, s))
                if row is not None:
                    trained.append([epoch, index])
                if sharded:  # reduce-scattered in backward, averaged over the ranks
                    fsdp.rescale_gradients(trainable, dist.world, rows_in_step)
                else:
                    dist.average_gradients(trainable, rows_in_step)
                optimizer.step(cfg.grad_clip)
                scheduler.step()
                state["step_in_epoch"] += 1
                state["step"] += 1
                step = state["step"]
                window += counts.to(device)
                window_tokens += tokens
                progress.update(1)
                if step == 1 or step % cfg.log_every == 0 or step == total_steps:
                    reduced = dist.sum_tensor(torch.cat([window.cpu().flatten(),
                                                         torch.tensor([float(window_tokens)],
                                                                      dtype=torch.float64)]))
                    summary = StepCounts.from_tensor(reduced[:-1].view(5, -1)).summary()
                    elapsed = time.monotonic() - window_started
                    entry = {"split": "train", "step": step, "epoch": epoch,
                             "lr": scheduler.get_last_lr()[0],
                             "tokens_per_s": float(reduced[-1]) / max(elapsed, 1e-9),
                             "gpu_memory_gib": gpu_memory_gib(device), **summary}
                    record(entry)
                    log.info("train step %d/%d epoch %d: loss %s full_acc %s tau %.2f lr %.2e "
                             "%.0f tokens/s%s", step, total_steps, epoch,
                             [round(summary[f"loss_{j}"], 3) for j in range(cfg.ttt_steps)],
                             [round(summary[f"full_acc_{j}"], 3) for j in range(cfg.ttt_steps)],
                             summary["tau"], entry["lr"], entry["tokens_per_s"],
                             f" {entry['gpu_memory_gib']:.1f} GiB" if device.type == "cuda"
                             else "")
                    window.zero_()
                    window_tokens = 0
                    window_started = time.monotonic()
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    save_state()
            # Validate at each epoch end, and where max_steps stops the run mid-epoch.
            epoch_end(cfg, epoch, drafter, val_rows, target_head, runtime, pad_to, dist,
                      device, state, record, plans, hidden, merged, target, out, guarded,
                      padding)
            if state["step_in_epoch"] < steps_per_epoch[epoch]:
                break
            state["epoch"], state["step_in_epoch"] = epoch + 1, 0
            save_state()
    finally:
        prefetcher.close()
        progress.close()
        if metrics_file:
            metrics_file.close()
    best = next(h for h in history if h["split"] == "validation"
                and h["epoch"] == state["best_epoch"])
    return {"steps": state["step"], "best_epoch": state["best_epoch"], "best": best,
            "history": history, "rows_trained": dist.gather_objects(trained),
            "rows_per_epoch": [len(p) for p in plans],
            # DDP: each rank's copy, equal on every rank when gradients were averaged right;
            # FSDP: the sum over the whole (sharded) weights, the same figure on every rank.
            "weight_sums": dist.gather_objects(weight_sum(trainable, dist, sharded))}


def weight_sum(params: list[torch.nn.Parameter], dist: Dist, sharded: bool) -> float:
    if not sharded:
        return sum(p.detach().double().sum().item() for p in params)
    from draftsmith.train.fsdp import local

    mine = sum(local(p).detach().double().sum().item() for p in params)
    return dist.sum_tensor(torch.tensor([mine], dtype=torch.float64)).item()  # [1] summed


def epoch_end(cfg, epoch, drafter, val_rows, target_head, runtime, pad_to, dist, device, state,
              record, plans, hidden, merged, target, out, guarded, padding) -> None:
    """Validation (every rank its share, counts summed), then the best drafter by tau."""
    counts = guarded(lambda: evaluate(drafter, val_rows, target_head, cfg, runtime.attention,
                                      pad_to, device, padding))
    val = StepCounts.from_flat(dist.sum_tensor(counts.flat()), cfg.ttt_steps).summary()
    efficiency = packing_efficiency(plans[min(epoch, len(plans) - 1)], cfg.batch_tokens)
    record({"split": "validation", "step": state["step"], "epoch": epoch,
            "packing_efficiency": efficiency, **val})
    log.info("validation after epoch %d: tau %.3f, acceptance replayed %.3f, full_acc %s, "
             "cond_acc %s; packing %.1f%%", epoch, val["tau"],
             val.get("acceptance_replayed", float("nan")),
             [round(val[f"full_acc_{j}"], 3) for j in range(cfg.ttt_steps)],
             [round(val[f"cond_acc_{j}"], 3) for j in range(cfg.ttt_steps)], 100 * efficiency)
    if val["tau"] > state["best_tau"]:  # the same tau on every rank: they all come in here
        state["best_tau"], state["best_epoch"] = val["tau"], epoch
        tensors = None
        if cfg.parallel == "fsdp":  # gathered whole: a collective every rank joins
            from draftsmith.export.native import NOT_STORED
            from draftsmith.train.fsdp import full_state

            tensors = full_state(drafter, torch.bfloat16 if cfg.dtype == "bfloat16"
                                 else torch.float32, skip=NOT_STORED)
        if dist.is_main:
            from draftsmith.export.native import save_native

            save_native(drafter, out, tensors=tensors, provenance={
                "target_fingerprint": target.fingerprint, "target_path": target.path,
                "hidden_states": hidden.fingerprint, "data": merged.fingerprint,
                "train_config": cfg.model_dump(), "epoch": epoch, "step": state["step"],
                "validation": val,
            })


@torch.no_grad()
def evaluate(drafter, rows: list[list[Sample] | None], head: TargetHead, cfg: TrainConfig,
             attention: str, pad_to: int | None, device,
             padding: Callable[[], PackedRow] | None = None) -> StepCounts:
    """Counts over `rows`; a None row (FSDP: this rank has fewer rows than another) runs
    `padding()` so the rank joins the collectives, and counts nothing."""
    drafter.eval()
    counts = StepCounts(cfg.ttt_steps)
    for samples in rows:
        if samples is None and padding is None:
            continue
        row = padding() if samples is None else concat_row(samples, cfg.batch_tokens, pad_to)
        _, row_counts, runs = row_loss_on_device(drafter, row, head, cfg.ttt_steps,
                                                 step_weights_of(cfg), device, attention,
                                                 with_runs=True)
        if samples is not None:
            counts.add(StepCounts.from_tensor(row_counts))
            rounds, tokens = replay_chain_decoding(runs.cpu(), row.loss_mask, row.document_ids)
            counts.replay_rounds += rounds
            counts.replay_tokens += tokens
    drafter.train()
    return counts


def gpu_memory_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- the stage


def run_train(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
              plan: StagePlan) -> Descriptor:
    """Train in this process, or under torchrun with cfg.nproc_per_node processes (always
    under torchrun with train.parallel=fsdp, which shards over a process group even of one). A
    partial directory from a killed attempt is resumed from its last checkpoint, not started
    over."""
    if plan.is_complete():
        raise RuntimeError(f"{plan.dir} is already complete; refusing to overwrite it")
    out = plan.dir
    if out.exists() and not (out / RESUME_DIR / STATE_FILE).is_file():
        import shutil

        shutil.rmtree(out)  # a crashed attempt with nothing to resume from
    out.mkdir(parents=True, exist_ok=True)
    if cfg.nproc_per_node > 1 or cfg.parallel == "fsdp":
        from draftsmith.train.launch import run_torchrun

        result = run_torchrun(cfg, hidden, merged, target, out)
    else:
        result = train_loop(cfg, hidden, merged, target, out, Dist.single())
    from draftsmith.train.charts import plot_metrics

    plot_metrics(result["history"], cfg.ttt_steps, out)
    import shutil

    shutil.rmtree(out / RESUME_DIR, ignore_errors=True)  # finished: nothing left to resume
    best = result["best"]
    log.info("train: best epoch %d, validation tau %.3f, acceptance replayed %.3f",
             result["best_epoch"], best["tau"], best.get("acceptance_replayed", float("nan")))
    return finish_stage(
        plan,
        counts={"steps": result["steps"], "epochs": result["best_epoch"] + 1},
        figures={k: round(v, 4) for k, v in best.items() if k not in ("split", "step", "epoch")},
    )
