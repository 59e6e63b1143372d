"""Stage `train`: fit the EAGLE-3 drafter to the target's distribution with test-time training.

Targets come from the stored final hidden states: softmax(lm_head(final_norm(h))) over the
full vocab, restricted to the draft vocab and renormalised. A position carries a loss when its
token is loss-masked (assistant text) and the target's argmax is in the draft vocab; accuracy
counts every loss-masked position, since a target token outside the draft vocab is a real miss.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, stage_output
from draftsmith.config import TrainConfig
from draftsmith.data.merge import read_vocab_map
from draftsmith.extract.store import ShardReader
from draftsmith.model.eagle3 import Eagle3Config, Eagle3Drafter, shift_left
from draftsmith.progress import Progress
from draftsmith.target import load_target_head_and_embedding
from draftsmith.train.metrics import StepCounts, count_step
from draftsmith.train.packing import PackedRow, concat_row, pack, plan_rows

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def row_loss(drafter: Eagle3Drafter, row: PackedRow, target_head: torch.Tensor, steps: int,
             step_weight_decay: float, device: str,
             autocast_bf16: bool = False) -> tuple[torch.Tensor, StepCounts]:
    """Weighted TTT loss of one packed row, and its metric counts."""
    draft_ids = drafter.draft_to_target_ids()  # [D]
    with torch.no_grad():
        target_logits = row.final.to(device, torch.float32) @ target_head.T  # [T, V]
        target_argmax = target_logits.argmax(-1)  # [T]
        target_probs = target_logits[:, draft_ids].softmax(-1)  # [T, D]
        in_vocab = drafter.t2d[target_argmax]  # [T]
    # bf16 compute with fp32 master weights when train.dtype is bfloat16.
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                        enabled=autocast_bf16):
        all_logits = drafter.forward_ttt(
            row.input_ids[None].to(device), row.aux[None].to(device),
            row.position_ids[None].to(device), row.document_ids[None].to(device), steps,
        )  # steps x [1, T, D]
    counts = StepCounts(steps)
    docs = row.document_ids.to(device)
    loss_mask = row.loss_mask.to(device)
    chain_right = torch.ones_like(loss_mask)
    total = torch.zeros((), device=device)
    for j, logits in enumerate(all_logits):
        logits = logits[0].float()  # [T, D] step j at anchor t predicts token t+j+2
        # Token t+j+2 must exist, be in the anchor's document and be assistant text.
        same_doc = shift_left(docs[None], j + 2, fill=-1)[0] == docs  # [T]
        mask = shift_left(loss_mask[None], j + 2)[0] & same_doc  # [T]
        probs = shift_left(target_probs[None], j + 1)[0]  # [T, D] target at t+j+1
        with_loss = mask & shift_left(in_vocab[None], j + 1)[0]  # [T]
        ce = -(probs * F.log_softmax(logits, dim=-1)).sum(-1)  # [T]
        ce_sum = (ce * with_loss).sum()
        n = int(with_loss.sum())
        total = total + (step_weight_decay**j) * ce_sum / max(n, 1)
        right = draft_ids[logits.argmax(-1)] == shift_left(target_argmax[None], j + 1)[0]  # [T]
        prefix_right = chain_right
        chain_right = chain_right & right
        count_step(counts, j, ce_sum, n, mask, chain_right, prefix_right)
    return total, counts


@torch.no_grad()
def evaluate(drafter, rows, target_head, cfg: TrainConfig) -> StepCounts:
    drafter.eval()
    counts = StepCounts(cfg.ttt_steps)
    for row in rows:
        counts.add(row_loss(drafter, row, target_head, cfg.ttt_steps, cfg.step_weight_decay,
                            cfg.device, cfg.dtype == "bfloat16")[1])
    drafter.train()
    return counts


def lr_lambda(cfg: TrainConfig, total_steps: int):
    warmup = int(cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def run_train(cfg: TrainConfig, hidden: Descriptor, merged: Descriptor, target: Descriptor,
              plan: StagePlan) -> Descriptor:
    torch.manual_seed(cfg.seed)
    store = ShardReader(hidden.path)
    train_samples = list(store.samples("train"))
    val_rows = pack(list(store.samples("validation")), cfg.batch_tokens)
    embed, head = load_target_head_and_embedding(target)
    d2t, t2d = read_vocab_map(merged)
    target_config = json.loads((Path(target.path) / "config.json").read_text())
    target_config = target_config.get("text_config", target_config)
    drafter_cfg = Eagle3Config.from_target(target_config, store.aux_layer_ids, d2t.numel())
    drafter = Eagle3Drafter(drafter_cfg)
    drafter.load_target_parts(embed, d2t, t2d, head if cfg.lm_head_init == "target" else None)
    drafter.to(cfg.device)
    target_head = head.to(cfg.device, torch.float32)

    # Row plans for every epoch up front (the step count sets the schedule); each row's
    # tensors are concatenated only when it is trained on.
    rng = random.Random(cfg.seed)
    epochs = []
    for _ in range(cfg.epochs):
        order = train_samples[:]
        rng.shuffle(order)
        epochs.append(plan_rows(order, cfg.batch_tokens))
    total_steps = sum(len(e) for e in epochs)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    log.info("train: %d samples (%d tokens) in %d rows/epoch x %d epochs = %d steps; "
             "%d validation rows; %.2fM trainable parameters", len(train_samples),
             store.num_tokens("train"), len(epochs[0]), cfg.epochs, total_steps, len(val_rows),
             sum(p.numel() for p in trainable) / 1e6)

    best_tau, best_epoch, history = -1.0, -1, []
    step = 0
    with stage_output(plan) as out, open(out / METRICS_FILE, "w", buffering=1) as metrics_file:
        def record(entry: dict) -> None:
            metrics_file.write(json.dumps(entry) + "\n")
            history.append(entry)

        progress = Progress("train", total=total_steps, unit="step")
        window, window_tokens, window_started = StepCounts(cfg.ttt_steps), 0, time.monotonic()
        for epoch, row_plans in enumerate(epochs):
            for row_samples in row_plans:
                if step >= total_steps:
                    break
                row = concat_row(row_samples, cfg.batch_tokens)
                loss, counts = row_loss(drafter, row, target_head, cfg.ttt_steps,
                                        cfg.step_weight_decay, cfg.device,
                                        cfg.dtype == "bfloat16")
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                window.add(counts)
                window_tokens += row.num_tokens
                if step % cfg.log_every == 0 or step == total_steps:
                    elapsed = time.monotonic() - window_started
                    summary = window.summary()
                    record({"split": "train", "step": step, "epoch": epoch,
                            "lr": scheduler.get_last_lr()[0],
                            "tokens_per_s": window_tokens / max(elapsed, 1e-9), **summary})
                    log.info("train step %d/%d epoch %d: loss_0 %.3f full_acc_0 %.3f tau %.2f "
                             "lr %.2e", step, total_steps, epoch, summary["loss_0"],
                             summary["full_acc_0"], summary["tau"], scheduler.get_last_lr()[0])
                    window, window_tokens = StepCounts(cfg.ttt_steps), 0
                    window_started = time.monotonic()
                progress.update(1)
            val = evaluate(drafter, val_rows, target_head, cfg).summary()
            record({"split": "validation", "step": step, "epoch": epoch, **val})
            log.info("validation after epoch %d: tau %.3f, full_acc %s", epoch, val["tau"],
                     [round(val[f"full_acc_{j}"], 3) for j in range(cfg.ttt_steps)])
            if val["tau"] > best_tau:
                from draftsmith.export.native import save_native

                best_tau, best_epoch = val["tau"], epoch
                save_native(drafter, out, {
                    "target_fingerprint": target.fingerprint, "target_path": target.path,
                    "hidden_states": hidden.fingerprint, "data": merged.fingerprint,
                    "train_config": cfg.model_dump(), "epoch": epoch, "step": step,
                    "validation": val,
                })
            if step >= total_steps:
                break
        progress.close()
        from draftsmith.train.charts import plot_metrics

        plot_metrics(history, cfg.ttt_steps, out)
    best = next(h for h in history if h["split"] == "validation" and h["epoch"] == best_epoch)
    log.info("train: best epoch %d, validation tau %.3f", best_epoch, best_tau)
    return finish_stage(
        plan,
        counts={"steps": step, "epochs": best_epoch + 1},
        figures={k: round(v, 4) for k, v in best.items() if k not in ("split", "step", "epoch")},
    )
