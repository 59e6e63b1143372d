"""Sampled speculative decoding keeps the target's distribution (speculative sampling)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draftsmith.export.convert import export_drafter
from draftsmith.serve.embedded import (
    EmbeddedSpeculativeEngine,
    Sampling,
    acceptance_probability,
    greedy_generate,
    residual_distribution,
)
from draftsmith.target import load_target_model
from tests.test_embedded import drafter, prompts  # noqa: F401  (fixtures)


@pytest.mark.parametrize("seed", range(5))
def test_accept_or_resample_emits_exactly_the_target_distribution(seed):
    """sum_d q(d) [a(d) 1{t=d} + (1 - a(d)) r(t)] = p(t), with q zero outside the draft vocab."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(9, generator=g, dtype=torch.float64).softmax(0)
    q = torch.rand(9, generator=g, dtype=torch.float64) * 3
    q[[1, 4]] = 0  # target ids outside the draft vocab
    q = q.softmax(0) * (q > 0)
    q = q / q.sum()
    emitted = torch.zeros(9, dtype=torch.float64)
    for d in range(9):
        if q[d] == 0:
            continue
        a = acceptance_probability(p, q, d)
        emitted[d] += q[d] * a
        emitted += q[d] * (1 - a) * residual_distribution(p, q)
    assert torch.allclose(emitted, p, atol=1e-12)


def test_residual_of_identical_distributions_falls_back_to_the_target():
    p = torch.tensor([0.5, 0.5])
    assert torch.equal(residual_distribution(p, p.clone()), p)


@pytest.fixture(scope="module")
def peaked_engine(random_target, drafter, tmp_path_factory):  # noqa: F811
    """The random target with a sharpened head: few likely continuations, so a thousand
    samples measure its distribution."""
    model = load_target_model(random_target.path)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    out = tmp_path_factory.mktemp("drafter-sampling")
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", out)
    return EmbeddedSpeculativeEngine.load(model, out, num_steps=2)


def near_target_drafts(engine, mix: float = 0.5):
    """Drafting that agrees with the target about half the time: q = mix * p + (1 - mix) *
    uniform, with p the target's own next-token distribution after each earlier draft. It
    exercises acceptance and rejection at every chain position (a trained drafter on this
    random target would almost never be accepted)."""
    vocab = engine.vocab_size

    def draft(tokens, aux, drafted_upto, cache, sampling):
        drafts, probs = [], []
        for _ in range(engine.num_steps):
            with torch.no_grad():
                ids = torch.tensor([tokens + drafts])
                p = sampling.probs(engine.runner.model(input_ids=ids).logits[0, -1])
            q = mix * p + (1 - mix) / vocab
            probs.append(q)
            drafts.append(sampling.draw(q))
        return drafts, probs, None

    return draft


def total_variation(a: Counter, b: Counter) -> float:
    n_a, n_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / n_a - b[k] / n_b) for k in set(a) | set(b))


def test_sampled_speculation_matches_plain_sampling(peaked_engine, prompts,  # noqa: F811
                                                    monkeypatch):
    """Tokens 2 and 3 come out of verify rounds; their joint distribution must be the one
    plain sampling gives (an engine that always accepts drafts fails this: TV ~0.75)."""
    monkeypatch.setattr(peaked_engine, "_draft", near_target_drafts(peaked_engine))
    prompt, n = prompts[0], 1000
    spec, plain, plain_again = Counter(), Counter(), Counter()
    accepted_drafts = 0
    for i in range(n):
        gen = peaked_engine.generate(prompt, 3, None, Sampling(1.0, seed=i))
        spec[tuple(gen.tokens[1:3])] += 1
        accepted_drafts += sum(gen.round_tokens) - len(gen.round_tokens)
        plain[tuple(greedy_generate(peaked_engine.runner, prompt, 3, None,
                                    Sampling(1.0, seed=n + i)).tokens[1:3])] += 1
        plain_again[tuple(greedy_generate(peaked_engine.runner, prompt, 3, None,
                                          Sampling(1.0, seed=3 * n + i)).tokens[1:3])] += 1
    noise = total_variation(plain, plain_again)  # two samples of the same distribution
    assert 0.2 * n < accepted_drafts < 2 * n  # both acceptance and rejection happened
    assert total_variation(spec, plain) < 1.5 * noise + 0.03, (noise, spec.most_common(4),
                                                                plain.most_common(4))
