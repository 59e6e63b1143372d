"""The embedded speculative engine: lossless against greedy decoding, acceptance bookkeeping,
eos, drafts equal to what the exported drafter computes from scratch, and the static target
cache giving what the dynamic one gives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from draftsmith.config import DeployConfig
from draftsmith.data.vocab import build_vocab_map
from draftsmith.export.convert import export_drafter
from draftsmith.extract.capture import HiddenStateCapture
from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter
from draftsmith.serve.embedded import (
    DraftTree,
    EmbeddedSpeculativeEngine,
    Generation,
    Sampling,
    StaticTargetRunner,
    TargetRunner,
    plain_generate,
    prompt_width,
    prompt_widths,
)
from draftsmith.target import load_target_head_and_embedding, load_target_model
from tests.test_dflash import BLOCK, make_dflash

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
        expected = plain_generate(engine.runner, prompt, max_new_tokens, None)
        got = engine.generate(prompt, max_new_tokens, None)
        assert len(expected.tokens) == max_new_tokens
        assert got.tokens == expected.tokens
        check_bookkeeping(got)


def test_eos_stops_generation(engine, prompts):
    prompt = prompts[0]
    reference = plain_generate(engine.runner, prompt, 20, None).tokens
    for index in (0, 1, 5, 11):
        eos = reference[index]
        first = reference.index(eos)
        got = engine.generate(prompt, 20, eos)
        assert got.tokens == reference[: first + 1]
        assert got.tokens[-1] == eos and eos not in got.tokens[:-1]
        assert got.tokens == plain_generate(engine.runner, prompt, 20, eos).tokens
        check_bookkeeping(got)


def oracle(monkeypatch, engine, reference: list[int], prompt: list[int], wrong_at: int | None,
           calls: list) -> None:
    """Wrap the engine's drafting (`_draft`, and `greedy_round`, with which a greedy round
    over static buffers drafts the next one ahead): run it, so its caches advance as usual,
    and record (the tokens drafted after, the drafts) in `calls`; but propose the target's own
    greedy continuation, wrong from index `wrong_at` on."""
    real_draft, real_round = engine._draft, engine.greedy_round

    def truth_after(known: int) -> list[int]:
        truth = (reference[known - len(prompt):] + [0] * NUM_STEPS)[:NUM_STEPS]
        if wrong_at is not None:
            truth = [t if i < wrong_at else (t + 1) % 512 for i, t in enumerate(truth)]
        return truth

    def draft(tokens, aux, drafted_upto, cache, sampling):
        drafts, probs, cache = real_draft(tokens, aux, drafted_upto, cache, sampling)
        calls.append((list(tokens), listed(drafts)))
        truth = truth_after(len(tokens))
        return (torch.tensor(truth) if isinstance(drafts, torch.Tensor) else truth), probs, cache

    def draft_round(packed, anchors, *buffers):
        drafts = real_round(packed, anchors, *buffers)  # [1, k]
        start, last = packed[anchors.shape[1]:].tolist()  # the anchors' first position, last
        known = start + last + 2  # the tokens drafted after: up to the last anchor's next
        calls.append(([*prompt, *reference][:known], drafts[0].tolist()))
        return torch.tensor([truth_after(known)])  # [1, k]

    monkeypatch.setattr(engine, "_draft", draft)
    monkeypatch.setattr(engine, "greedy_round", draft_round)


def drafted_rounds(calls: list, generation: Generation) -> list:
    """The recorded drafts that were verified: a round that drafts ahead drafts once more
    than it verifies, when the budget ends the generation."""
    assert len(calls) - generation.verify_rounds in (0, 1)
    return calls[:generation.verify_rounds]


@pytest.mark.parametrize(("wrong_at", "per_round"), [(None, NUM_STEPS + 1), (1, 2), (0, 1)])
def test_acceptance_with_drafts_that_agree(engine, prompts, monkeypatch, wrong_at, per_round):
    prompt, max_new = prompts[1], 22
    reference = plain_generate(engine.runner, prompt, max_new + NUM_STEPS, None).tokens
    calls: list = []
    oracle(monkeypatch, engine, reference, prompt, wrong_at, calls)
    got = engine.generate(prompt, max_new, None)
    assert got.tokens == reference[:max_new]
    check_bookkeeping(got)
    # Every round but the last (cut at max_new_tokens) keeps accepted drafts + the bonus token.
    assert got.round_tokens[:-1] == [per_round] * (len(got.round_tokens) - 1)
    assert 1 <= got.round_tokens[-1] <= per_round
    assert got.acceptance_length == pytest.approx((max_new - 1) / len(got.round_tokens))
    assert len(drafted_rounds(calls, got)) == len(got.round_tokens)


def scratch_drafts(drafter: Eagle3Drafter, model, tokens: list[int],
                   window: int | None = None) -> list[int]:
    """Drafts for the next tokens computed from scratch: a fresh target forward for the aux
    states, drafter step 0 over every anchor, then the chain; with a sliding window, each
    query sees only the `window` positions up to its own."""
    n = len(tokens) - 1
    ids = torch.tensor([tokens])
    aux, _ = HiddenStateCapture(model, AUX_IDS)(ids[:, :n], torch.ones(1, n, dtype=torch.long))
    to_target = drafter.draft_to_target_ids()
    reach = window or 10**9
    with torch.no_grad():
        hidden = drafter.project_aux(aux.clone())
        back = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # [n, n]
        causal = ((back >= 0) & (back < reach))[None, None]
        out, logits, past = drafter.step(ids[:, 1:], hidden, torch.arange(n)[None], None, causal)
        drafts = [int(to_target[logits[0, -1].argmax()])]
        hidden = out[:, -1:]
        for j in range(1, NUM_STEPS):
            near = (torch.arange(n + j) > n - 1 + j - reach)[None, None, None]  # [1,1,1,n+j]
            out, logits, (k, v) = drafter.step(torch.tensor([[drafts[-1]]]), hidden,
                                               torch.tensor([[n - 1 + j]]), past, near)
            past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            hidden = out
            drafts.append(int(to_target[logits[0, -1].argmax()]))
    return drafts


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_drafts_equal_drafting_from_scratch(exported_drafter, drafter, target_model, prompts,
                                            monkeypatch, wrong_at, cache):
    """The engine's incremental state (aux states kept from verify forwards, the drafter's
    step-0 cache, target cache crops; over static buffers, the next round's anchors taken
    on the device from the verify) gives the drafts a from-scratch computation gives, with
    every round accepting all, none or some drafts. The round drafted ahead and never
    verified is checked too."""
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, NUM_STEPS,
                                            cache=cache)
    try:
        prompt, max_new = prompts[2], 16
        reference = plain_generate(engine.runner, prompt, max_new + NUM_STEPS, None).tokens
        calls: list = []
        oracle(monkeypatch, engine, reference, prompt, wrong_at, calls)
        got = engine.generate(prompt, max_new, None)
    finally:
        engine.runner.close()
    assert got.tokens == reference[:max_new]
    assert len(drafted_rounds(calls, got)) >= 4
    for tokens, drafts in calls:
        assert len(drafts) == NUM_STEPS
        assert drafts == scratch_drafts(drafter, target_model, tokens)


# EAGLE-3.1 and a speculators sliding window ------------------------------------------------

# Every EAGLE-3.1 norm on, and a window shorter than the prompts, so each matters.
EAGLE31 = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": True,
           "norm_output": True, "sliding_window": 6}


@pytest.fixture(scope="module")
def eagle31_drafter(drafter, tmp_path_factory):
    """The module's drafter with EAGLE-3.1's norms (off their all-ones start) and a window,
    exported in the speculators layout (the only one that can hold norm_before_residual)."""
    eagle31 = Eagle3Drafter(drafter.config.model_copy(update=EAGLE31))
    eagle31.load_state_dict(drafter.state_dict(), strict=False)
    g = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for name, p in eagle31.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=g)
    out = tmp_path_factory.mktemp("drafter-eagle31")
    export_drafter(eagle31.state_dict(), eagle31.config, "speculators", "llama", out)
    return eagle31.eval(), out


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_eagle31_drafts_equal_drafting_from_scratch(target_model, eagle31_drafter, prompts,
                                                    monkeypatch, wrong_at):
    """The engine runs an EAGLE-3.1 drafter with a sliding window as the drafter computes it
    from scratch (norms inside the drafter, the window in the engine's masks), and stays
    lossless, chain and tree."""
    drafter31, out = eagle31_drafter
    engine = EmbeddedSpeculativeEngine.load(target_model, out, num_steps=NUM_STEPS)
    try:
        prompt, max_new = prompts[1], 16
        assert len(prompt) > 2 * EAGLE31["sliding_window"]
        reference = plain_generate(engine.runner, prompt, max_new + NUM_STEPS, None).tokens
        calls: list = []
        oracle(monkeypatch, engine, reference, prompt, wrong_at, calls)
        assert engine.generate(prompt, max_new, None).tokens == reference[:max_new]
        for tokens, drafts in calls:
            assert drafts == scratch_drafts(drafter31, target_model, tokens,
                                            EAGLE31["sliding_window"])
        # Without the window the drafts differ somewhere: the window is not a no-op here.
        assert any(drafts != scratch_drafts(drafter31, target_model, tokens)
                   for tokens, drafts in calls)
    finally:
        engine.runner.close()
    with tree_engine(target_model, out, 3, 2, 6) as tree:
        for prompt in prompts:
            assert tree.generate(prompt, 16, None).tokens == \
                plain_generate(tree.runner, prompt, 16, None).tokens


# Tree drafting (eagle_topk > 1) --------------------------------------------------------------

TREE_SHAPES = [(3, 2, 6), (3, 2, 7), (2, 3, 8), (4, 4, 12)]  # (num_steps, topk, num_draft_tokens)


@pytest.fixture(scope="module")
def exported_drafter(drafter, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter-tree")
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", out)
    return out


@contextmanager
def tree_engine(target_model, exported_drafter, steps: int, topk: int, budget: int):
    """An engine on the shared target model; its hooks come off the model afterwards."""
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, num_steps=steps,
                                            topk=topk, num_draft_tokens=budget)
    try:
        yield engine
    finally:
        engine.runner.close()


def aux_before_last(engine, prompt: list[int]) -> torch.Tensor:
    """The target's aux states for every token but the last, as the engine keeps them."""
    return engine.runner.forward(prompt[:-1], DynamicCache())[1]  # [1, n, K*H]


@pytest.mark.parametrize(("steps", "topk", "budget"), TREE_SHAPES)
def test_tree_generate_is_lossless(target_model, exported_drafter, prompts, steps, topk, budget):
    with tree_engine(target_model, exported_drafter, steps, topk, budget) as engine:
        for prompt in prompts:
            expected = plain_generate(engine.runner, prompt, 20, None)
            got = engine.generate(prompt, 20, None)
            assert got.tokens == expected.tokens
            check_bookkeeping(got, steps)


def test_tree_shape_follows_the_settings(target_model, exported_drafter, prompts):
    with tree_engine(target_model, exported_drafter, 3, 2, 6) as engine:
        prompt = prompts[1]
        aux = aux_before_last(engine, prompt)
        tree, _ = engine._draft_tree(prompt, aux, 0, None)
        assert len(tree) == 5  # num_draft_tokens - 1: the root is the last known token
        assert max(tree.depths) <= 3
        for i, (parent, depth) in enumerate(zip(tree.parents, tree.depths, strict=True)):
            assert parent < i + 1  # parents come first in verify order
            assert depth == (1 if parent == 0 else tree.depths[parent - 1] + 1)
        assert sum(1 for p in tree.parents if p == 0) <= 2  # at most topk children per node


def test_tree_with_topk_one_drafts_the_chain(target_model, exported_drafter, prompts):
    with tree_engine(target_model, exported_drafter, 3, 1, 4) as engine:
        prompt = prompts[0]
        aux = aux_before_last(engine, prompt)
        chain, _, _ = engine._draft(prompt, aux, 0, None, Sampling())
        tree, _ = engine._draft_tree(prompt, aux, 0, None)
        assert tree.tokens == chain and tree.parents == [0, 1, 2] and tree.depths == [1, 2, 3]


def path_logits(drafter: Eagle3Drafter, model, tokens: list[int], path: list[int]):
    """The drafter's logits after feeding `path` (draft tokens after `tokens`) as a chain,
    computed from scratch: what a tree node must equal, since it may only see its ancestors."""
    n = len(tokens) - 1
    ids = torch.tensor([tokens])
    aux, _ = HiddenStateCapture(model, AUX_IDS)(ids[:, :n], torch.ones(1, n, dtype=torch.long))
    with torch.no_grad():
        hidden = drafter.project_aux(aux.clone())
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        out, logits, past = drafter.step(ids[:, 1:], hidden, torch.arange(n)[None], None, causal)
        hidden, logits = out[:, -1:], logits[0, -1]
        for j, token in enumerate(path, start=1):
            out, step_logits, (k, v) = drafter.step(torch.tensor([[token]]), hidden,
                                                    torch.tensor([[n - 1 + j]]), past, None)
            past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            hidden, logits = out, step_logits[0, -1]
    return logits  # [D]


def test_tree_nodes_equal_drafting_their_path_from_scratch(target_model, exported_drafter,
                                                           drafter, prompts):
    """Every node is among the topk of the drafter's logits after its ancestors alone: the
    tree attention mask lets no node see its cousins."""
    topk = 3
    with tree_engine(target_model, exported_drafter, 3, topk, 22) as engine:  # every candidate
        prompt = prompts[2]
        aux = aux_before_last(engine, prompt)
        tree, _ = engine._draft_tree(prompt, aux, 0, None)
        to_target = drafter.draft_to_target_ids()
        assert max(tree.depths) == 3
        for i, token in enumerate(tree.tokens, start=1):
            path, node = [], tree.parents[i - 1]
            while node:
                path.insert(0, tree.tokens[node - 1])
                node = tree.parents[node - 1]
            logits = path_logits(drafter, target_model, prompt, path)
            assert token in to_target[logits.topk(topk).indices].tolist(), (i, path)


def true_branch_tree(truth: list[int], true_branch: int) -> DraftTree:
    """A tree in which `truth` (the target's greedy continuation) is branch `true_branch` of
    two at every depth, with a wrong sibling."""
    nodes, parents, depths, parent = [], [], [], 0
    for depth, token in enumerate(truth, start=1):
        pair = [token, (token + 1) % 512]
        if true_branch:
            pair.reverse()
        for candidate in pair:
            nodes.append(candidate)
            parents.append(parent)
            depths.append(depth)
        parent = len(nodes) - (1 - true_branch)  # verify index of the true token
    return DraftTree(nodes, parents, depths)


def oracle_tree(engine, reference: list[int], prompt_len: int, true_branch: int):
    """Wrap tree drafting: run it (so caches advance), but propose a tree in which the
    target's greedy continuation is branch `true_branch` of two at every depth, with a wrong
    sibling, so verification must pick the right child and keep non-adjacent cache rows."""
    real = engine._draft_tree

    def draft(tokens, aux, drafted_upto, cache):
        _, cache = real(tokens, aux, drafted_upto, cache)
        done = len(tokens) - prompt_len
        truth = (reference[done:] + [0] * engine.num_steps)[: engine.num_steps]
        return true_branch_tree(truth, true_branch), cache

    return draft


@pytest.mark.parametrize("true_branch", [0, 1])
def test_tree_accepts_the_true_branch(target_model, exported_drafter, prompts, monkeypatch,
                                      true_branch):
    steps, max_new = 3, 21
    with tree_engine(target_model, exported_drafter, steps, 2, 7) as engine:
        prompt = prompts[1]
        reference = plain_generate(engine.runner, prompt, max_new + steps, None).tokens
        monkeypatch.setattr(engine, "_draft_tree",
                            oracle_tree(engine, reference, len(prompt), true_branch))
        got = engine.generate(prompt, max_new, None)
        assert got.tokens == reference[:max_new]
        assert got.round_tokens[:-1] == [steps + 1] * (len(got.round_tokens) - 1)
        check_bookkeeping(got, steps)


def test_replay_refuses_a_tree_engine(target_model, exported_drafter, prompts):
    with tree_engine(target_model, exported_drafter, 3, 2, 6) as engine, \
            pytest.raises(ValueError, match="replay with an engine of eagle_topk=1"):
        engine.replay(prompts[0], [1, 2, 3])


def test_engine_refuses_an_impossible_tree(target_model, exported_drafter):
    with pytest.raises(ValueError, match="num_draft_tokens=9: between 2 and 7"):
        EmbeddedSpeculativeEngine.load(target_model, exported_drafter, num_steps=2, topk=2,
                                       num_draft_tokens=9)


# The guard's replay (draftsmith/bench/guard.py) ----------------------------------------------


def test_replay_over_the_engines_own_output_makes_its_rounds(engine, prompts):
    """Replaying greedy decoding over an output the engine produced gives the rounds it made:
    what the guard compares a served acceptance with."""
    for prompt in prompts:
        made = engine.generate(prompt, 24, None)
        replayed = engine.replay(prompt, made.tokens)
        assert replayed.round_tokens == made.round_tokens
        assert replayed.acceptance_length == made.acceptance_length


def test_the_guard_judges_against_its_stated_threshold():
    from draftsmith.bench.guard import GUARD_THRESHOLD, LIKELY_CAUSES, judge

    assert GUARD_THRESHOLD == 0.9
    quiet = judge(2.0, 2.2)  # 91%
    assert quiet["ok"] and "problem" not in quiet and quiet["ratio"] == pytest.approx(0.9091,
                                                                                       abs=1e-4)
    fired = judge(1.04, 2.77)  # vLLM issue #50170's figures
    assert not fired["ok"] and fired["ratio"] == pytest.approx(0.3755, abs=1e-4)
    assert all(cause in fired["problem"] for cause in LIKELY_CAUSES)
    assert not judge(1.9, 2.2)["ok"] and judge(1.9, 2.2, threshold=0.8)["ok"]


# The static target cache (deploy.embedded_cache=static) ---------------------------------------
# The same tokens, rounds and aux states as the dynamic cache, rejected drafts dropped by winding
# the cache back, trees refused by name, and a cache that is too short refused, never overrun.

@pytest.fixture(scope="module")
def dflash_drafter_dir(random_target, random_target_dir, tmp_path_factory):
    """A DFlash drafter drafting from the target's head (so some drafts are accepted)."""
    embed, head = load_target_head_and_embedding(random_target)
    vocab = json.loads((random_target_dir / "config.json").read_text())["vocab_size"]
    d2t, t2d, _ = build_vocab_map(list(range(vocab)), vocab, vocab)
    dflash = make_dflash(random_target_dir, draft_vocab=vocab, embed=embed)
    dflash.load_target_parts(embed, d2t, t2d, target_head=head)
    out = tmp_path_factory.mktemp("dflash-static")
    export_drafter(dflash.state_dict(), dflash.config, "speculators", "llama", out)
    return out


@contextmanager
def engines(target_model, drafter_dir, num_steps: int, topk: int = 1,
            num_draft_tokens: int | None = None):
    """The same drafter (a chain, or a tree with topk > 1) over a dynamic and a static target
    cache; hooks off afterwards."""
    made = [EmbeddedSpeculativeEngine.load(target_model, drafter_dir, num_steps, topk=topk,
                                           num_draft_tokens=num_draft_tokens, cache=cache)
            for cache in ("dynamic", "static")]
    try:
        yield made
    finally:
        for engine in made:
            engine.runner.close()


def assert_same_generations(dynamic, static, prompts, max_new_tokens: int) -> None:
    for prompt in prompts:
        plain = plain_generate(dynamic.runner, prompt, max_new_tokens, None)
        assert plain_generate(static.runner, prompt, max_new_tokens, None).tokens == plain.tokens
        expected = dynamic.generate(prompt, max_new_tokens, None)
        got = static.generate(prompt, max_new_tokens, None)
        assert expected.tokens == plain.tokens
        assert got.tokens == plain.tokens
        assert got.round_tokens == expected.round_tokens
        check_bookkeeping(got, static.num_steps)


@pytest.mark.parametrize("max_new_tokens", [1, 9, 24])
def test_eagle3_chain_is_the_same_on_the_static_cache(target_model, exported_drafter, prompts,
                                                      max_new_tokens):
    with engines(target_model, exported_drafter, NUM_STEPS) as (dynamic, static):
        assert isinstance(static.runner, StaticTargetRunner)
        assert type(dynamic.runner) is TargetRunner
        assert_same_generations(dynamic, static, prompts, max_new_tokens)


def test_eagle31_chain_is_the_same_on_the_static_cache(target_model, eagle31_drafter, prompts):
    with engines(target_model, eagle31_drafter[1], NUM_STEPS) as (dynamic, static):
        assert_same_generations(dynamic, static, prompts, 20)


def test_dflash_block_is_the_same_on_the_static_cache(target_model, dflash_drafter_dir,
                                                      prompts):
    with engines(target_model, dflash_drafter_dir, BLOCK - 1) as (dynamic, static):
        assert_same_generations(dynamic, static, prompts, 20)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_partly_accepted_rounds_are_the_same_on_the_static_cache(
        target_model, exported_drafter, dflash_drafter_dir, prompts, monkeypatch, kind,
        wrong_at):
    """Drafts that agree with the target up to `wrong_at`: every round winds the static
    cache back by a different count (none, all drafts, some)."""
    drafter_dir = exported_drafter if kind == "eagle3" else dflash_drafter_dir
    prompt, max_new = prompts[1], 22
    with engines(target_model, drafter_dir, NUM_STEPS) as (dynamic, static):
        reference = plain_generate(dynamic.runner, prompt, max_new + NUM_STEPS, None).tokens
        generated = []
        for engine in (dynamic, static):
            oracle(monkeypatch, engine, reference, prompt, wrong_at, [])
            generated.append(engine.generate(prompt, max_new, None))
        expected, got = generated
        assert got.tokens == expected.tokens == reference[:max_new]
        assert got.round_tokens == expected.round_tokens
        per_round = NUM_STEPS + 1 if wrong_at is None else wrong_at + 1
        assert got.round_tokens[:-1] == [per_round] * (len(got.round_tokens) - 1)


def test_sampled_generation_is_the_same_on_the_static_cache(target_model, exported_drafter,
                                                            prompts):
    with engines(target_model, exported_drafter, NUM_STEPS) as (dynamic, static):
        for i, prompt in enumerate(prompts):
            expected = dynamic.generate(prompt, 16, None, Sampling(0.8, seed=i))
            got = static.generate(prompt, 16, None, Sampling(0.8, seed=i))
            assert got.tokens == expected.tokens
            assert got.round_tokens == expected.round_tokens


def test_a_wound_back_cache_continues_as_if_the_drafts_were_never_written(target_model,
                                                                          prompts):
    """Logits and aux states after dropping rejected positions equal a dynamic forward of
    the kept tokens; the stale slots past the position are hidden, then overwritten."""
    prompt = prompts[1]
    static = StaticTargetRunner(target_model, AUX_IDS)
    dynamic = TargetRunner(target_model, AUX_IDS)
    try:
        cache = static.new_cache(len(prompt) + 8)
        static_logits, static_aux = static.forward(prompt, cache)
        dynamic_cache = dynamic.new_cache(len(prompt) + 8)
        logits, aux = dynamic.forward(prompt, dynamic_cache)
        torch.testing.assert_close(static_aux, aux)  # [1, P, K*H]
        torch.testing.assert_close(static_logits, logits)  # [P, V]
        static.forward([11, 12, 13, 14], cache)  # a verify round keeping 11 and the bonus
        static.drop_last(cache, 2)
        assert cache.length == len(prompt) + 2
        static_logits, static_aux = static.forward([15], cache)
        logits, aux = dynamic.forward([11, 12, 15], dynamic_cache)
        torch.testing.assert_close(static_aux, aux[:, -1:])  # [1, 1, K*H]
        torch.testing.assert_close(static_logits, logits[-1:])  # [1, V]
    finally:
        static.close()
        dynamic.close()


@pytest.mark.parametrize("runner_class", [TargetRunner, StaticTargetRunner])
def test_last_only_keeps_the_last_tokens_logits(runner_class, target_model, prompts):
    """A prompt's forward needs its last token's logits only (the head over every row is as
    much arithmetic as the rest of a short prompt on a CPU); the aux states are all kept."""
    runner = runner_class(target_model, AUX_IDS)
    try:
        logits, aux = runner.forward(prompts[1], runner.new_cache(40))
        last, last_aux = runner.forward(prompts[1], runner.new_cache(40), last_only=True)
        assert last.shape == (1, logits.shape[1])
        torch.testing.assert_close(last, logits[-1:])
        torch.testing.assert_close(last_aux, aux)
    finally:
        runner.close()


def test_prompt_widths_double_up_to_the_cache(target_model):
    assert prompt_widths(256) == [16, 32, 64, 128, 256]
    assert prompt_widths(768) == [16, 32, 64, 128, 256, 512, 768]
    assert prompt_widths(12) == [12]
    assert [prompt_width(n, 768) for n in (1, 16, 17, 300, 513)] == [16, 16, 32, 512, 768]


def test_a_captured_prompt_is_padded_and_continues_as_the_dynamic_cache(target_model,
                                                                       prompts):
    """With captured steps, a prompt's forward runs at the next of a few widths, every one
    captured when the cache is made (so none is captured inside a measurement): its logits,
    aux states and the steps after it are the dynamic cache's, and the padding's positions
    are gone from the cache. A prompt whose padding would not fit runs at its own width."""
    runner = StaticTargetRunner(target_model, AUX_IDS, (1,), compile_steps=True)
    dynamic = TargetRunner(target_model, AUX_IDS)
    captures = runner._prompt_step.compiled._captures
    try:
        cache = runner.new_cache(40)
        assert cache.capacity == 256
        assert sorted(key[1][0][1] for key in captures) == prompt_widths(256)  # ids' widths
        padded_to: list[int] = []
        step = runner._prompt_step
        runner._prompt_step = lambda ids, *rest: padded_to.append(ids.shape[1]) or step(ids,
                                                                                      *rest)
        for prompt in (prompts[0], prompts[1], [7, 8, 9]):
            cache = runner.new_cache(40)
            logits, aux = runner.forward(prompt, cache, last_only=True)
            dynamic_cache = dynamic.new_cache(40)
            expected_logits, expected_aux = dynamic.forward(prompt, dynamic_cache)
            torch.testing.assert_close(logits, expected_logits[-1:])  # [1, V]
            torch.testing.assert_close(aux, expected_aux)  # [1, T, K*H]
            assert cache.length == len(prompt)
            assert all(int(layer.cumulative_length) == len(prompt) for layer in cache.kv.layers)
            step_logits, step_aux = runner.forward([5], cache)
            expected_logits, expected_aux = dynamic.forward([5], dynamic_cache)
            torch.testing.assert_close(step_logits, expected_logits)  # [1, V]
            torch.testing.assert_close(step_aux, expected_aux)  # [1, 1, K*H]
        assert aux.shape[1] == 3
        assert padded_to == [next(w for w in prompt_widths(256) if w >= len(prompt))
                             for prompt in (prompts[0], prompts[1], [7, 8, 9])]
        assert len(captures) == len(prompt_widths(256))  # replayed, none captured again
        cache = runner.new_cache(40)
        runner.forward(list(range(200)), cache, last_only=True)  # padded to 256, the cache
        tail = list(range(40))  # 64 slots would not fit: its own width, eagerly
        torch.testing.assert_close(runner.forward(tail, cache, last_only=True)[0],
                                   dynamic.forward([*range(200), *tail],
                                                   dynamic.new_cache(240))[0][-1:])
        assert cache.length == 240
        cache = runner.new_cache(40)  # all logits: its own width, eagerly
        torch.testing.assert_close(runner.forward(prompts[0], cache)[0],
                                   dynamic.forward(prompts[0], dynamic.new_cache(40))[0])
        assert padded_to[-1] == 256 and len(padded_to) == 4
    finally:
        runner.close()
        dynamic.close()


def test_the_static_cache_is_reused_when_it_fits_and_grown_when_not(target_model, prompts):
    runner = StaticTargetRunner(target_model, AUX_IDS)
    try:
        first = runner.new_cache(10)
        assert first.capacity == StaticTargetRunner.LENGTH_STEP
        assert runner.new_cache(StaticTargetRunner.LENGTH_STEP).kv is first.kv
        longer = runner.new_cache(StaticTargetRunner.LENGTH_STEP + 1)
        assert longer.kv is not first.kv
        assert longer.capacity == 2 * StaticTargetRunner.LENGTH_STEP
        # A reused cache starts empty: the same prompt gives the same logits as the first time.
        expected, _ = runner.forward(prompts[0], runner.new_cache(10))
        runner.forward(prompts[1], runner.new_cache(10))
        torch.testing.assert_close(runner.forward(prompts[0], runner.new_cache(10))[0], expected)
    finally:
        runner.close()


def test_a_new_batch_size_keeps_the_graphs_of_the_others(target_model, prompts):
    """A cache for a new number of rows leaves the other caches' captured steps in place (the
    benchmark's batch sizes, or a batch-1 decoding between two batches, capture once); a
    cache that replaces a shorter one drops them all, since a graph names its cache by id."""
    runner = StaticTargetRunner(target_model, AUX_IDS, (1,), compile_steps=True)
    captures = runner._captured.compiled._captures
    try:
        cache = runner.new_cache(40)
        runner.forward(prompts[0], cache)
        runner.forward(prompts[0][-1:], cache)
        assert len(captures) == 1
        runner.new_batch_cache(4, 40)
        assert len(captures) == 1
        runner.forward(prompts[0][-1:], cache)
        assert len(captures) == 1  # replayed, not captured again
        runner.new_cache(StaticTargetRunner.LENGTH_STEP + 1)
        assert len(captures) == 0
    finally:
        runner.close()


def test_a_generation_that_fills_the_cache_exactly_is_the_same(target_model, exported_drafter,
                                                              prompts, monkeypatch):
    """With no rounding up, the cache holds exactly prompt + max_new_tokens + num_steps
    positions, which the last verify round reaches when it accepts nothing."""
    monkeypatch.setattr(StaticTargetRunner, "LENGTH_STEP", 1)
    with engines(target_model, exported_drafter, NUM_STEPS) as (dynamic, static):
        writes: list[int] = []
        forward = static.runner.forward

        def recorded(input_ids, cache, *args, **kwargs):
            out = forward(input_ids, cache, *args, **kwargs)
            writes.append(cache.length - cache.capacity)
            return out

        monkeypatch.setattr(static.runner, "forward", recorded)
        for prompt in prompts:
            assert static.generate(prompt, 24, None).tokens == \
                dynamic.generate(prompt, 24, None).tokens
        assert max(writes) <= 0


def test_a_forward_past_the_cache_end_is_refused_and_leaves_the_cache_as_it_was(target_model):
    runner = StaticTargetRunner(target_model, AUX_IDS)
    try:
        cache = runner.new_cache(1)
        runner.forward(list(range(cache.capacity - 2)), cache)
        with pytest.raises(ValueError, match="do not fit"):
            runner.forward([1, 2, 3], cache)
        assert cache.length == cache.capacity - 2
        runner.forward([1, 2], cache)  # the last two slots still take two tokens
        assert cache.length == cache.capacity
    finally:
        runner.close()


# Trees on the static cache: drafted, chosen and verified on the device -------------------------


def device_tree(engine, prompt: list[int], aux: torch.Tensor):
    """The static path's first tree for `prompt` (its drafter caches fresh), read back as a
    DraftTree, with the visibility it hands the verify forward [N+1, N+1]."""
    cache = engine._new_drafter_cache(len(prompt) + 64)
    nodes, parents, depths, visible = engine._static_round(prompt, aux, 0, cache)
    return DraftTree(nodes.tolist(), parents.tolist(), depths.tolist()), visible


@pytest.mark.parametrize(("steps", "topk", "budget"), TREE_SHAPES)
def test_a_static_tree_is_the_dynamic_paths_tree(target_model, exported_drafter, prompts,
                                                 steps, topk, budget):
    """Levels fed at once over static buffers, candidates scored and chosen by tensor
    operations: the same nodes, parents and depths as the dynamic path's lists and host
    reads, and each node sees its ancestors and itself."""
    with engines(target_model, exported_drafter, steps, topk, budget) as (dynamic, static):
        assert static.device_trees and not dynamic.device_trees
        for prompt in prompts:
            aux = aux_before_last(dynamic, prompt)
            want, _ = dynamic._draft_tree(prompt, aux, 0, None)
            got, visible = device_tree(static, prompt, aux)
            assert got == want
            assert torch.equal(visible, want.attention(0, "cpu")[0, 0])


def test_the_device_walk_follows_the_host_walk():
    """static_tree.walk (greedy rounds drafting ahead) against `_verify_tree`'s host walk, on
    random trees up to 4 deep whose siblings may share a token (the first in verify order
    wins) and random picks from a vocabulary small enough that many nodes match."""
    from draftsmith.serve import static_tree

    rng = torch.Generator().manual_seed(0)
    for _ in range(300):
        size = int(torch.randint(1, 12, (1,), generator=rng))
        parents, depths = [], []
        for i in range(size):
            shallow = [0] + [j + 1 for j in range(i) if depths[j] < 4]
            parent = shallow[int(torch.randint(len(shallow), (1,), generator=rng))]
            parents.append(parent)
            depths.append(1 if parent == 0 else depths[parent - 1] + 1)
        tree = DraftTree(torch.randint(3, (size,), generator=rng).tolist(), parents, depths)
        picks = torch.randint(3, (size + 1,), generator=rng)  # [N+1]
        path, bonus = EmbeddedSpeculativeEngine._verify_tree(tree, picks.tolist().__getitem__)
        kept, accepted = static_tree.walk(torch.tensor(tree.tokens), torch.tensor(parents),
                                          picks, 4)
        last = path[-1] if path else 0
        assert kept.tolist() == [0, *path] + [last] * (4 - len(path))
        assert accepted.tolist() == [len(path)]
        assert int(picks[last]) == bonus


def test_tree_choices_are_a_stable_sorts_even_among_ties():
    """static_tree's counting choices against Python's stable sort, which the dynamic path
    uses, on trees whose scores step down by 0, 1 or 2 a level, so that most tie: the best
    `count` best first, and the tree's nodes in candidate order with their parents' verify
    indices."""
    from draftsmith.serve import static_tree

    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        size = int(torch.randint(1, 40, (1,), generator=rng))
        parents = [-1] + [int(torch.randint(i, (1,), generator=rng)) for i in range(1, size)]
        scores = torch.zeros(size, dtype=torch.float64)  # [M]: a child at most its parent
        for i in range(1, size):
            scores[i] = scores[parents[i]] - int(torch.randint(3, (1,), generator=rng))
        by_score = sorted(range(size), key=lambda i: -float(scores[i]))
        assert static_tree.places(scores).tolist() == [by_score.index(i) for i in range(size)]
        count = int(torch.randint(1, size + 1, (1,), generator=rng))
        assert static_tree.best(scores, count).tolist() == by_score[:count]
        tokens, depths = torch.arange(100, 100 + size), torch.arange(size)  # [M], [M]
        got = static_tree.choose_nodes(scores, tokens, torch.tensor(parents), depths, count)
        chosen = sorted(by_score[:count])
        verify_index = {c: i + 1 for i, c in enumerate(chosen)} | {-1: 0}
        assert got[0].tolist() == [100 + c for c in chosen]
        assert got[1].tolist() == [verify_index[parents[c]] for c in chosen]
        assert got[2].tolist() == chosen


ROW_TOPK_CHECK = """
import torch
from draftsmith.serve import row_topk
generator = torch.Generator().manual_seed(0)
for width, dtype in ((300, torch.float32), (1000, torch.bfloat16), (16384, torch.bfloat16)):
    logits = torch.randn(5, width, generator=generator).to(dtype)  # [F, D]
    logits[1, 7] = logits[1, width - 3] = logits[1].max() + 1  # a tie for the first place
    want_ids = (-logits.float()).sort(dim=-1, stable=True).indices[:, :4]  # [F, k]
    want_logp = torch.log_softmax(logits.float(), -1).gather(-1, want_ids)  # [F, k]
    assert want_ids[1, :2].tolist() == [7, width - 3]  # the lower id first
    for topk_of in (row_topk.reference, row_topk.triton_row_topk):
        logp, ids = topk_of(logits, 4)
        assert torch.equal(ids, want_ids), (topk_of, width)
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
assert row_topk.kernel_agrees(torch.device("cpu"))  # the trial a CUDA device gets
row_topk.triton_row_topk = lambda logits, topk: row_topk.reference(logits, topk + 1)
assert not row_topk.kernel_agrees(torch.device("cpu"))  # a kernel that disagrees is not used


def broken(logits, topk):
    raise RuntimeError("no Triton here")


row_topk.triton_row_topk = broken
assert not row_topk.kernel_agrees(torch.device("cpu"))  # nor one that fails
print("ok")
"""


def test_a_trees_children_are_the_topk_with_ties_to_the_lower_id():
    """Both ways of taking a row's top k (the reference on the CPU; the Triton kernel that a
    CUDA device runs, here under Triton's interpreter) against torch.topk, with a tie."""
    result = subprocess.run([sys.executable, "-c", ROW_TOPK_CHECK], capture_output=True,
                            text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize(("steps", "topk", "budget"), TREE_SHAPES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_generation_is_the_same_on_the_static_cache(target_model, exported_drafter, prompts,
                                                        steps, topk, budget, temperature):
    with engines(target_model, exported_drafter, steps, topk, budget) as (dynamic, static):
        for i, prompt in enumerate(prompts):
            expected = dynamic.generate(prompt, 24, None, Sampling(temperature, seed=i))
            got = static.generate(prompt, 24, None, Sampling(temperature, seed=i))
            assert got.tokens == expected.tokens
            assert got.round_tokens == expected.round_tokens
            if temperature == 0.0:
                assert got.tokens == plain_generate(static.runner, prompt, 24, None).tokens
            check_bookkeeping(got, steps)


@pytest.mark.parametrize("true_branch", [0, 1])
def test_a_static_tree_keeps_the_accepted_path_where_it_lies(target_model, exported_drafter,
                                                             prompts, monkeypatch, true_branch):
    """The target's continuation as branch 0 or 1 of two at every depth: the accepted nodes'
    keys stay in the slots the verify wrote them to, between rejected siblings that no later
    query sees, and every token is still greedy decoding's, every round accepting the whole
    depth."""
    from draftsmith.serve import static_tree

    steps, max_new = 3, 21
    with engines(target_model, exported_drafter, steps, 2, 7) as (_, static):
        prompt = prompts[1]
        reference = plain_generate(static.runner, prompt, max_new + steps, None).tokens
        real_round, real_ahead = static._static_round, static.greedy_round

        def oracle_tree_after(known: int):
            """The tree proposed once `known` tokens are known, as the drafter returns it."""
            done = known - len(prompt)
            tree = true_branch_tree((reference[done:] + [0] * steps)[:steps], true_branch)
            parents = torch.tensor(tree.parents)  # [N]
            return (torch.tensor(tree.tokens), parents, torch.tensor(tree.depths),
                    static_tree.visibility(parents, steps))

        def oracle_round(tokens, aux, drafted_upto, cache):  # the prompt's round
            real_round(tokens, aux, drafted_upto, cache)  # the caches advance as usual
            return oracle_tree_after(len(tokens))

        def oracle_ahead(packed, anchors, *buffers):  # a round drafted ahead, on the device
            real_ahead(packed, anchors, *buffers)
            start, last = packed[anchors.shape[1]:].tolist()  # first anchor, last real one
            return oracle_tree_after(start + last + 2)

        monkeypatch.setattr(static, "_static_round", oracle_round)
        monkeypatch.setattr(static, "greedy_round", oracle_ahead)
        got = static.generate(prompt, max_new, None)
        assert got.tokens == reference[:max_new]
        assert got.round_tokens[:-1] == [steps + 1] * (len(got.round_tokens) - 1)
        check_bookkeeping(got, steps)


def test_a_static_tree_past_its_cache_is_refused_naming_the_capacity(target_model):
    runner = StaticTargetRunner(target_model, AUX_IDS)
    try:
        cache = runner.new_tree_cache(StaticTargetRunner.LENGTH_STEP)
        runner.forward(list(range(cache.capacity - 3)), cache)
        runner.keep_prefix(cache)
        nodes = torch.tensor([5, 6, 7])  # [3]: a root and three nodes, one slot too many
        with pytest.raises(ValueError, match="do not fit.*tree_capacity"):
            runner.forward_tree(4, cache.length, nodes, torch.tensor([1, 2, 3]),
                                torch.ones(4, 4, dtype=torch.bool).tril(), cache)
        assert cache.length == cache.capacity - 3
    finally:
        runner.close()


def test_a_tree_on_the_static_cache_needs_a_drafter_without_a_sliding_window(
        target_model, drafter):
    import copy

    windowed = copy.deepcopy(drafter)
    windowed.config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding window.*embedded_cache=auto or dynamic"):
        EmbeddedSpeculativeEngine(target_model, windowed, 3, topk=2, num_draft_tokens=6,
                                  cache="static")
    assert DeployConfig(embedded_cache="static", num_steps=3, eagle_topk=2,
                        num_draft_tokens=6).eagle_topk == 2
    assert DeployConfig().embedded_cache == "auto"


def test_static_trees_run_from_captured_steps_that_read_nothing_on_the_host(
        target_model, exported_drafter, prompts, monkeypatch):
    """With captured steps (replayed without graphs off CUDA, as on CUDA): the drafter's tree
    round, its prompt round at a captured width and the target's tree forward give the
    dynamic path's tokens and rounds, and none reads a device value on the host, which a CUDA
    graph cannot hold."""
    with engines(target_model, exported_drafter, 3, 4, 8) as (dynamic, _):
        expected = [dynamic.generate(prompt, 16, None) for prompt in prompts]
    mode = watching_captured_steps(monkeypatch)
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, 3, topk=4,
                                            num_draft_tokens=8, cache="static")
    try:
        with mode:
            for prompt, want in zip(prompts, expected, strict=True):
                got = engine.generate(prompt, 16, None)
                assert got.tokens == want.tokens
                assert got.round_tokens == want.round_tokens
        assert mode.reads == []
        assert engine.greedy_round.compiled._captures  # the tree round, captured
        assert engine.runner._tree_captured.compiled._captures  # the tree's verify forward
        assert engine.tree_verdicts.compiled._captures  # the walk and the path kept
        assert engine.steps_ran() == "replayed without graphs"
        longer = engine.runner._kv[1].layers[0].max_cache_len + 1
        engine.runner.new_tree_cache(longer)  # the old cache goes, and the graphs holding it
        assert not engine.runner._tree_captured.compiled._captures
        assert not engine.tree_verdicts.compiled._captures
    finally:
        engine.runner.close()


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_compiled_tree_verdicts_keep_what_the_eager_ones_keep(target_model, exported_drafter,
                                                              accepted):
    """`tree_verdict_steps` through inductor, as CUDA compiles it before capturing it: the
    same verdicts, drafting inputs, kept slots and a counter wound back in every layer. (The
    counters once came out right in layer 0 only: inductor re-read layer 0's counter for the
    other layers after overwriting it, and the H100's tree outputs stopped being greedy
    decoding's. The other tests compile with aot_eager, which never showed it.)"""
    steps, budget = 3, 8
    with engines(target_model, exported_drafter, steps, 4, budget) as (_, static):
        parents = torch.tensor([0, 0, 0, 1, 1, 2, 4, 3])  # [N]: a path 1 -> 4 -> 7 of depth 3
        nodes = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])  # [N]
        logits = torch.randn(budget + 1, target_model.config.vocab_size,
                             generator=torch.Generator().manual_seed(accepted))  # [N+1, V]
        for parent, child in [(0, 1), (1, 4), (4, 7)][:accepted]:  # the target follows it
            logits[parent, nodes[child - 1]] = 1e4
        new_aux = torch.randn(1, budget + 1, len(AUX_IDS) * target_model.config.hidden_size)
        results = []
        for step in (static.tree_verdict_steps, torch.compile(static.tree_verdict_steps)):
            cache = static.runner.new_tree_cache(StaticTargetRunner.LENGTH_STEP)
            prompt_and_tree = 20 + budget + 1
            for layer in cache.kv.layers:  # as after a prompt of 20 and the tree's forward
                layer.cumulative_length.fill_(prompt_and_tree)
            cache.valid[:20] = True
            out = step(logits, cache.kv, nodes, parents, new_aux, cache.valid,
                       torch.tensor([19]))
            results.append(([t.clone() for t in out], cache.valid.clone(),
                             [int(layer.cumulative_length) for layer in cache.kv.layers]))
        (eager_out, eager_valid, eager_counters), (out, valid, counters) = results
        assert int(eager_out[0][0]) == accepted
        assert eager_counters == [20 + 1 + [0, 1, 4, 7][accepted]] * len(counters)
        assert counters == eager_counters
        assert torch.equal(valid, eager_valid)
        assert all(torch.equal(a, b) for a, b in zip(out, eager_out, strict=True))


