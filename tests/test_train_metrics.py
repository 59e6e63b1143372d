"""Training metrics (counts -> accuracies and tau), packing, and the per-row TTT loss mask."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from draftsmith.data.vocab import build_vocab_map
from draftsmith.extract.store import Sample
from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter
from draftsmith.train.metrics import StepCounts
from draftsmith.train.packing import PackedRow
from tests.engine_helpers import count_step, forward_ttt, pack, row_loss

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
    # What ranks all-reduce: every count, the replay's included, in one vector and back.
    total.replay_rounds, total.replay_tokens = 4.0, 11.0
    back = StepCounts.from_flat(2 * total.flat(), 3)
    assert torch.equal(back.as_tensor(), 2 * total.as_tensor())
    assert (back.replay_rounds, back.replay_tokens) == (8.0, 22.0)
    assert back.summary()["acceptance_replayed"] == pytest.approx(11 / 4)


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


def test_a_row_built_padded_in_one_copy_is_the_row_then_padding():
    """What the prefetch thread builds (concat and pad in one copy, with the target argmax):
    the unpadded row, then padding that is its own document (-1) of zeros with no loss."""
    from dataclasses import replace

    from draftsmith.train.packing import concat_row

    samples = [replace(numbered_sample(i, n), target_argmax=torch.arange(n, dtype=torch.int32))
               for i, n in enumerate([5, 3, 20])]
    direct = concat_row(samples, row_tokens=8, pad_to=24)
    unpadded = concat_row(samples, row_tokens=8)
    assert direct.num_tokens == 24 and unpadded.num_tokens == 16
    for name in ("input_ids", "loss_mask", "aux", "final", "position_ids", "document_ids",
                 "target_argmax"):
        assert torch.equal(getattr(direct, name)[:16], getattr(unpadded, name)), name
        if name != "document_ids":
            assert not getattr(direct, name)[16:].any(), name
    assert direct.document_ids[16:].eq(-1).all() and not direct.loss_mask[16:].any()
    with pytest.raises(ValueError, match="longer than the pad length"):
        concat_row(samples, row_tokens=8, pad_to=10)


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
    # The trainer sums counts across steps on the device: they must hold no autograd graph.
    from draftsmith.model.eagle3.loss import row_loss_on_device

    _, on_device = row_loss_on_device(drafter, row, head, 3, 0.8, "cpu")
    assert not on_device.requires_grad


def reference_row_loss(drafter, row, head, steps, decay):
    """row_loss written out position by position."""
    T = row.num_tokens
    draft_ids = drafter.draft_to_target_ids()
    target_logits = row.final @ head.T  # [T, V]
    with torch.no_grad():
        logits = forward_ttt(drafter, row.input_ids[None], row.aux[None], row.position_ids[None],
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


@pytest.mark.parametrize("stored_argmax", [False, True], ids=["computed", "stored"])
def test_row_loss_matches_a_position_by_position_reference(random_target_dir, stored_argmax):
    """stored_argmax: the target's argmax comes with the row (extraction stores it) instead of
    from the full-vocab head; the loss and every count must be the same."""
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
        logits = forward_ttt(drafter, row.input_ids[None], row.aux[None], row.position_ids[None],
                                     row.document_ids[None], 2)
    guess = [drafter.draft_to_target_ids()[x[0].argmax(-1)] for x in logits]
    for t in range(0, T - 2, 2):
        row.final[t + 2] = 10 * head[guess[1][t]]
    for t in range(0, T - 1, 4):
        row.final[t + 1] = 10 * head[guess[0][t]]
    target_argmax = (row.final @ head.T).argmax(-1)
    assert torch.equal(target_argmax[2::2], guess[1][0:T - 2:2])
    assert torch.equal(target_argmax[1::4], guess[0][0:T - 1:4])
    if stored_argmax:
        row.target_argmax = target_argmax.to(torch.int32)
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
    if stored_argmax:  # the stored argmax is what decides: all outside the draft vocab
        outside = int((~drafter.t2d).nonzero()[0])
        row.target_argmax = torch.full((T,), outside, dtype=torch.int32)
        _, counts = row_loss(drafter, row, head, steps=3, step_weights=0.8, device="cpu")
        assert counts.loss_positions.tolist() == [0, 0, 0]
        assert counts.chain_correct.tolist() == [0, 0, 0]


# --------------------------------------------------------------------------- loss pieces


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_linear_soft_ce_matches_autograd_of_the_plain_formula(compiled):
    """compiled: the per-chunk math through torch.compile, as CUDA training runs it."""
    from draftsmith.train.loss import fused_linear_soft_ce

    g = torch.Generator().manual_seed(0)
    T, H, D = 11, 8, 13
    x = torch.randn(T, H, generator=g, requires_grad=True)
    w = torch.randn(D, H, generator=g, requires_grad=True)
    probs = torch.randn(T, D, generator=g).softmax(-1)
    weights = torch.rand(T, generator=g) * (torch.arange(T) % 3 != 0)  # some positions 0

    plain = (-(probs * F.log_softmax(x @ w.T, -1)).sum(-1) * weights).sum()
    gx, gw = torch.autograd.grad(plain, (x, w))
    loss, ce, argmax = fused_linear_soft_ce(x, w, probs, weights, chunk=4,
                                            compiled=compiled)  # uneven chunks
    torch.testing.assert_close(loss, plain)
    fx, fw = torch.autograd.grad(2.5 * loss, (x, w))  # the upstream gradient is applied
    torch.testing.assert_close(fx, 2.5 * gx)
    torch.testing.assert_close(fw, 2.5 * gw)
    torch.testing.assert_close(ce, -(probs * F.log_softmax(x @ w.T, -1)).sum(-1).detach())
    assert torch.equal(argmax, (x @ w.T).argmax(-1))
    assert not ce.requires_grad and not argmax.requires_grad  # metrics hold no graph

    frozen = w.detach()  # a frozen lm_head: gradient for x only
    loss, _, _ = fused_linear_soft_ce(x, frozen, probs, weights, chunk=4, compiled=compiled)
    (fx,) = torch.autograd.grad(loss, (x,))
    torch.testing.assert_close(fx, gx)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_target_head_in_chunks_matches_the_full_vocab_distribution(compiled):
    from draftsmith.train.loss import TargetHead

    g = torch.Generator().manual_seed(1)
    V, H, D, T = 50, 6, 12, 23
    head = torch.randn(V, H, generator=g)
    draft_ids = torch.randperm(V, generator=g)[:D].sort().values
    final = torch.randn(T, H, generator=g)
    outside = [i for i in range(V) if i not in set(draft_ids.tolist())][0]
    head[draft_ids[3]] = 100 * torch.eye(H)[0]  # orthogonal rows far above the rest
    head[outside] = 100 * torch.eye(H)[1]
    final[:5] = head[draft_ids[3]]  # argmax surely in the draft vocab
    final[5:9] = head[outside]  # argmax surely outside it
    target_head = TargetHead(head, draft_ids, torch.float32, "cpu", chunk_tokens=5)
    probs, argmax = target_head.targets(final, compiled=compiled)
    full = final @ head.T  # [T, V]
    torch.testing.assert_close(probs, full[:, draft_ids].softmax(-1))
    position = {int(t): i for i, t in enumerate(draft_ids)}
    want = torch.tensor([position.get(int(a), -1) for a in full.argmax(-1)])
    assert torch.equal(argmax, want)
    assert (argmax[:5] == 3).all() and (argmax[5:9] == -1).all()
    # With the argmax stored by extraction: the same distribution and draft ids.
    stored_probs, stored = target_head.targets(final, full.argmax(-1).int(), compiled=compiled)
    torch.testing.assert_close(stored_probs, probs)
    assert torch.equal(stored, want)


def test_padding_a_row_changes_no_loss_and_no_count(random_target_dir):
    from draftsmith.train.packing import concat_row

    drafter, V, H = tiny_drafter(random_target_dir, 128, list(range(0, 512, 3)))
    row = tiny_row(12, V, H, docs=[0] * 5 + [1] * 7, loss_mask=[0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    samples = [Sample(str(d), row.input_ids[a:b], row.loss_mask[a:b].to(torch.uint8),
                      row.aux[a:b], row.final[a:b]) for d, (a, b) in enumerate([(0, 5), (5, 12)])]
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(3))
    loss, counts = row_loss(drafter, row, head, steps=3, step_weights=0.8, device="cpu")
    padded = concat_row(samples, 12, pad_to=20)  # the same row, padded as the trainer pads
    assert padded.num_tokens == 20 and (padded.document_ids[12:] == -1).all()
    loss_p, counts_p = row_loss(drafter, padded, head, steps=3, step_weights=0.8, device="cpu")
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts_p.as_tensor()[1:], counts.as_tensor()[1:])
    torch.testing.assert_close(counts_p.loss_sum, counts.loss_sum)


def test_step_weights_select_steps_and_aux_noise_is_seeded(random_target_dir):
    drafter, V, H = tiny_drafter(random_target_dir, 512, list(range(512)))
    row = tiny_row(16, V, H, docs=[0] * 16, loss_mask=[1] * 16)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(4))
    _, counts = row_loss(drafter, row, head, 3, [1.0, 1.0, 1.0], "cpu")
    per_step = counts.summary()
    only_1, _ = row_loss(drafter, row, head, 3, [0.0, 1.0, 0.0], "cpu")
    assert only_1.item() == pytest.approx(per_step["loss_1"], rel=1e-5)
    mixed, _ = row_loss(drafter, row, head, 3, [0.5, 0.0, 2.0], "cpu")
    assert mixed.item() == pytest.approx(0.5 * per_step["loss_0"] + 2 * per_step["loss_2"],
                                         rel=1e-5)

    base, _ = row_loss(drafter, row, head, 3, 0.8, "cpu")
    a, _ = row_loss(drafter, row, head, 3, 0.8, "cpu", aux_noise_std=0.5, noise_seed=7)
    b, _ = row_loss(drafter, row, head, 3, 0.8, "cpu", aux_noise_std=0.5, noise_seed=7)
    c, _ = row_loss(drafter, row, head, 3, 0.8, "cpu", aux_noise_std=0.5, noise_seed=8)
    assert a.item() == b.item()  # the same row and seed: the same noise (resume relies on it)
    assert a.item() != c.item() and a.item() != base.item()


# --------------------------------------------------------------------------- optimiser


def test_master_weights_keep_updates_bf16_would_round_away():
    from draftsmith.train.optim import MasterWeightAdamW

    def run(master: bool) -> torch.Tensor:
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        if master:
            opt = MasterWeightAdamW([p], lr=1e-3, weight_decay=0.0)
        else:
            opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0)
        for _ in range(20):
            p.grad = torch.full_like(p, -1.0)  # each step moves +1e-3; bf16 spacing at 1 is 2^-7
            if master:
                opt.step(grad_clip=10.0)
            else:
                opt.step()
                p.grad = None
        return p.detach().float()

    assert torch.equal(run(master=False), torch.ones(4))  # plain bf16 AdamW never moves
    assert torch.allclose(run(master=True), torch.full((4,), 1.02), atol=2 ** -7)


def test_master_weight_optimizer_state_round_trips():
    from draftsmith.train.optim import MasterWeightAdamW

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(3, 5).bfloat16())
        return p, MasterWeightAdamW([p], lr=1e-2, weight_decay=0.1)

    p1, o1 = make()
    for i in range(3):
        p1.grad = torch.full_like(p1, float(i + 1))
        o1.step(1.0)
    saved = o1.state_dict()
    p2, o2 = make()
    o2.load_state_dict(saved)
    assert torch.equal(p2, p1) and torch.equal(o2.master[0], o1.master[0])
    for p, o in ((p1, o1), (p2, o2)):
        p.grad = torch.full_like(p, 0.5)
        o.step(1.0)
    assert torch.equal(p1, p2) and torch.equal(o1.master[0], o2.master[0])


def test_the_single_pass_step_is_torchs_adamw_with_clipping():
    """The one-pass update the GPU runs (adamw_on_masters) against torch's AdamW after
    clip_grad_norm_ on float32 gradient copies: same masters, moments and bf16 params, with
    clipping and weight decay active; its state loads into the torch path and back."""
    import io

    from draftsmith.train.optim import MasterWeightAdamW

    def make(single_pass: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(7, 5).bfloat16()),
                  torch.nn.Parameter(torch.randn(11).bfloat16())]
        return params, MasterWeightAdamW(params, lr=1e-2, weight_decay=0.1,
                                         single_pass=single_pass)

    def step(params, opt, i, clip=0.5):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * (i + 1)).bfloat16()
        return opt.step(clip)

    (ref_p, ref), (new_p, new) = make(False), make(True)
    assert new.single_pass and not ref.single_pass
    for i in range(4):
        ref_norm, new_norm = step(ref_p, ref, i), step(new_p, new, i)
        assert ref_norm > 0.5  # clipping is active
        torch.testing.assert_close(new_norm, ref_norm, rtol=1e-6, atol=0)
    for a, b in zip(new.master, ref.master, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(new_p, ref_p, strict=True):
        assert (a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max()
    for m_new, m_ref in zip(new.master, ref.master, strict=True):
        s_new, s_ref = new.optimizer.state[m_new], ref.optimizer.state[m_ref]
        assert s_new["step"].item() == s_ref["step"].item() == 4
        torch.testing.assert_close(s_new["exp_avg_sq"], s_ref["exp_avg_sq"], rtol=1e-6,
                                   atol=1e-9)
    # A checkpoint of one path goes on in the other, as it would have gone on in its own.
    saved = io.BytesIO()
    torch.save(new.state_dict(), saved)  # as the checkpointer does: no tensor shared
    saved.seek(0)
    p2, o2 = make(False)
    o2.load_state_dict(torch.load(saved))
    step(p2, o2, 9)
    step(new_p, new, 9)
    for a, b in zip(o2.master, new.master, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("single_pass", [False, True])
def test_the_schedule_sees_each_step_whichever_path_updates(single_pass):
    """The trainer's LambdaLR steps after every optimizer step. The single pass (the GPU's
    default) updates the masters without torch's AdamW.step, which the scheduler watches: it
    must still count as a step, or torch warns on every GPU run that the schedule's first
    value was skipped. And the rate each step uses is the schedule's, from its first value."""
    import warnings

    from draftsmith.train.optim import MasterWeightAdamW, lr_factor

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5).bfloat16())]
    opt = MasterWeightAdamW(params, lr=1e-2, weight_decay=0.0, single_pass=single_pass)
    factor = lr_factor(0.5, "cosine", 4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, factor)
    rates = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any scheduler warning fails the test
        for _ in range(4):
            params[0].grad = torch.ones_like(params[0])
            rates.append(opt.optimizer.param_groups[0]["lr"])
            opt.step(1.0)
            scheduler.step()
    assert rates == pytest.approx([1e-2 * factor(i) for i in range(4)])


