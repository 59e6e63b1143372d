"""speculators 0.9.0's trainer on draftsmith's hidden-state store, for the side by side in
benchmarks/quality/sweep.py.

Its drafter is built as `speculators train --speculator-type eagle3` builds it, with its
defaults: EAGLE-3.1 norms (norm_before_residual, norm_before_fc, norm_output), one llama
decoder layer, flex attention and its fused kl_div loss on a GPU (SDPA and the eager loss on
a CPU), TTT 3 with no step decay. Two recipes on the same rows: `speculators` (its muon +
AdamW, lr 1e-3, linear schedule, clip 1.0) and `draftsmith` (AdamW, lr 1e-3, cosine with 2%
warm-up, clip 1.0, as draftsmith's trainer), so recipe and implementation can be told apart.

Adaptations to the data, not the method: the store keeps the target's final state after its
final norm, so `verifier_norm` is the identity; the vocab map is merge's; samples are packed
into rows of train.batch_tokens by its CollateFn after its shift_batch, in a seeded order.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("draftsmith.sweep.speculators")


def unshare_fused_loss_autotune_lists() -> list[str]:
    """speculators 0.9.0's two fused-loss Triton kernels share one autotune config list, which
    makes Dynamo (torch 2.11) fail inside its compiled forward; each gets its own copy (the
    kernels and the math are unchanged; the anchors' harness does the same)."""
    import copy

    import speculators.losses.fused as fused
    from triton.runtime.autotuner import Autotuner

    seen, changed = set(), []
    for name in sorted(vars(fused)):
        tuner = getattr(fused, name)
        if not isinstance(tuner, Autotuner):
            continue
        for attr in ("configs", "keys"):
            value = getattr(tuner, attr, None)
            if isinstance(value, list):
                if id(value) in seen:
                    setattr(tuner, attr, copy.deepcopy(value))
                    changed.append(f"{name}.{attr}")
                seen.add(id(getattr(tuner, attr)))
    return changed


def train_speculators(store: dict, size: dict, out_dir: Path, recipe: str, epochs: int,
                      plain_eagle3: bool = False, ttt_steps: int = 3) -> dict:
    """store: {"store": the extract stage's store, "merge_dir": the merge stage's output};
    size: target, device and batch_tokens. plain_eagle3: the plain EAGLE-3 that SGLang runs
    (its three norms off, SDPA and the eager loss), as smollm2_h200.py's earlier side by side
    trained it."""
    from safetensors.torch import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig, shift_batch
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import CollateFn
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from transformers import get_linear_schedule_with_warmup

    from draftsmith.config import TargetConfig
    from draftsmith.export.layer_ids import engine_layer_ids
    from draftsmith.extract.store import ShardReader
    from draftsmith.target import load_target_head_and_embedding, resolve_target
    from draftsmith.train.optim import lr_factor

    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = size["device"].startswith("cuda")
    dev = torch.device(size["device"])
    target = resolve_target(TargetConfig(model=size["target"]))
    hidden = target.figures["hidden_size"]
    reader = ShardReader(store["store"])
    vocab = load_file(str(Path(store["merge_dir"]) / "vocab_map.safetensors"))
    d2t, t2d = vocab["d2t"].long(), vocab["t2d"].bool()  # [D], [V]
    layer = create_transformer_layer_config(
        verifier_name_or_path=target.path, num_layers=1, draft_arch="llama", hidden_act="silu",
        sliding_window=2048, full_attention_indices=[], mrope_full_head_hack=True)
    layer._attn_implementation = "simple_flex_attention" if cuda and not plain_eagle3 \
        else "sdpa"
    spec_cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=int(d2t.numel()),
        norm_before_residual=not plain_eagle3, norm_before_fc=not plain_eagle3, fc_norm=False,
        norm_output=not plain_eagle3,
        embed_requires_grad=False,
        # The ids vLLM reads (inputs of layers), as draftsmith's speculators export writes them.
        eagle_aux_hidden_state_layer_ids=engine_layer_ids(reader.aux_layer_ids,
                                                          target.figures["family"], "vllm"),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(target.path)))
    model = Eagle3DraftModel(config=spec_cfg)
    model.load_vocab_mappings(t2d, d2t)
    embed, head = load_target_head_and_embedding(target)  # [V, H], [V, H]
    with torch.no_grad():  # what its load_verifier_weights copies: embed, head rows of t2d
        model.embed_tokens.weight.copy_(embed.float())
        model.lm_head.weight.copy_(head.float()[t2d])
        model.verifier_lm_head.weight.copy_(head.float()[t2d])
    model.verifier_norm = torch.nn.Identity()  # the store's final state is already normed
    for p in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
        p.requires_grad_(False)
    model.to(dev).train()

    samples = []
    for s in reader.samples("train"):
        # Copies: the store's tensors are views of memory-mapped shards, unmapped at close.
        samples.append(shift_batch({
            "hidden_states": s.aux.clone(), "input_ids": s.input_ids.clone(),
            "verifier_last_hidden_states": s.final.clone(), "loss_mask": s.loss_mask.bool(),
            "lengths": torch.tensor([len(s.input_ids)]),
            "position_ids": torch.arange(len(s.input_ids))}))
    reader.close()
    row_tokens = size["batch_tokens"]
    collate = CollateFn(row_tokens, hidden, 3, torch.bfloat16 if cuda else torch.float32)

    def rows(order: list[int]) -> list[list[dict]]:
        out, row, used = [], [], 0
        for i in order:
            n = int(samples[i]["input_ids"].numel())
            if row and used + n > row_tokens:
                out.append(row)
                row, used = [], 0
            row.append(samples[i])
            used += n
        return out + ([row] if row else [])

    generator = torch.Generator().manual_seed(0)
    epoch_rows = [rows(torch.randperm(len(samples), generator=generator).tolist())
                  for _ in range(epochs)]
    total = sum(len(r) for r in epoch_rows)
    fix = unshare_fused_loss_autotune_lists() if cuda else []
    loss_config = resolve_loss_config("kl_div", "fused" if cuda and not plain_eagle3
                                      else "eager")
    kwargs = {"ttt_steps": ttt_steps, "ttt_step_loss_decay": 1.0, "loss_config": loss_config}
    if recipe == "speculators":
        trainer_cfg = TrainerConfig(lr=1e-3, num_epochs=epochs, save_path=str(out_dir),
                                    train_call_kwargs=kwargs, val_call_kwargs=kwargs,
                                    optimizer="muon", weight_decay=0.01, muon_lr=1e-3,
                                    muon_momentum=0.95, muon_weight_decay=0.1, muon_ns_steps=5,
                                    muon_adjust_lr_fn="match_rms_adamw",
                                    scheduler_type="linear",
                                    hidden_states_dtype=torch.bfloat16, log_freq=50,
                                    max_steps=total)
        optimizers = build_optimizers(model, trainer_cfg)
        schedulers = [get_linear_schedule_with_warmup(o, num_warmup_steps=total // 100,
                                                      num_training_steps=total)
                      for o in optimizers]
    elif recipe == "draftsmith":  # draftsmith's defaults: AdamW, no weight decay, cosine
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizers = [torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)]
        schedulers = [torch.optim.lr_scheduler.LambdaLR(
            optimizers[0], lr_factor(0.02, "cosine", total))]
    else:
        raise ValueError(f"recipe {recipe!r}: speculators or draftsmith")
    losses, step, tokens = [], 0, 0
    train_started = time.monotonic()
    for epoch in epoch_rows:
        for row in epoch:
            batch = {k: v.to(dev) for k, v in collate(row).items()
                     if isinstance(v, torch.Tensor)}
            tokens += int((batch["document_ids"] != -1).sum())
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                _, loss, _metrics = model(**batch, **kwargs)
            for o in optimizers:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in optimizers:
                o.step()
            for s in schedulers:
                s.step()
            step += 1
            if step % 100 == 0 or step in (1, total):
                losses.append(round(float(loss.detach()), 4))
                log.info("speculators (%s recipe) step %d/%d: loss %.4f, %.0f tokens/s",
                         recipe, step, total, losses[-1],
                         tokens / (time.monotonic() - train_started))
    train_s = time.monotonic() - train_started
    model.eval()
    saved = out_dir / "speculators-drafter"
    model.save_pretrained(str(saved))
    imported = out_dir / "imported"
    command = [sys.executable, "-m", "draftsmith.cli", "import", str(saved), "--out",
               str(imported), "--family", target.figures["family"]]
    done = subprocess.run(command, capture_output=True, text=True)
    log.info("$ %s\n%s%s", " ".join(command), done.stdout, done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"draftsmith import failed: {done.stdout}{done.stderr}")
    return {"recipe": recipe, "steps": step, "rows_per_epoch": [len(r) for r in epoch_rows],
            "tokens": tokens, "train_s": round(train_s, 1),
            "tokens_per_s": round(tokens / max(train_s, 1e-9)), "fused_loss_fix": fix,
            "attention": layer._attn_implementation, "loss_every_100": losses,
            "saved": str(saved), "imported": str(imported),
            "import_output": done.stdout.strip()[-400:],
            "seconds": round(time.monotonic() - started, 1)}