def test_auto_is_static_on_cuda_and_dynamic_elsewhere(target_model, exported_drafter):
    from types import SimpleNamespace

    from draftsmith.serve.embedded import resolve_embedded_cache

    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, NUM_STEPS)
    try:
        assert (engine.cache, engine.cache_kind) == ("auto", "dynamic")
        assert type(engine.runner) is TargetRunner
    finally:
        engine.runner.close()

    def on(device: str, **config):
        return SimpleNamespace(device=torch.device(device), config=SimpleNamespace(**config))

    assert resolve_embedded_cache("auto", on("cuda")) == "static"
    assert resolve_embedded_cache(  # a ring buffer cannot drop rejected drafts
        "auto", on("cuda", layer_types=["sliding_attention", "full_attention"])) == "dynamic"
    assert resolve_embedded_cache("auto", on("cuda", sliding_window=4096)) == "dynamic"
    assert resolve_embedded_cache("auto", on("cpu")) == "dynamic"
    assert resolve_embedded_cache("static", on("cpu")) == "static"
    assert resolve_embedded_cache("dynamic", on("cuda")) == "dynamic"
    with pytest.raises(ValueError, match="'paged': one of auto, static, dynamic"):
        resolve_embedded_cache("paged", on("cpu"))


def test_a_compiled_step_that_fails_to_build_runs_eagerly(target_model, exported_drafter,
                                                          prompts, monkeypatch, caplog):
    """On CUDA `auto` compiles the steps; a compiler or CUDA-graph failure on the user's torch
    must cost speed, not the run: the step runs eagerly, with a warning, and the tokens are
    the eager path's."""
    from draftsmith.serve import embedded

    def broken(fn, **_options):
        def build(*args, **kwargs):
            raise RuntimeError("inductor: this machine cannot build the kernel")
        return build

    monkeypatch.setattr(embedded, "compiled_once", broken)
    with engines(target_model, exported_drafter, NUM_STEPS) as (dynamic, static):
        static.runner.close()
        static.runner = StaticTargetRunner(target_model, AUX_IDS, (1, NUM_STEPS + 1),
                                           compile_steps=True)
        with caplog.at_level("WARNING", logger="draftsmith"):
            got = static.generate(prompts[0], 12, None)
        assert got.tokens == dynamic.generate(prompts[0], 12, None).tokens
        assert "embedded target step: the compiled step failed (RuntimeError: inductor" \
            in caplog.text
        # and the report's rows say so, beside the timings it gave
        assert static.steps_ran() == "eager after a failed capture: embedded target step"
        assert dynamic.steps_ran() == "eager"


