"""The DFlash loss of one packed row, and its metric counts: the same rows (store or online),
targets and counts as EAGLE-3's (`draftsmith/model/eagle3/loss.py`), over anchored blocks.

An anchor a is a position whose token is known: its block is [x_a, MASK, ..., MASK] at positions
a..a+B-1, and block position k predicts token a+k (speculators 0.9.0's anchored blocks; vLLM
drafts from the last accepted token the same way). Anchors are the positions whose next token
is assistant text of the same document; training samples up to drafter.dflash.max_anchors of
them per row (seeded by the step, so a resumed run samples the same), validation runs them all,
max_anchors at a time. Position k carries a loss where token a+k exists in the anchor's
document, is loss-masked and the target's argmax is in the draft vocab: soft cross-entropy
against the target's distribution of token a+k (restricted to the draft vocab), weighted by
exp(-(k-1)/gamma) and averaged over its anchors, lm_head fused with it as for EAGLE-3.

Counts are EAGLE-3's with block position k in the place of TTT step k-1: full_acc_{k-1} is the
share of anchors whose drafts 1..k were all the target's argmax, which is what greedy decoding
accepts; runs (validation) are the drafts accepted in a row at each anchor, laid out as
replay_chain_decoding reads them (index p: the round whose last known token is p + 1).
"""

from __future__ import annotations

import torch

from draftsmith.model.dflash.model import DFlashDrafter
from draftsmith.train.loss import TargetHead, fused_linear_soft_ce, noisy_aux
from draftsmith.train.packing import PackedRow


def block_row_loss_on_device(drafter: DFlashDrafter, row: PackedRow,
                             head: TargetHead | torch.Tensor, steps: int,
                             step_weights: list[float], device: str, attention: str = "sdpa",
                             aux_noise_std: float = 0.0, noise_seed: int = 0,
                             chunk_tokens: int = 2048, with_runs: bool = False,
                             max_anchors: int = 512, pad_anchors: bool = False):
    """Weighted block loss of one packed row and its counts [5, steps] on the device (steps =
    block_size - 1 drafted positions; step_weights one per position). with_runs: every anchor
    (validation), and runs [T] too. pad_anchors: always max_anchors blocks (static shapes for
    compiled attention), the extra ones carrying no loss."""
    if isinstance(head, torch.Tensor):
        head = TargetHead(head, drafter.draft_to_target_ids(), torch.float32, device)
    return drafter.in_forward(_block_row_loss, row, head, steps, step_weights, device,
                              attention, aux_noise_std, noise_seed, chunk_tokens, with_runs,
                              max_anchors, pad_anchors)


def anchors_of(row: PackedRow, device) -> torch.Tensor:
    """Positions a whose next token is assistant text of the same document: [N] ascending."""
    docs = row.document_ids.to(device)
    mask = row.loss_mask.to(device).bool()
    follows = mask[1:] & (docs[1:] == docs[:-1]) & (docs[:-1] >= 0)  # [T-1]
    return torch.nonzero(follows).flatten()  # [N]


def _block_row_loss(drafter: DFlashDrafter, row: PackedRow, head: TargetHead, steps: int,
                    step_weights: list[float], device: str, attention: str,
                    aux_noise_std: float, noise_seed: int, chunk_tokens: int, with_runs: bool,
                    max_anchors: int, pad_anchors: bool):
    B = drafter.config.block_size
    if steps != B - 1:
        raise ValueError(f"a DFlash drafter with block_size {B} drafts {B - 1} positions, not "
                         f"{steps}")
    dtype = drafter.fc.weight.dtype  # the compute dtype
    probs, target_arg = head.targets(row.final.to(device), row.target_argmax,
                                     compiled=drafter.compiled)  # [T, D], [T] draft ids or -1
    aux = noisy_aux(row.aux.to(device, dtype), aux_noise_std, noise_seed, device)  # [T, K*Ht]
    T = row.num_tokens
    docs = row.document_ids.to(device)
    loss_mask = row.loss_mask.to(device).bool()
    in_vocab = target_arg >= 0  # [T]
    candidates = anchors_of(row, device)  # [N]
    if with_runs:
        chunks = list(candidates.split(max_anchors)) or [candidates]
    else:
        g = torch.Generator(device="cpu").manual_seed(noise_seed)
        keep = torch.randperm(candidates.numel(), generator=g)[:max_anchors]
        chunks = [candidates[keep.to(device).sort().values]]
    position_ids = row.position_ids.to(device)
    kv = drafter.row_context_kv(aux, position_ids)  # once a row, for every chunk of anchors
    total = torch.zeros((), device=device)
    counts = torch.zeros(5, steps, dtype=torch.float64, device=device)  # [5, steps]
    runs = torch.zeros(T, dtype=torch.long, device=device)  # [T]
    for anchors in chunks:
        real = anchors.numel()
        # Padding blocks at 0, masked out below: up to max_anchors for static shapes, and one
        # for a row without anchors (a padding row), which still runs every layer (FSDP).
        padded = max_anchors if pad_anchors else max(real, 1)
        if real < padded:
            anchors = torch.cat([anchors, anchors.new_zeros(padded - real)])
        normed = drafter.forward_blocks(row.input_ids.to(device), aux, position_ids, docs,
                                        anchors, attention, kv)  # [A, B, H]
        is_real = torch.arange(anchors.numel(), device=device) < real  # [A]
        chain_right = torch.ones_like(is_real)  # [A]
        run = torch.zeros(anchors.numel(), dtype=torch.long, device=device)  # [A]
        for k in range(1, B):
            index = (anchors + k).clamp(max=T - 1)  # [A] token a+k
            exists = (anchors + k < T) & is_real
            mask = exists & loss_mask[index] & (docs[index] == docs[anchors])  # [A]
            with_loss = mask & in_vocab[index - 1]  # the target's distribution of token a+k
            n_loss = with_loss.sum()
            weights = with_loss.float() * (step_weights[k - 1] / n_loss.clamp(min=1))  # [A]
            loss, ce, guess = fused_linear_soft_ce(normed[:, k], drafter.lm_head.weight,
                                                   probs[index - 1], weights, chunk_tokens,
                                                   compiled=drafter.compiled)
            total = total + loss
            right = guess == target_arg[index - 1]  # [A]
            prefix_right = chain_right
            chain_right = chain_right & right
            run += chain_right & exists
            counts[:, k - 1] += torch.stack([
                (ce.double() * with_loss).sum(), n_loss.double(), mask.sum().double(),
                (mask & chain_right).sum().double(), (mask & prefix_right).sum().double()])
        if with_runs:  # the round at anchor a is replay's index a - 1
            placed, placed_runs = anchors[:real], run[:real]
            runs[placed[placed > 0] - 1] = placed_runs[placed > 0]
    if with_runs:
        return total, counts, runs  # [5, steps], [T]
    return total, counts  # [5, steps]
