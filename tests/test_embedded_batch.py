"""Batched decoding in the embedded engine: every row of a batch is what decoding its prompt
alone gives, token for token and round for round, whatever the other rows do (their prompts'
lengths, their acceptance, when they stop), over the dynamic and the static target cache, for
EAGLE-3, EAGLE-3.1 with a sliding window and DFlash."""

from __future__ import annotations

import time

import pytest
import torch

from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, Sampling, plain_generate
from draftsmith.serve.embedded_batch import (
    BatchedSpeculativeDecoder,
    BatchTarget,
    Slots,
    plain_generate_batch,
)
from tests.test_dflash import BLOCK
from tests.test_embedded import (  # noqa: F401 (fixtures)
    NUM_STEPS,
    dflash_drafter_dir,
    drafted_rounds,
    drafter,
    eagle31_drafter,
    exported_drafter,
    oracle,
    target_model,
)

TEXTS = ["def add(a, b):\n", "Complete this function from os.py:\nclass Foo:", "x = [1, 2, 3]",
         "Explain what a list comprehension is, in two sentences.", "hi"]


@pytest.fixture(scope="module")
def prompts(random_target_tokenizer):
    ids = [random_target_tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in ids}) == len(ids)  # every row pads differently
    return ids


@pytest.fixture(scope="module", params=["eagle3", "eagle3.1", "dflash"])
def drafter_dir(request, exported_drafter, eagle31_drafter, dflash_drafter_dir):  # noqa: F811
    return {"eagle3": exported_drafter, "eagle3.1": eagle31_drafter[1],
            "dflash": dflash_drafter_dir}[request.param], request.param


def loaded(target_model, drafter_dir, cache: str) -> EmbeddedSpeculativeEngine:  # noqa: F811
    path, kind = drafter_dir
    return EmbeddedSpeculativeEngine.load(target_model, path,
                                          BLOCK - 1 if kind == "dflash" else NUM_STEPS,
                                          cache=cache)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_every_row_is_its_prompt_decoded_alone(target_model, drafter_dir, prompts,  # noqa: F811
                                               cache):
    engine = loaded(target_model, drafter_dir, cache)
    try:
        alone = [engine.generate(p, 24, None) for p in prompts]
        batch = BatchedSpeculativeDecoder(engine).generate(prompts, 24, None)
        for prompt, one, row in zip(prompts, alone, batch.rows, strict=True):
            assert one.tokens == plain_generate(engine.runner, prompt, 24, None).tokens
            assert row.tokens == one.tokens
            assert row.round_tokens == one.round_tokens  # the same drafts, accepted alike
        assert batch.forwards == max(len(r.round_tokens) for r in batch.rows)
    finally:
        engine.runner.close()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_plain_batched_decoding_is_plain_decoding_per_prompt(target_model, exported_drafter,  # noqa: F811
                                                             prompts, cache):
    engine = loaded(target_model, (exported_drafter, "eagle3"), cache)
    try:
        batch = plain_generate_batch(engine.runner, prompts, 17, None)
        for prompt, row in zip(prompts, batch.rows, strict=True):
            assert row.tokens == plain_generate(engine.runner, prompt, 17, None).tokens
        assert batch.forwards == 16  # one token for every row a forward, after the prompts'
    finally:
        engine.runner.close()