def test_eager_on_failure_only_before_the_first_success():
    from draftsmith.compiling import EagerOnFailure

    calls = []

    def eager(x):
        calls.append("eager")
        return x + 1

    def flaky(x):
        if x < 0:
            raise RuntimeError("a real error, after the step was built")
        calls.append("compiled")
        return x + 1

    step = EagerOnFailure(flaky, eager, "step")
    assert step(1) == 2 and calls == ["compiled"]
    with pytest.raises(RuntimeError, match="a real error"):  # not a compiler's: the caller's
        step(-1)

    def out_of_memory(x):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        EagerOnFailure(out_of_memory, eager, "step")(1)


def test_the_compiled_steps_give_what_the_eager_ones_give(target_model, exported_drafter,
                                                          prompts, monkeypatch):
    """The 1-token and verify widths go through torch.compile (aot_eager here: dynamo's
    tracing of the hooks and the cache's counter without inductor's slow CPU build), the
    prompt eagerly; tokens and rounds are the dynamic cache's."""
    from draftsmith.serve import embedded

    monkeypatch.setattr(embedded, "compiled_once",
                        lambda fn, **_options: torch.compile(fn, backend="aot_eager"))
    with engines(target_model, exported_drafter, NUM_STEPS) as (dynamic, static):
        static.runner.close()
        static.runner = StaticTargetRunner(target_model, AUX_IDS, (1, NUM_STEPS + 1),
                                           compile_steps=True)
        widths: list[int] = []
        compiled = static.runner._forward

        def recorded(**inputs):
            widths.append(inputs["input_ids"].shape[1])
            return compiled(**inputs)

        monkeypatch.setattr(static.runner, "_forward", recorded)
        for prompt in prompts[:2]:
            expected = dynamic.generate(prompt, 12, None)
            got = static.generate(prompt, 12, None)
            assert got.tokens == expected.tokens
            assert got.round_tokens == expected.round_tokens
            assert plain_generate(static.runner, prompt, 6, None).tokens == \
                plain_generate(dynamic.runner, prompt, 6, None).tokens
        assert set(widths) == {1, NUM_STEPS + 1}