def validation_of(native_dir: Path, store: dict, size: dict, train_cfg) -> dict:
    """The imported drafter on the store's validation split, by draftsmith's trainer code
    (same packing and counting as a draftsmith run's validation)."""
    from draftsmith.config import TargetConfig
    from draftsmith.distributed import Dist
    from draftsmith.export.native import load_native
    from draftsmith.extract.store import ShardReader
    from draftsmith.target import load_target_head_and_embedding, resolve_target
    from draftsmith.train.packing import plan_rows
    from draftsmith.train.parallel import DDP
    from draftsmith.train.trainer import row_runner

    target = resolve_target(TargetConfig(model=size["target"]))
    embed, head = load_target_head_and_embedding(target)
    drafter = load_native(native_dir, embed)
    runner = row_runner(train_cfg, drafter, head, torch.device(size["device"]),
                        DDP(Dist.single()))
    reader = ShardReader(store["store"])
    rows = plan_rows(list(reader.samples("validation")), train_cfg.batch_tokens)
    summary = runner.guarded(lambda: runner.evaluate(rows)).summary()
    reader.close()
    return {"split": "validation", "epoch": None, **summary}


def main() -> None:  # for a look at one run: python speculators_side.py STORE.json OUT recipe
    store = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(train_speculators(store, json.loads(sys.argv[4]), Path(sys.argv[2]),
                                       sys.argv[3], 1), indent=1))


if __name__ == "__main__":
    main()
