"""The TTT loss of one packed row, and its metric counts, as the trainer and validation run it.

At TTT step j, anchor t predicts token t+j+2 (`draftsmith/model/eagle3/model.py`). A position
carries a loss when that token exists in the anchor's document, is assistant text (loss-masked) and
the target's argmax is in the draft vocab; accuracy counts every loss-masked position, since a
target token outside the draft vocab is a real miss. Targets come from the stored final hidden
states through the frozen target head (`draftsmith/train/loss.py`); lm_head is fused with the
soft cross-entropy, so no [T, draft_vocab] logits persist.
"""

from __future__ import annotations

import torch

from draftsmith.model.eagle3.model import Eagle3Drafter, shift_left
from draftsmith.train.loss import TargetHead, fused_linear_soft_ce, noisy_aux
from draftsmith.train.packing import PackedRow


def row_loss_on_device(drafter: Eagle3Drafter, row: PackedRow, head: TargetHead | torch.Tensor,
                       steps: int, step_weights: float | list[float], device: str,
                       attention: str = "sdpa", aux_noise_std: float = 0.0, noise_seed: int = 0,
                       chunk_tokens: int = 2048, with_runs: bool = False):
    """Weighted TTT loss of one packed row, and its metric counts left on the device
    ([5, steps], StepCounts.as_tensor's layout): reading them forces a sync, which the trainer
    leaves until after the step. step_weights: per-step loss weights, or a float d meaning
    d**j. aux_noise_std: Gaussian noise on the aux inputs (std relative to each position's
    RMS), seeded by noise_seed. with_runs: also return runs [T], the drafts in a row the
    target accepts at each anchor (what replay_chain_decoding walks).

    The row runs as the drafter's forward (`TargetTiedDrafter.in_forward`): under FSDP that is
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
    aux = noisy_aux(row.aux.to(device, dtype), aux_noise_std, noise_seed, device)  # [T, K*Ht]
    normed = drafter.forward_ttt_hidden(
        row.input_ids[None].to(device), aux[None], row.position_ids[None].to(device),
        row.document_ids[None].to(device), steps, attention, row.documents,
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