def test_each_captured_width_compiles_a_graph_of_its_own_fixed_shapes(target_model, prompts,
                                                                       monkeypatch):
    """The target's compiled forward meets a width per drafting config, on one model in a
    benchmark's sweep: 1 for plain decoding, num_steps + 1 for the deployed chain, then a
    tree's node count, with the chain's runner still open. Each width gets a graph of its own
    fixed shapes, compiled once. (torch.compile's default made the third width's graph
    symbolic in every size, and the chain's hooks, traced into it, made it compile twice: a
    tree of 8 verified after a chain cost 1.14 plain steps on an H100, the chain's own
    verify 1.02.) Each width's logits and aux states are the eager forward's."""
    from torch._dynamo.utils import get_compilation_metrics

    from draftsmith.serve import embedded

    monkeypatch.setattr(embedded, "compiled_once",
                        lambda fn, **_options: torch.compile(fn, backend="aot_eager"))
    torch._dynamo.reset()  # no graph of the forward that an earlier test compiled
    reference = TargetRunner(target_model, AUX_IDS)
    chain = StaticTargetRunner(target_model, AUX_IDS, (1, 4), compile_steps=True)
    tree = StaticTargetRunner(target_model, AUX_IDS, (1, 4, 8), compile_steps=True)
    seen = len(get_compilation_metrics())
    try:
        for runner, width in [(chain, 1), (chain, 4), (tree, 8), (chain, 4)]:
            ids = prompts[1][:width]
            logits, aux = runner.forward(ids, runner.new_cache(64))  # [T, V], [1, T, K*H]
            want_logits, want_aux = reference.forward(ids, DynamicCache())
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(aux, want_aux, rtol=1e-4, atol=1e-4)
    finally:
        for runner in (tree, chain, reference):
            runner.close()
    shapes = [m.graph_node_shapes for m in get_compilation_metrics()[seen:]
              if "input_ids" in (m.graph_node_shapes or "")]
    compiled_widths = [re.search(r"input_ids_': \[1, ([^\]]+)\]", s).group(1) for s in shapes]
    assert compiled_widths == ["1", "4", "8"], shapes
    symbolic = [s for s in shapes if re.search(r"'s\d+'", s)]
    assert not symbolic, symbolic[0]