def row_oracle(decoder, references: list[list[int]], prompts, wrong_at: list[int | None],
               drafted: list[list[list[int]]]):
    """Wrap the batch's drafting: run it (so the drafter's cache advances as usual, and each
    running row's drafts go to drafted[row]) but propose each row's greedy continuation, wrong
    from index wrong_at[row] on."""
    real = decoder._draft

    def draft(kv, token_at, aux_at, drafted_upto, last, running, samplings, first):
        drafts, probs = real(kv, token_at, aux_at, drafted_upto, last, running, samplings,
                             first)
        for row, on in enumerate(running.tolist()):
            if on:
                drafted[row].append(drafts[row].tolist())
        truths = []
        for row, n in enumerate(last.tolist()):
            done = n + 1 - len(prompts[row])
            truth = (references[row][done:] + [0] * NUM_STEPS)[:NUM_STEPS]
            truths.append([t if wrong_at[row] is None or i < wrong_at[row] else (t + 1) % 512
                           for i, t in enumerate(truth)])
        return torch.tensor(truths, device=drafts.device), probs

    return draft


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_rows_accepting_different_counts_keep_to_their_own_tokens(
        target_model, drafter_dir, prompts, monkeypatch, cache):  # noqa: F811
    """Row r's drafts agree with its target up to index wrong_at[r]: every round each row
    keeps a different number of its verify slots, and its next anchors differ in count. The
    drafter still drafts what it drafts for the prompt alone."""
    engine = loaded(target_model, drafter_dir, cache)
    wrong_at = [None, 0, 1, 2, None]
    max_new = 22
    try:
        references = [plain_generate(engine.runner, p, max_new + NUM_STEPS, None).tokens
                      for p in prompts]
        alone = []
        real_draft, real_round = engine._draft, engine.greedy_round
        for prompt, reference, wrong in zip(prompts, references, wrong_at, strict=True):
            calls: list = []
            # what the oracle wraps
            monkeypatch.setattr(engine, "_draft", real_draft)
            monkeypatch.setattr(engine, "greedy_round", real_round)
            oracle(monkeypatch, engine, reference, prompt, wrong, calls)
            alone.append([drafts for _, drafts in drafted_rounds(
                calls, engine.generate(prompt, max_new, None))])
        decoder = BatchedSpeculativeDecoder(engine)
        drafted: list[list[list[int]]] = [[] for _ in prompts]
        monkeypatch.setattr(decoder, "_draft", row_oracle(decoder, references, prompts,
                                                          wrong_at, drafted))
        batch = decoder.generate(prompts, max_new, None)
        # A greedy batch drafts ahead: a row drafts once more than it verifies when it ends.
        assert all(len(d) - len(row.round_tokens) in (0, 1)
                   for d, row in zip(drafted, batch.rows, strict=True))
        assert [d[:len(row.round_tokens)] for d, row in zip(drafted, batch.rows,
                                                               strict=True)] == alone
        for row, reference, wrong in zip(batch.rows, references, wrong_at, strict=True):
            assert row.tokens == reference[:max_new]
            per_round = NUM_STEPS + 1 if wrong is None else wrong + 1
            assert row.round_tokens[:-1] == [per_round] * (len(row.round_tokens) - 1)
    finally:
        engine.runner.close()


def test_rows_that_stop_early_leave_the_others_as_they_were(target_model, exported_drafter,  # noqa: F811
                                                            prompts):
    """An EOS that ends one row in its first rounds and others later or never."""
    engine = loaded(target_model, (exported_drafter, "eagle3"), "static")
    try:
        reference = plain_generate(engine.runner, prompts[0], 24, None).tokens
        eos = reference[3]
        for max_new_tokens in (1, 2, 24):
            alone = [engine.generate(p, max_new_tokens, eos) for p in prompts]
            batch = BatchedSpeculativeDecoder(engine).generate(prompts, max_new_tokens, eos)
            assert [r.tokens for r in batch.rows] == [a.tokens for a in alone]
            assert [r.round_tokens for r in batch.rows] == [a.round_tokens for a in alone]
        lengths = {len(a.tokens) for a in alone}
        assert len(lengths) > 1  # rows did stop at different times
        plain = plain_generate_batch(engine.runner, prompts, 24, eos)
        assert [r.tokens for r in plain.rows] == [a.tokens for a in alone]
    finally:
        engine.runner.close()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_row_whose_first_token_ends_it_leaves_the_others_as_they_were(
        target_model, drafter_dir, prompts, cache):  # noqa: F811
    """A row that ends with the prompt's own token (its EOS) never runs a round; the rows
    beside it draft and verify round after round, with it in the batch."""
    engine = loaded(target_model, drafter_dir, cache)
    try:
        eos = plain_generate(engine.runner, prompts[1], 1, None).tokens[0]
        alone = [engine.generate(p, 16, eos) for p in prompts]
        assert alone[1].tokens == [eos] and alone[1].round_tokens == []
        assert max(len(a.tokens) for a in alone) > 8  # others go on for rounds
        batch = BatchedSpeculativeDecoder(engine).generate(prompts, 16, eos)
        assert [r.tokens for r in batch.rows] == [a.tokens for a in alone]
        assert [r.round_tokens for r in batch.rows] == [a.round_tokens for a in alone]
    finally:
        engine.runner.close()


def test_sampled_rows_draw_what_they_draw_alone(target_model, exported_drafter, prompts):  # noqa: F811
    """Each row has its own Sampling, drawn from in the order decoding alone draws."""
    engine = loaded(target_model, (exported_drafter, "eagle3"), "dynamic")
    try:
        alone = [engine.generate(p, 20, None, Sampling(0.8, seed=i))
                 for i, p in enumerate(prompts)]
        batch = BatchedSpeculativeDecoder(engine).generate(
            prompts, 20, None, [Sampling(0.8, seed=i) for i in range(len(prompts))])
        assert [r.tokens for r in batch.rows] == [a.tokens for a in alone]
        plain = plain_generate_batch(engine.runner, prompts, 20, None,
                                     [Sampling(0.8, seed=i) for i in range(len(prompts))])
        assert [r.tokens for r in plain.rows] == [
            plain_generate(engine.runner, p, 20, None, Sampling(0.8, seed=i)).tokens
            for i, p in enumerate(prompts)]
    finally:
        engine.runner.close()


