"""The embedded speculative engine: lossless against greedy decoding, acceptance bookkeeping,
eos, and drafts equal to what the exported drafter computes from scratch."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.data.vocab import build_vocab_map
from draftsmith.export.convert import export_drafter
from draftsmith.extract.capture import HiddenStateCapture
from draftsmith.model.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, Generation, greedy_generate
from draftsmith.target import load_target_head_and_embedding, load_target_model

AUX_IDS = [1, 3, 4]
DRAFT_VOCAB = 256
NUM_STEPS = 3
PROMPTS = ["def add(a, b):\n", "Complete this function from os.py:\nclass Foo:", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def target_model(random_target):
    """A private copy of the target: the engine puts forward hooks on it for good."""
    return load_target_model(random_target.path)


@pytest.fixture(scope="module")
def drafter(random_target, random_target_tokenizer):
    torch.manual_seed(0)
    tcfg = json.loads((random_target.dir / "config.json").read_text())
    masked = []
    for text in PROMPTS * 3:
        masked += random_target_tokenizer.encode(text)
    d2t, t2d, _ = build_vocab_map(masked, tcfg["vocab_size"], DRAFT_VOCAB)
    drafter = Eagle3Drafter(Eagle3Config.from_target(tcfg, AUX_IDS, DRAFT_VOCAB))
    embed, head = load_target_head_and_embedding(random_target)
    drafter.load_target_parts(embed, d2t, t2d, target_head=head)
    return drafter.eval()


@pytest.fixture(scope="module")
def engine(target_model, drafter, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", out)
    return EmbeddedSpeculativeEngine.load(target_model, out, num_steps=NUM_STEPS)


@pytest.fixture(scope="module")
def prompts(random_target_tokenizer):
    return [random_target_tokenizer.encode(p) for p in PROMPTS]


def check_bookkeeping(gen: Generation, num_steps: int = NUM_STEPS) -> None:
    # The first token comes from the prefill; every later one from a verify round.
    assert sum(gen.round_tokens) == len(gen.tokens) - 1
    assert all(1 <= n <= num_steps + 1 for n in gen.round_tokens)
    if gen.round_tokens:
        assert gen.acceptance_length == pytest.approx(sum(gen.round_tokens)
                                                      / len(gen.round_tokens))
        assert 1.0 <= gen.acceptance_length <= num_steps + 1


def test_engine_loads_the_exported_drafter(engine, drafter):
    loaded = engine.drafter.state_dict()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    assert engine.num_steps == NUM_STEPS


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 24])
def test_generate_is_lossless(engine, prompts, max_new_tokens):
    for prompt in prompts:
        expected = greedy_generate(engine.runner, prompt, max_new_tokens, None)
        got = engine.generate(prompt, max_new_tokens, None)
        assert len(expected.tokens) == max_new_tokens
        assert got.tokens == expected.tokens
        check_bookkeeping(got)


def test_eos_stops_generation(engine, prompts):
    prompt = prompts[0]
    reference = greedy_generate(engine.runner, prompt, 20, None).tokens
    for index in (0, 1, 5, 11):
        eos = reference[index]
        first = reference.index(eos)
        got = engine.generate(prompt, 20, eos)
        assert got.tokens == reference[: first + 1]
        assert got.tokens[-1] == eos and eos not in got.tokens[:-1]
        assert got.tokens == greedy_generate(engine.runner, prompt, 20, eos).tokens
        check_bookkeeping(got)


def oracle(engine, reference: list[int], prompt_len: int, wrong_at: int | None, calls: list):
    """Wrap the engine's drafting: run it (so its caches advance as usual) but propose the
    target's own greedy continuation, wrong from index `wrong_at` on."""
    real = engine._draft

    def draft(tokens, aux, drafted_upto, cache, sampling):
        drafts, probs, cache = real(tokens, aux, drafted_upto, cache, sampling)
        calls.append((list(tokens), drafts))
        done = len(tokens) - prompt_len
        truth = (reference[done:] + [0] * NUM_STEPS)[:NUM_STEPS]
        if wrong_at is not None:
            truth = [t if i < wrong_at else (t + 1) % 512 for i, t in enumerate(truth)]
        return truth, probs, cache

    return draft


@pytest.mark.parametrize(("wrong_at", "per_round"), [(None, NUM_STEPS + 1), (1, 2), (0, 1)])
def test_acceptance_with_drafts_that_agree(engine, prompts, monkeypatch, wrong_at, per_round):
    prompt, max_new = prompts[1], 22
    reference = greedy_generate(engine.runner, prompt, max_new + NUM_STEPS, None).tokens
    calls: list = []
    monkeypatch.setattr(engine, "_draft", oracle(engine, reference, len(prompt), wrong_at, calls))
    got = engine.generate(prompt, max_new, None)
    assert got.tokens == reference[:max_new]
    check_bookkeeping(got)
    # Every round but the last (cut at max_new_tokens) keeps accepted drafts + the bonus token.
    assert got.round_tokens[:-1] == [per_round] * (len(got.round_tokens) - 1)
    assert 1 <= got.round_tokens[-1] <= per_round
    assert got.acceptance_length == pytest.approx((max_new - 1) / len(got.round_tokens))
    assert len(calls) == len(got.round_tokens)


def scratch_drafts(drafter: Eagle3Drafter, model, tokens: list[int]) -> list[int]:
    """Drafts for the next tokens computed from scratch: a fresh target forward for the aux
    states, drafter step 0 over every anchor, then the chain."""
    n = len(tokens) - 1
    ids = torch.tensor([tokens])
    aux, _ = HiddenStateCapture(model, AUX_IDS)(ids[:, :n], torch.ones(1, n, dtype=torch.long))
    to_target = drafter.draft_to_target_ids()
    with torch.no_grad():
        hidden = drafter.project_aux(aux.clone())
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        out, logits, past = drafter.step(ids[:, 1:], hidden, torch.arange(n)[None], None, causal)
        drafts = [int(to_target[logits[0, -1].argmax()])]
        hidden = out[:, -1:]
        for j in range(1, NUM_STEPS):
            out, logits, (k, v) = drafter.step(torch.tensor([[drafts[-1]]]), hidden,
                                               torch.tensor([[n - 1 + j]]), past, None)
            past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            hidden = out
            drafts.append(int(to_target[logits[0, -1].argmax()]))
    return drafts


@pytest.mark.parametrize("wrong_at", [None, 2])
def test_drafts_equal_drafting_from_scratch(engine, drafter, target_model, prompts, monkeypatch,
                                            wrong_at):
    """The engine's incremental state (aux states kept from verify forwards, the drafter's
    step-0 cache, target cache crops) gives the drafts a from-scratch computation gives."""
    prompt, max_new = prompts[2], 16
    reference = greedy_generate(engine.runner, prompt, max_new + NUM_STEPS, None).tokens
    calls: list = []
    monkeypatch.setattr(engine, "_draft", oracle(engine, reference, len(prompt), wrong_at, calls))
    engine.generate(prompt, max_new, None)
    assert len(calls) >= 4
    for tokens, drafts in calls:
        assert len(drafts) == NUM_STEPS
        assert drafts == scratch_drafts(drafter, target_model, tokens)