def test_runners_on_one_target_share_its_hooks_until_the_last_closes(random_target, prompts):
    """A sweep point's runner closes while the deployed engine's runner goes on: the hooks
    stay for it, each forward records once, and they come off with the last runner (closing a
    runner twice lets go once)."""
    target = load_target_model(random_target.path)  # no other runner's hooks on it
    layer = target.model.layers[AUX_IDS[0]]
    deployed = TargetRunner(target, AUX_IDS)
    point = TargetRunner(target, AUX_IDS)
    assert len(layer._forward_hooks) == 1
    _, want_aux = point.forward(prompts[0], DynamicCache())
    point.close()
    point.close()
    _, aux = deployed.forward(prompts[0], DynamicCache())
    torch.testing.assert_close(aux, want_aux)
    deployed.close()
    assert len(layer._forward_hooks) == 0


def test_a_captured_step_compiles_past_dynamos_default_limit_of_graphs():
    """A benchmark captures a compiled step at many shapes (batch sizes, widths, cache lengths,
    an engine per sweep point). Past dynamo's default of 8 graphs a function would run
    eagerly from then on, with a warning in the log only; under CapturedStep every shape up
    to GRAPHS_PER_COMPILED_STEP is compiled, each to a graph of its own fixed shapes."""
    from torch._dynamo.utils import get_compilation_metrics

    from draftsmith.compiling import GRAPHS_PER_COMPILED_STEP, CapturedStep

    def square_plus_one(x: torch.Tensor) -> torch.Tensor:
        return x * x + 1

    step = CapturedStep(torch.compile(square_plus_one, backend="eager"), graphs=False)
    seen = len(get_compilation_metrics())
    rows = range(1, 13)
    assert len(rows) > torch._dynamo.config.recompile_limit
    assert len(rows) <= GRAPHS_PER_COMPILED_STEP
    for n in rows:
        assert torch.equal(step(torch.full((n,), 2.0)), torch.full((n,), 5.0))
    compiled = [m for m in get_compilation_metrics()[seen:] if m.co_name == "square_plus_one"]
    assert len(compiled) == len(rows)
    assert all(m.fail_type is None for m in compiled)
    assert all(f"'l_x_': [{n}]" in m.graph_node_shapes for m, n in zip(compiled, rows, strict=True))


