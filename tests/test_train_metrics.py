"""Training metrics (counts -> accuracies and tau), packing, and the per-row TTT loss mask."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from draftsmith.data.vocab import build_vocab_map
from draftsmith.extract.store import Sample
from draftsmith.model.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.train.metrics import StepCounts, count_step
from draftsmith.train.packing import PackedRow, pack
from draftsmith.train.trainer import row_loss

B = torch.tensor  # short for the hand-written boolean rows below


def hand_counts() -> StepCounts:
    """6 positions, the last one not loss-masked; 3 steps."""
    mask = B([1, 1, 1, 1, 1, 0]).bool()
    right = [B([1, 1, 1, 0, 1, 1]).bool(),
             B([1, 0, 1, 1, 1, 1]).bool(),
             B([0, 0, 1, 1, 1, 1]).bool()]
    counts = StepCounts(3)
    chain = torch.ones(6, dtype=torch.bool)
    for j, (r, loss) in enumerate(zip(right, (2.0, 3.0, 1.5), strict=True)):
        prefix, chain = chain, chain & r
        count_step(counts, j, torch.tensor(loss), 4, mask, chain, prefix)
    return counts


def test_step_counts_summary_hand_computed():
    counts = hand_counts()
    # chain after step 0: masked right at 0,1,2,4 -> 4 of 5
    # chain after step 1: 0,2,4 -> 3 of 5, and 3 of the 4 right so far
    # chain after step 2: 2,4 -> 2 of 5, and 2 of the 3 right so far
    assert counts.positions.tolist() == [5, 5, 5]
    assert counts.chain_correct.tolist() == [4, 3, 2]
    assert counts.prefix_correct.tolist() == [5, 4, 3]
    s = counts.summary()
    assert s["full_acc_0"] == pytest.approx(0.8)
    assert s["full_acc_1"] == pytest.approx(0.6)
    assert s["full_acc_2"] == pytest.approx(0.4)
    assert s["cond_acc_0"] == pytest.approx(0.8)
    assert s["cond_acc_1"] == pytest.approx(0.75)
    assert s["cond_acc_2"] == pytest.approx(2 / 3)
    assert s["loss_0"] == pytest.approx(0.5)
    assert s["loss_1"] == pytest.approx(0.75)
    assert s["loss_2"] == pytest.approx(0.375)
    assert s["tau"] == pytest.approx(1 + 0.8 + 0.6 + 0.4)


def test_step_counts_add_up_before_dividing():
    total = StepCounts(3)
    total.add(hand_counts())
    total.add(hand_counts())
    empty = StepCounts(3)
    total.add(empty)
    s, one = total.summary(), hand_counts().summary()
    assert total.positions.tolist() == [10, 10, 10]
    assert s == pytest.approx(one)  # ratios of summed counts, not sums of ratios
    assert torch.equal(total.as_tensor(), 2 * hand_counts().as_tensor())


def test_step_counts_without_positions_give_zero_not_nan():
    s = StepCounts(2).summary()
    assert s == {"loss_0": 0.0, "full_acc_0": 0.0, "cond_acc_0": 0.0, "loss_1": 0.0,
                 "full_acc_1": 0.0, "cond_acc_1": 0.0, "tau": 1.0}


# --------------------------------------------------------------------------- packing


def numbered_sample(i: int, n: int) -> Sample:
    """Tokens and states that say which sample and which position they come from."""
    pos = torch.arange(n)
    return Sample(
        id=f"s{i}",
        input_ids=1000 * i + pos,
        loss_mask=(pos % 2).to(torch.uint8),
        aux=(1000 * i + pos).float()[:, None].repeat(1, 6),
        final=(1000 * i + pos).float()[:, None].repeat(1, 2),
    )


def test_packing_keeps_samples_whole_and_restarts_positions():
    lengths = [5, 3, 7, 2, 4, 1]
    samples = [numbered_sample(i, n) for i, n in enumerate(lengths)]
    rows = pack(samples, row_tokens=8)
    # first fit: [5, 3] [7, 1] [2, 4]
    assert [r.num_tokens for r in rows] == [8, 8, 6]
    seen = {}
    for r, row in enumerate(rows):
        assert row.num_tokens <= 8
        assert row.loss_mask.dtype == torch.bool
        for doc in row.document_ids.unique().tolist():
            where = torch.nonzero(row.document_ids == doc).flatten()
            assert torch.equal(where, torch.arange(where[0], where[-1] + 1))  # contiguous
            tokens = row.input_ids[where]
            i = int(tokens[0]) // 1000
            assert i not in seen
            seen[i] = (r, doc)
            n = lengths[i]
            assert torch.equal(tokens, samples[i].input_ids)  # whole and in order
            assert torch.equal(row.position_ids[where], torch.arange(n))
            assert torch.equal(row.loss_mask[where], samples[i].loss_mask.bool())
            assert torch.equal(row.aux[where], samples[i].aux)
            assert torch.equal(row.final[where], samples[i].final)
        # document ids number the samples of the row in order
        assert row.document_ids.unique().tolist() == list(range(len(row.document_ids.unique())))
        assert torch.equal(row.document_ids, row.document_ids.sort().values)
    assert sorted(seen) == list(range(len(lengths)))
    assert seen[0] == (0, 0) and seen[1] == (0, 1) and seen[5] == (1, 1)


def test_packing_truncates_samples_longer_than_a_row():
    samples = [numbered_sample(0, 3), numbered_sample(1, 20), numbered_sample(2, 4)]
    rows = pack(samples, row_tokens=8)
    assert [r.num_tokens for r in rows] == [7, 8]
    long_row = rows[1]
    assert torch.equal(long_row.input_ids, samples[1].input_ids[:8])
    assert torch.equal(long_row.position_ids, torch.arange(8))
    assert torch.equal(long_row.document_ids, torch.zeros(8, dtype=long_row.document_ids.dtype))
    assert torch.equal(long_row.aux, samples[1].aux[:8])
    assert torch.equal(rows[0].document_ids, B([0, 0, 0, 1, 1, 1, 1]))
    assert torch.equal(rows[0].position_ids, B([0, 1, 2, 0, 1, 2, 3]))


def test_packing_packs_many_samples_per_row():
    samples = [numbered_sample(i, 4) for i in range(16)]
    rows = pack(samples, row_tokens=32)
    assert len(rows) == 2 and all(r.num_tokens == 32 for r in rows)
    assert rows[0].document_ids.max() == 7


# --------------------------------------------------------------------------- row_loss

AUX_IDS = [1, 3, 4]


def tiny_drafter(random_target_dir, draft_vocab: int, masked_ids: list[int]):
    torch.manual_seed(0)
    tcfg = json.loads((random_target_dir / "config.json").read_text())
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    drafter = Eagle3Drafter(Eagle3Config.from_target(tcfg, AUX_IDS, draft_vocab))
    d2t, t2d, _ = build_vocab_map(masked_ids, V, draft_vocab)
    drafter.load_target_parts(torch.randn(V, H), d2t, t2d)
    return drafter, V, H


def tiny_row(T: int, V: int, H: int, docs: list[int], loss_mask: list[int]) -> PackedRow:
    g = torch.Generator().manual_seed(1)
    docs_t = torch.tensor(docs)
    positions = torch.cat([torch.arange(int((docs_t == d).sum())) for d in docs_t.unique()])
    return PackedRow(
        input_ids=torch.randint(0, V, (T,), generator=g),
        loss_mask=torch.tensor(loss_mask).bool(),
        aux=torch.randn(T, 3 * H, generator=g),
        final=torch.randn(T, H, generator=g),
        position_ids=positions,
        document_ids=docs_t,
    )


def test_row_loss_mask_hand_count(random_target_dir):
    drafter, V, H = tiny_drafter(random_target_dir, 512, list(range(512)))  # full vocab
    row = tiny_row(7, V, H, docs=[0, 0, 0, 0, 1, 1, 1], loss_mask=[1, 1, 0, 1, 1, 0, 1])
    head = torch.randn(V, H)
    loss, counts = row_loss(drafter, row, head, steps=3, step_weights=0.8, device="cpu")
    # step j, anchor t counts when token t+j+2 exists, is loss-masked and is in t's document:
    # j=0: t=1 (token 3, doc 0), t=4 (token 6, doc 1); t=0 -> token 2 unmasked; t=2,3 -> doc 1
    # j=1: t=0 (token 3); t=1,2,3 -> tokens 4,5,6 are in doc 1
    # j=2: t=0 -> token 4 is in doc 1; t=1.. -> tokens 5, 6 are in doc 1 too
    assert counts.positions.tolist() == [2, 1, 0]
    # every target argmax is in the (full) draft vocab, so every counted position has a loss
    assert counts.loss_positions.tolist() == [2, 1, 0]
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0


def reference_row_loss(drafter, row, head, steps, decay):
    """row_loss written out position by position."""
    T = row.num_tokens
    draft_ids = drafter.draft_to_target_ids()
    target_logits = row.final @ head.T  # [T, V]
    with torch.no_grad():
        logits = drafter.forward_ttt(row.input_ids[None], row.aux[None], row.position_ids[None],
                                     row.document_ids[None], steps)
    total, positions, with_loss, chain_correct, prefix_correct = 0.0, [], [], [], []
    chain = [True] * T
    for j in range(steps):
        ce, n, counted, correct, before = 0.0, 0, 0, 0, 0
        prefix = list(chain)
        for t in range(T):
            target_pos, predicted = t + j + 1, t + j + 2
            ok = (predicted < T and bool(row.loss_mask[predicted])
                  and int(row.document_ids[predicted]) == int(row.document_ids[t]))
            if target_pos < T:
                argmax = int(target_logits[target_pos].argmax())
                guess = int(draft_ids[logits[j][0, t].argmax()])
                chain[t] = chain[t] and guess == argmax
            else:
                chain[t] = False
            if not ok:
                continue
            counted += 1
            correct += chain[t]
            before += prefix[t]
            if bool(drafter.t2d[argmax]):
                p = target_logits[target_pos, draft_ids].softmax(-1)
                ce += float(-(p * F.log_softmax(logits[j][0, t], -1)).sum())
                n += 1
        total += decay**j * ce / max(n, 1)
        positions.append(counted)
        with_loss.append(n)
        chain_correct.append(correct)
        prefix_correct.append(before)
    return total, positions, with_loss, chain_correct, prefix_correct


def test_row_loss_matches_a_position_by_position_reference(random_target_dir):
    T = 24
    docs = [0] * 9 + [1] * 6 + [2] * 9
    loss_mask = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1]
    g = torch.Generator().manual_seed(5)
    masked = torch.randint(0, 512, (2000,), generator=g).tolist()
    drafter, V, H = tiny_drafter(random_target_dir, 128, masked)  # many argmaxes out of vocab
    row = tiny_row(T, V, H, docs, loss_mask)
    head = torch.randn(V, H, generator=g)
    # Make the drafter right sometimes: point the target's final state at the position a step
    # predicts from to the drafter's guess. Anchors 0, 4, 8, ... get steps 0 and 1 right;
    # anchors 2, 6, 10, ... step 1 only (right, but not a chain a drafter would accept).
    with torch.no_grad():
        logits = drafter.forward_ttt(row.input_ids[None], row.aux[None], row.position_ids[None],
                                     row.document_ids[None], 2)
    guess = [drafter.draft_to_target_ids()[x[0].argmax(-1)] for x in logits]
    for t in range(0, T - 2, 2):
        row.final[t + 2] = 10 * head[guess[1][t]]
    for t in range(0, T - 1, 4):
        row.final[t + 1] = 10 * head[guess[0][t]]
    target_argmax = (row.final @ head.T).argmax(-1)
    assert torch.equal(target_argmax[2::2], guess[1][0:T - 2:2])
    assert torch.equal(target_argmax[1::4], guess[0][0:T - 1:4])
    loss, counts = row_loss(drafter, row, head, steps=3, step_weights=0.8, device="cpu")
    ref_loss, positions, with_loss, correct, prefix = reference_row_loss(drafter, row, head, 3,
                                                                         0.8)
    assert counts.positions.tolist() == positions
    assert counts.loss_positions.tolist() == with_loss
    assert counts.chain_correct.tolist() == correct
    assert counts.prefix_correct.tolist() == prefix
    assert with_loss[0] < positions[0]  # the "argmax in draft vocab" condition did something
    assert correct[0] > 0 and correct[1] > 0  # the accuracy counts are exercised
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