def test_a_rounds_bookkeeping_is_not_counted_as_verifying(target_model, exported_drafter,  # noqa: F811
                                                           prompts, monkeypatch):
    """A batch's round splits as one prompt's does: drafting, the verify forward with its
    acceptance, and the rest (the cache's slots, the rows' tokens), so that the benchmark's
    verify figure is the target's forward. Bookkeeping made slow by a known pause must land
    outside verify."""
    pause_s = 0.05
    keep = Slots.keep

    def slow_keep(self, start, kept):
        time.sleep(pause_s)  # sleeps at least this long: a lower bound, not a timing guess
        return keep(self, start, kept)

    monkeypatch.setattr(Slots, "keep", slow_keep)
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, NUM_STEPS)
    try:
        batch = BatchedSpeculativeDecoder(engine).generate(prompts[:2], 6, None)
    finally:
        engine.runner.close()
    rest = batch.seconds - batch.prefill_seconds - batch.draft_seconds - batch.verify_seconds
    assert batch.forwards > 0 and rest >= pause_s * batch.forwards


def test_a_greedy_batch_drafts_the_next_round_before_it_reads_the_gpu(
        target_model, exported_drafter, prompts, monkeypatch):  # noqa: F811
    """A greedy batch round enqueues the next round's drafting (its anchors are on the device
    once the verify's tokens and aux states are scattered) before its one read of the GPU:
    on CUDA the drafter's launches go out while the GPU verifies. Sampled rows draw on the
    host, so there each verify is read before the next drafting."""
    engine = loaded(target_model, (exported_drafter, "eagle3"), "static")
    events: list = []
    tolist, verify = torch.Tensor.tolist, BatchTarget.forward

    def reading(tensor):
        events.append("read")
        return tolist(tensor)

    def verifying(self, ids, positions, live, last_only=False):
        if not last_only:  # the prompts' forward
            events.append("verify")
        return verify(self, ids, positions, live, last_only)

    def order(samplings) -> tuple[list, int]:
        decoder = BatchedSpeculativeDecoder(engine)
        draft = decoder._draft

        def drafting(*args, **kwargs):
            events.append("draft")
            return draft(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(decoder, "_draft", drafting)
            patch.setattr(BatchTarget, "forward", verifying)
            patch.setattr(torch.Tensor, "tolist", reading)
            events.clear()
            batch = decoder.generate(prompts, 12, None, samplings)
        return events[events.index("draft"):], batch.forwards

    try:
        greedy, rounds = order(None)
        assert rounds > 2
        assert greedy == ["draft", *["verify", "draft", "read"] * rounds]
        sampled, rounds = order([Sampling(0.8, seed=row) for row in range(len(prompts))])
        assert rounds > 2
        verifies = [i for i, e in enumerate(sampled) if e == "verify"]
        drafts = [i for i, e in enumerate(sampled) if e == "draft"]
        assert len(verifies) == rounds and len(drafts) == rounds
        for verified, next_draft in zip(verifies, drafts[1:], strict=False):
            assert "read" in sampled[verified:next_draft]
    finally:
        engine.runner.close()


def test_a_tree_drafter_is_refused_naming_the_setting(target_model, exported_drafter):  # noqa: F811
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, 3, topk=2,
                                            num_draft_tokens=6)
    try:
        with pytest.raises(ValueError, match="eagle_topk"):
            BatchedSpeculativeDecoder(engine)
    finally:
        engine.runner.close()


def test_a_query_sees_its_rows_live_keys_up_to_its_position():
    slots = Slots(rows=2, capacity=8, device="cpu")
    slots.append(torch.tensor([[0, 1, 2], [0, 0, 1]]), torch.tensor([[1, 1, 1], [0, 1, 1]],
                                                                     dtype=torch.bool))
    start = slots.append(torch.tensor([[3, 4], [2, 3]]), torch.ones(2, 2, dtype=torch.bool))
    slots.keep(start, torch.tensor([[1, 0], [1, 1]], dtype=torch.bool))  # row 0's 4 rejected
    mask = slots.mask(torch.tensor([[4], [3]]), slots.capacity)[:, 0, 0]  # [B, C]
    assert mask[0].tolist() == [True, True, True, True, False, False, False, False]
    assert mask[1].tolist() == [False, True, True, True, True, False, False, False]
    slots.rewind(3)
    assert not slots.live[:, 3:].any() and slots.used == 3
    with pytest.raises(ValueError, match="holds 8 slots"):
        slots.append(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.bool))