def recording_drafts(engine) -> list[list[int]]:
    """The drafts of every round the engine drafts from here on."""
    drafts: list[list[int]] = []
    draft = engine._draft

    def recorded(*args, **kwargs):
        out = draft(*args, **kwargs)
        drafts.append(listed(out[0]))  # a copy: a captured step's output is overwritten
        return out

    engine._draft = recorded
    return drafts


@pytest.mark.parametrize("which", ["eagle3", "eagle31", "dflash"])
def test_cuda_graphed_steps_chain_without_reading_overwritten_outputs(
        which, target_model, exported_drafter, eagle31_drafter, dflash_drafter_dir, prompts,
        monkeypatch):
    """On CUDA the static path's steps are captured CUDA graphs (CapturedStep), whose outputs
    each replay overwrites, and an EAGLE-3.1 chain feeds each step's output to the next step.
    Off CUDA, CapturedStep replays the same way over the same buffers: the engine must hold no
    output past its step's next call, and then the drafts, tokens and rounds are the eager
    path's. (With torch.compile's CUDA graph trees, whose replays overwrote every earlier
    output, the first H100 run raised "accessing tensor output of CUDAGraphs that has been
    overwritten".)"""
    from draftsmith.serve import embedded

    drafter_dir, num_steps = {"eagle3": (exported_drafter, NUM_STEPS),
                              "eagle31": (eagle31_drafter[1], NUM_STEPS),
                              "dflash": (dflash_drafter_dir, BLOCK - 1)}[which]
    with engines(target_model, drafter_dir, num_steps) as (_, eager):
        eager_drafts = recording_drafts(eager)
        expected = [eager.generate(prompt, 16, None) for prompt in prompts[:2]]
    monkeypatch.setattr(embedded, "cuda_graphs", lambda device: True)
    monkeypatch.setattr(embedded, "compiled_once", lambda fn, **_options: fn)  # no inductor
    graphed = EmbeddedSpeculativeEngine.load(target_model, drafter_dir, num_steps,
                                             cache="static")
    try:
        graphed_drafts = recording_drafts(graphed)
        for prompt, want in zip(prompts[:2], expected, strict=True):
            got = graphed.generate(prompt, 16, None)
            assert got.tokens == want.tokens
            assert got.round_tokens == want.round_tokens
        assert graphed_drafts == eager_drafts
        steps = (*graphed.step_functions, graphed.runner._captured)
        assert all(isinstance(step, embedded.EagerOnFailure) and not step.failed
                   for step in steps)
        assert graphed.steps_ran() == "replayed without graphs"  # "cuda graphs" on CUDA
    finally:
        graphed.runner.close()


