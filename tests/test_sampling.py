"""Sampled speculative decoding keeps the target's distribution (speculative sampling)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draftsmith.export.convert import export_drafter
from draftsmith.serve.embedded import (
    DraftTree,
    EmbeddedSpeculativeEngine,
    Sampling,
    acceptance_probability,
    plain_generate,
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
        plain[tuple(plain_generate(peaked_engine.runner, prompt, 3, None,
                                    Sampling(1.0, seed=n + i)).tokens[1:3])] += 1
        plain_again[tuple(plain_generate(peaked_engine.runner, prompt, 3, None,
                                          Sampling(1.0, seed=3 * n + i)).tokens[1:3])] += 1
    noise = total_variation(plain, plain_again)  # two samples of the same distribution
    assert 0.2 * n < accepted_drafts < 2 * n  # both acceptance and rejection happened
    assert total_variation(spec, plain) < 1.5 * noise + 0.03, (noise, spec.most_common(4),
                                                                plain.most_common(4))


def target_top2_tree(engine):
    """Tree drafting whose two branches at each node are the target's two likeliest tokens
    there (depth 2, six nodes): sampled verification accepts often and rejects often."""
    known: dict[tuple, list[int]] = {}  # few distinct contexts recur over many samples

    def top2(context: list[int]) -> list[int]:
        if tuple(context) not in known:
            with torch.no_grad():
                logits = engine.runner.model(input_ids=torch.tensor([context])).logits[0, -1]
            known[tuple(context)] = logits.topk(2).indices.tolist()
        return known[tuple(context)]

    def draft(tokens, aux, drafted_upto, cache):

        nodes, parents, depths = [], [], []
        for first in top2(tokens):
            nodes.append(first)
            parents.append(0)
            depths.append(1)
            here = len(nodes)
            for second in top2(tokens + [first]):
                nodes.append(second)
                parents.append(here)
                depths.append(2)
        return DraftTree(nodes, parents, depths), None

    return draft


def exact_pair_distribution(model, prompt: list[int], floor: float = 1e-6) -> dict:
    """P(tokens 2, 3) of plain sampling at temperature 1, summed over token 1: exact up to
    branches with probability below `floor`."""
    def probs(context):
        with torch.no_grad():
            return torch.softmax(model(input_ids=torch.tensor([context])).logits[0, -1].float(), -1)

    pairs: Counter = Counter()
    p0 = probs(prompt)
    for t0 in (p0 > floor).nonzero().flatten().tolist():
        p1 = probs(prompt + [t0])
        for t1 in (p0[t0] * p1 > floor).nonzero().flatten().tolist():
            p2 = p0[t0] * p1[t1] * probs(prompt + [t0, t1])
            for t2 in (p2 > floor).nonzero().flatten().tolist():
                pairs[(t1, t2)] += float(p2[t2])
    return pairs


def test_sampled_tree_speculation_matches_plain_sampling(peaked_engine, prompts,  # noqa: F811
                                                         monkeypatch):
    """Tree verification draws each token from the target and follows the matching child;
    tokens 2 and 3 (both from verify rounds) keep plain sampling's joint distribution: their
    distance to the exact distribution is no larger than that of plain samples of that size."""
    monkeypatch.setattr(peaked_engine, "topk", 2)
    monkeypatch.setattr(peaked_engine, "_draft_tree", target_top2_tree(peaked_engine))
    prompt, n = prompts[0], 200
    exact = exact_pair_distribution(peaked_engine.runner.model, prompt)
    assert sum(exact.values()) > 0.99
    spec: Counter = Counter()
    accepted_drafts = 0
    for i in range(n):
        gen = peaked_engine.generate(prompt, 3, None, Sampling(1.0, seed=i))
        spec[tuple(gen.tokens[1:3])] += 1
        accepted_drafts += sum(gen.round_tokens) - len(gen.round_tokens)
    outcomes = list(exact)
    weights = torch.tensor([exact[o] for o in outcomes])
    generator = torch.Generator().manual_seed(0)
    noise = sorted(  # the distance plain samples of size n keep from the exact distribution
        total_variation(Counter({outcomes[j]: c for j, c in enumerate(
            torch.bincount(torch.multinomial(weights, n, True, generator=generator),
                           minlength=len(outcomes)).tolist()) if c}), exact)
        for _ in range(400))[int(0.99 * 400)]
    assert 0.2 * n < accepted_drafts < 2 * n  # both acceptance and rejection happened
    assert total_variation(spec, exact) <= noise, (noise, spec.most_common(4),
                                                   exact.most_common(4))