# --------------------------------------------------------------------------- packing plan


def test_plan_rows_is_first_fit_and_packs_a_realistic_mix_above_95_percent():
    import random

    from draftsmith.train.packing import plan_rows
    from draftsmith.train.trainer import packing_efficiency

    def first_fit_scan(samples, row_tokens):
        rows, used = [], []
        for s in samples:
            n = min(len(s.input_ids), row_tokens)
            i = next((i for i, u in enumerate(used) if u + n <= row_tokens), None)
            if i is None:
                rows.append([]), used.append(0)
                i = len(rows) - 1
            rows[i].append(s)
            used[i] += n
        return rows

    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(20, 400), rng.randint(300, 3000), rng.randint(10, 9000)])
               for _ in range(600)]
    samples = [Sample(id=str(i), input_ids=torch.zeros(n, dtype=torch.long),
                      loss_mask=torch.ones(n, dtype=torch.uint8), aux=torch.zeros(n, 1),
                      final=torch.zeros(n, 1)) for i, n in enumerate(lengths)]
    rows = plan_rows(samples, 8192)
    assert [[s.id for s in r] for r in rows] == [[s.id for s in r]
                                                 for r in first_fit_scan(samples, 8192)]
    assert sorted(s.id for r in rows for s in r) == sorted(s.id for s in samples)
    assert all(sum(min(len(s.input_ids), 8192) for s in r) <= 8192 for r in rows)
    assert packing_efficiency(rows, 8192) >= 0.95