@pytest.mark.parametrize("which", ["eagle3", "dflash"])
def test_a_prompts_first_round_runs_at_a_captured_width(which, target_model, exported_drafter,
                                                        dflash_drafter_dir, prompts,
                                                        monkeypatch):
    """With captured steps, the drafter's first round (over the prompt's anchors: EAGLE-3's
    greedy round, DFlash's context step) is padded to a prompt width, each width captured
    when the drafter's cache is made, none later: its drafts, the tokens and the rounds are
    the dynamic path's."""
    from draftsmith.serve import embedded

    drafter_dir, num_steps = {"eagle3": (exported_drafter, NUM_STEPS),
                              "dflash": (dflash_drafter_dir, BLOCK - 1)}[which]
    monkeypatch.setattr(embedded, "cuda_graphs", lambda device: True)
    monkeypatch.setattr(embedded, "compiled_once", lambda fn, **_options: fn)
    with engines(target_model, drafter_dir, num_steps) as (dynamic, static):
        captures = static.prompt_step.compiled._captures
        widths: list[int] = []
        prompt_step = static.prompt_step
        # the anchors [1, W, K*H]: the first argument of DFlash's step, the second of EAGLE's
        anchors_at = 0 if which == "dflash" else 1
        static.prompt_step = lambda *args: widths.append(args[anchors_at].shape[1]) or \
            prompt_step(*args)
        static_drafts, dynamic_drafts = recording_drafts(static), recording_drafts(dynamic)
        for prompt in prompts[:2]:
            first, mine = len(dynamic_drafts), len(static_drafts)
            got, want = static.generate(prompt, 16, None), dynamic.generate(prompt, 16, None)
            assert got.tokens == want.tokens
            assert got.round_tokens == want.round_tokens
            assert static_drafts[mine] == dynamic_drafts[first]  # the prompt's round
        capacity = static._static_caches[0].capacity
        assert len(captures) == len(prompt_widths(capacity))
        assert widths[-2:] == [next(w for w in prompt_widths(capacity) if w >= len(prompt))
                               for prompt in prompts[:2]]
        assert widths[:-2] == prompt_widths(capacity)  # at the cache's making, then none
        assert static.steps_ran() == "replayed without graphs"