def test_the_static_batchs_compiled_steps_keep_their_shapes(target_model, exported_drafter,  # noqa: F811
                                                            prompts):
    """With the static cache, what CUDA graphs would record has one shape per step: the
    drafter's anchor step (num_steps + 1 wide) and chain step, and the target's verify forward;
    the prompts' forwards run eagerly."""
    engine = loaded(target_model, (exported_drafter, "eagle3"), "static")
    try:
        seen: dict[str, set] = {"anchor": set(), "chain": set(), "verify": set()}

        def recording(name, forward):
            def run(ids, hidden, positions, past, mask):
                seen[name].add((tuple(ids.shape), tuple(past[0].shape), tuple(mask.shape)))
                return forward(ids, hidden, positions, past, mask)
            return run

        engine.step_functions = (recording("anchor", engine.anchor_forward),
                                 recording("chain", engine.drafter.step))
        real_step = engine.runner.step_for

        def step_for(width):
            step = real_step(width)

            def run(ids, cache, **kwargs):
                if "attention_mask" in kwargs:  # a batch's (one prompt's steps have none)
                    seen["verify"].add((tuple(ids.shape),
                                        tuple(kwargs["attention_mask"].shape)))
                return step(ids, cache, **kwargs)
            return run

        engine.runner.step_for = step_for
        decoder = BatchedSpeculativeDecoder(engine)
        for max_new_tokens in (15, 9):  # the same caches, emptied
            batch = decoder.generate(prompts, max_new_tokens, None)
            assert [r.tokens for r in batch.rows] == [
                plain_generate(engine.runner, p, max_new_tokens, None).tokens for p in prompts]
        rows, k = len(prompts), NUM_STEPS
        assert {ids for ids, _, _ in seen["anchor"]} == {(rows, k + 1)}
        assert len(seen["anchor"]) == len(seen["chain"]) == 1
        assert {ids for ids, _, _ in seen["chain"]} == {(rows, 1)}
        assert len(seen["verify"]) == 1 and next(iter(seen["verify"]))[0] == (rows, k + 1)
    finally:
        engine.runner.close()


def test_a_target_with_sliding_window_layers_is_refused(target_model, exported_drafter,  # noqa: F811
                                                        prompts, monkeypatch):
    """One 4D mask serves every layer, so a sliding-window layer would see too far."""
    engine = loaded(target_model, (exported_drafter, "eagle3"), "dynamic")
    try:
        layers = target_model.config.num_hidden_layers
        monkeypatch.setattr(target_model.config, "layer_types",
                            ["sliding_attention", "full_attention"] * (layers // 2), raising=False)
        with pytest.raises(ValueError, match="sliding-window layers.*batch_sizes"):
            BatchedSpeculativeDecoder(engine).generate(prompts, 4, None)
        with pytest.raises(ValueError, match="sliding-window layers"):
            plain_generate_batch(engine.runner, prompts, 4, None)
    finally:
        engine.runner.close()


def test_a_static_dflash_batch_keeps_its_compiled_shapes(target_model, dflash_drafter_dir,  # noqa: F811
                                                         prompts):
    """DFlash's context step (num_steps + 1 wide after the prompts') and block step see one
    shape each over the static buffers."""
    engine = loaded(target_model, (dflash_drafter_dir, "dflash"), "static")
    try:
        seen: dict[str, set] = {"context": set(), "block": set()}

        def recording(name, forward):
            def run(first, positions, *rest):
                seen[name].add((tuple(first.shape), *(tuple(r.shape) for r in rest
                                                      if isinstance(r, torch.Tensor))))
                return forward(first, positions, *rest)
            return run

        engine.step_functions = (recording("context", engine.context_kv),
                                 recording("block", engine.block_logits))
        decoder = BatchedSpeculativeDecoder(engine)
        for max_new_tokens in (15, 9):
            batch = decoder.generate(prompts, max_new_tokens, None)
            assert [r.tokens for r in batch.rows] == [
                plain_generate(engine.runner, p, max_new_tokens, None).tokens for p in prompts]
        assert {s[0][:2] for s in seen["context"]} == {(len(prompts), BLOCK)}
        assert len(seen["context"]) == len(seen["block"]) == 1
    finally:
        engine.runner.close()