# --------------------------------------------------------------------------- replayed decoding


def test_replayed_chain_decoding_hand_counted():
    from draftsmith.train.metrics import replay_chain_decoding

    # Document 0: prompt 0-1, answer 2-9. Document 1: prompt 10, answer 11-14. Padding 15.
    docs = torch.tensor([0] * 10 + [1] * 5 + [-1])
    mask = torch.tensor([0, 0] + [1] * 8 + [0] + [1] * 4 + [0]).bool()
    runs = torch.tensor([9, 3, 0, 0, 2, 9, 9, 1, 9, 9, 0, 2, 9, 9, 9, 9])
    # Doc 0: token 2 comes from the prompt's forward; rounds at anchors 1 (3 drafts + 1: tokens
    # 3-6), 5 (cut at the answer's end: 7-9 = 3 tokens). Runs before the answer (anchor 0) and
    # after it never count. Doc 1: token 11 from the prompt; anchor 10 (0 drafts: token 12),
    # anchor 11 (2 drafts + 1, cut to 13-14 = 2 tokens).
    assert replay_chain_decoding(runs, mask, docs) == (4, 4 + 3 + 1 + 2)


def test_replayed_acceptance_of_a_perfect_drafter_is_steps_plus_one():
    from draftsmith.train.metrics import replay_chain_decoding

    steps, T = 3, 2 + 4 * 10  # a prompt of 2, an answer of 40: 39 tokens after the first
    mask = torch.tensor([0, 0] + [1] * 40).bool()
    rounds, tokens = replay_chain_decoding(torch.full((T,), steps), mask, torch.zeros(T))
    assert tokens == 39 and rounds == 10  # 9 rounds of 4 and one cut to the 3 left
    # No draft ever right: one token per round.
    assert replay_chain_decoding(torch.zeros(T), mask, torch.zeros(T)) == (39, 39)
    # An answer with no prompt before it (the document starts with it) is not decoded.
    assert replay_chain_decoding(torch.full((5,), 2), torch.ones(5).bool(), torch.zeros(5)) \
        == (0, 0)


def test_the_merged_attention_kernels_ask_for_a_cuda_device():
    from draftsmith.config import TrainConfig
    from draftsmith.errors import ConfigValueError
    from draftsmith.train.runner import resolve_attention

    assert resolve_attention(TrainConfig(device="cpu")) == "sdpa"
    with pytest.raises(ConfigValueError, match="train.attention=cudnn.*CUDA.*train.device=cpu"):
        resolve_attention(TrainConfig(device="cpu", attention="cudnn"))
    # cuDNN's kernel returns NaN for float32 inputs: refused before a step runs.
    with pytest.raises(ConfigValueError, match="train.attention=flash.*float32.*"
                                               "train.dtype=bfloat16"):
        resolve_attention(TrainConfig(device="cuda", attention="flash"))
    assert resolve_attention(TrainConfig(device="cuda", attention="cudnn",
                                         dtype="bfloat16")) == "cudnn"