class HostReads(TorchDispatchMode):
    """Records every read of a device value on the host (.item(), .tolist(), a 0-d tensor as
    an index, `if tensor:`) made while `inside` is set. Under inference mode, bool(tensor)
    dispatches is_nonzero, not _local_scalar_dense."""

    def __init__(self):
        super().__init__()
        self.inside, self.reads = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and func in (torch.ops.aten._local_scalar_dense.default,
                                    torch.ops.aten.item.default,
                                    torch.ops.aten.is_nonzero.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def watching_captured_steps(monkeypatch) -> HostReads:
    """Engines made from here on capture their static steps as on CUDA (replayed without
    graphs, uncompiled), and the returned mode, while active, records the host reads inside
    any captured step's run."""
    from draftsmith import compiling
    from draftsmith.serve import embedded

    monkeypatch.setattr(embedded, "cuda_graphs", lambda device: True)
    monkeypatch.setattr(embedded, "compiled_once", lambda fn, **_options: fn)
    mode = HostReads()
    run = compiling.CapturedStep._run

    def watched(self, *args):
        mode.inside = True
        try:
            return run(self, *args)
        finally:
            mode.inside = False

    monkeypatch.setattr(compiling.CapturedStep, "_run", watched)
    return mode


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_every_decoder_attends_without_cudnn(cache, target_model, exported_drafter, prompts,
                                             monkeypatch):
    """SDPA's cuDNN backend plans each new shape on the host, and every prompt length is a new
    shape: in bf16 on an H100 a prompt of a new length cost 45 ms more in the prefill and up to
    0.8 s more in the drafter's first round. Every decoder, one prompt or a batch, plain or
    speculative, runs its forwards without it, and leaves the process's setting as it was."""
    from draftsmith.serve.embedded_batch import BatchedSpeculativeDecoder, plain_generate_batch

    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, NUM_STEPS,
                                            cache=cache)
    seen: list[bool] = []
    step = engine.runner.step

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return step(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", recording)
    try:
        engine.generate(prompts[0], 6, None)
        engine.replay(prompts[0], engine.generate(prompts[0], 6, None).tokens)
        plain_generate(engine.runner, prompts[0], 6, None)
        BatchedSpeculativeDecoder(engine).generate(prompts[:2], 6, None)
        plain_generate_batch(engine.runner, prompts[:2], 6, None)
    finally:
        engine.runner.close()
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("which", ["eagle3", "eagle31", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_captured_steps_read_nothing_on_the_host(which, temperature, target_model,
                                                 exported_drafter, eagle31_drafter,
                                                 dflash_drafter_dir, prompts, monkeypatch):
    """Capturing a CUDA graph fails at any host read of a device value inside the step: the
    first H200 run of the greedy chain step fell back to eager at a 0-d argmax used as an
    index. Off CUDA a captured step's replay runs its function, so its host reads show here:
    none in any captured step, greedy or sampled, one prompt or a batch, for every kind."""
    from draftsmith.serve.embedded_batch import BatchedSpeculativeDecoder

    drafter_dir, num_steps = {"eagle3": (exported_drafter, NUM_STEPS),
                              "eagle31": (eagle31_drafter[1], NUM_STEPS),
                              "dflash": (dflash_drafter_dir, BLOCK - 1)}[which]
    mode = watching_captured_steps(monkeypatch)
    engine = EmbeddedSpeculativeEngine.load(target_model, drafter_dir, num_steps,
                                            cache="static")
    try:
        with mode:
            engine.generate(prompts[0], 12, None, Sampling(temperature, seed=0))
            BatchedSpeculativeDecoder(engine).generate(
                prompts[:2], 12, None, [Sampling(temperature, seed=i) for i in range(2)])
        assert engine.steps_ran() == "replayed without graphs"
        assert mode.reads == []
    finally:
        engine.runner.close()


def listed(drafts: list[int] | torch.Tensor) -> list[int]:
    """Drafts as a list, wherever a round left them (a greedy static round: on the device)."""
    return drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts


def test_a_greedy_round_drafts_the_next_before_it_reads_the_gpu(target_model, exported_drafter,
                                                                prompts, monkeypatch):
    """On CUDA the host runs ahead of the GPU. A greedy round over static buffers hands its
    drafts to the verify forward on the device, enqueues the next round's drafting from that
    verify, and only then reads the GPU, once (the drafts and the target's verdicts
    together): the drafter's kernels run while the host keeps the accepted tokens, and the
    target's verify launches never wait for the host. Off CUDA the same flow shows as the
    order of the host's reads, with the steps replayed as CUDA's are."""
    from draftsmith.serve import embedded

    monkeypatch.setattr(embedded, "cuda_graphs", lambda device: True)
    monkeypatch.setattr(embedded, "compiled_once", lambda fn, **_options: fn)
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, NUM_STEPS,
                                            cache="static")
    events: list = []
    draft, draft_round = engine._draft, engine.greedy_round
    forward, tolist = engine.runner.forward, torch.Tensor.tolist

    def drafting(*args):
        events.append("draft")
        return draft(*args)

    def drafting_ahead(*args):
        events.append("draft")
        return draft_round(*args)

    def verifying(ids, cache, **kwargs):
        events.append(("verify", type(ids)))
        return forward(ids, cache, **kwargs)

    def reading(tensor):
        events.append("read")
        return tolist(tensor)

    monkeypatch.setattr(engine, "_draft", drafting)
    monkeypatch.setattr(engine, "greedy_round", drafting_ahead)
    monkeypatch.setattr(engine.runner, "forward", verifying)
    monkeypatch.setattr(torch.Tensor, "tolist", reading)
    mode = HostReads()
    mode.inside, mode.reads = True, events  # .item(), int(tensor) and the like, in order
    try:
        plain = plain_generate(engine.runner, prompts[1], 20, None).tokens
        events.clear()
        with mode:
            got = engine.generate(prompts[1], 20, None)
    finally:
        engine.runner.close()
    assert got.tokens == plain
    rounds = events[events.index("draft"):]
    assert rounds == ["draft", *[("verify", torch.Tensor), "draft", "read"]
                      * len(got.round_tokens)]


# The drafter's static cache (deploy.embedded_cache=static, chains) ----------------------------

@pytest.mark.parametrize("which", ["eagle3", "eagle31", "dflash"])
def test_the_static_drafter_cache_drafts_what_the_dynamic_one_drafts(
        target_model, exported_drafter, eagle31_drafter, dflash_drafter_dir, prompts, which):
    """Round after round, with every number of new anchors from 1 to num_steps + 1 (the
    padding's every width), the drafts over the drafter's static cache are the dynamic
    cache's, and the buffers are the same ones every round and generation (DFlash: one cache
    per layer, the context's keys)."""
    from draftsmith.serve.embedded import StaticDraftCache

    drafter_dir = {"eagle3": exported_drafter, "eagle31": eagle31_drafter[1],
                   "dflash": dflash_drafter_dir}[which]
    steps = BLOCK - 1 if which == "dflash" else NUM_STEPS
    with engines(target_model, drafter_dir, steps) as (dynamic, static):
        assert static._draft == (static._draft_block_static if which == "dflash"
                                 else static._draft_static)
        for prompt in prompts[:2]:
            tokens = plain_generate(dynamic.runner, prompt, 40, None).tokens
            sequence = [*prompt, *tokens]
            _, aux = dynamic.runner.forward(sequence, dynamic.runner.new_cache(len(sequence)))
            cache = static._new_drafter_cache(len(sequence) + 2 * (steps + 1))
            layers = cache if which == "dflash" else [cache]
            assert all(isinstance(c, StaticDraftCache) for c in layers)
            buffers = [(c.k.data_ptr(), c.v.data_ptr()) for c in layers]
            drafted_upto, dynamic_cache, known = 0, None, len(prompt) + 1
            advances = [1, 2, 3, 4, 4, 1, 3, 2]  # new anchors: accepted drafts + 1
            assert max(advances) == steps + 1
            for advance in advances:
                n = known - 1
                want, _, dynamic_cache = dynamic._draft(sequence[:known], aux[:, :n],
                                                        drafted_upto, dynamic_cache, Sampling())
                got, _, cache = static._draft(sequence[:known], aux[:, :n], drafted_upto,
                                              cache, Sampling())
                assert listed(got) == want
                drafted_upto, known = n, known + advance
            assert [(c.k.data_ptr(), c.v.data_ptr()) for c in layers] == buffers
        assert static._new_drafter_cache(10) is cache  # reused while it fits


def test_the_compiled_drafter_steps_keep_their_shapes(target_model, exported_drafter, prompts,
                                                      monkeypatch):
    """The drafter's steps over static buffers go through torch.compile (aot_eager here) with
    one shape each after the prompt's round: a greedy round's drafting (num_steps + 1 anchors,
    its chain steps inside), and a sampled round's step 0 (num_steps + 1 anchors) and chain
    steps (1 token). Greedy and sampled, the tokens and rounds are the dynamic cache's."""
    from draftsmith.serve import embedded

    monkeypatch.setattr(embedded, "compiled_once",
                        lambda fn, **_options: torch.compile(fn, backend="aot_eager"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: False))
    with engines(target_model, exported_drafter, NUM_STEPS) as (dynamic, static):
        greedy_round, anchor_forward, chain_forward = (
            torch.compile(f, backend="aot_eager")
            for f in (static.greedy_round_steps, static.anchor_forward, static.drafter.step))
        widths: list[tuple[str, int]] = []

        def recording(name, forward):
            def run(first, second, *args):  # (packed, anchors) or (ids, hidden or aux)
                widths.append((name, (second if name == "round" else first).shape[1]))
                return forward(first, second, *args)
            return run

        static.greedy_round = recording("round", greedy_round)
        static.step_functions = (recording("anchor", anchor_forward),
                                 recording("chain", chain_forward))
        for prompt in prompts[:2]:
            for temperature in (0.0, 0.8):
                expected = dynamic.generate(prompt, 16, None, Sampling(temperature, seed=3))
                got = static.generate(prompt, 16, None, Sampling(temperature, seed=3))
                assert got.tokens == expected.tokens
                assert got.round_tokens == expected.round_tokens
        # The prompt's anchors run eagerly: a compiled step of their width would compile
        # again for every prompt length.
        assert {w for name, w in widths if name == "round"} == {NUM_STEPS + 1}
        assert {w for name, w in widths if name == "anchor"} == {NUM_STEPS + 1}
        assert {w for name, w in widths if name == "chain"} == {1}


def test_dflash_compiled_steps_keep_their_shapes(target_model, dflash_drafter_dir, prompts,
                                                 monkeypatch):
    """DFlash over static buffers: the context step (num_steps + 1 positions after the
    prompt's, which runs eagerly) and the block step go through torch.compile (aot_eager here)
    with one shape each; the tokens and rounds are the dynamic cache's."""
    from draftsmith.serve import embedded

    monkeypatch.setattr(embedded, "compiled_once",
                        lambda fn, **_options: torch.compile(fn, backend="aot_eager"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: False))
    with engines(target_model, dflash_drafter_dir, BLOCK - 1) as (dynamic, static):
        context_forward, block_forward = (torch.compile(f, backend="aot_eager")
                                          for f in (static.context_kv, static.block_logits))
        shapes: dict[str, set] = {"context": set(), "block": set()}

        def recording(name, forward):
            def run(first, positions, *rest):
                shapes[name].add((tuple(first.shape), *(tuple(r.shape) for r in rest
                                                        if isinstance(r, torch.Tensor))))
                return forward(first, positions, *rest)
            return run

        static.step_functions = (recording("context", context_forward),
                                 recording("block", block_forward))
        for prompt in prompts[:2]:
            expected = dynamic.generate(prompt, 16, None)
            got = static.generate(prompt, 16, None)
            assert got.tokens == expected.tokens
            assert got.round_tokens == expected.round_tokens
        assert {s[0][1] for s in shapes["context"]} == {BLOCK}
        assert len(shapes["context"]) == len(shapes["block"]) == 1
