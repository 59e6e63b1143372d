"""The EAGLE-3 drafter: SGLang weight names and shapes, target parts, TTT masks, and the key
semantic property that training (forward_ttt) computes what chain drafting computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.data.vocab import build_vocab_map
from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter, ttt_masks
from tests.engine_helpers import forward_ttt

AUX_IDS = [1, 3, 4]
DRAFT_VOCAB = 256

SGLANG_KEYS = {
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def target_config(target_dir: Path) -> dict:
    return json.loads((target_dir / "config.json").read_text())


def vocab_map(vocab_size: int, draft_vocab: int = DRAFT_VOCAB):
    """A draft vocab that is not the identity: frequent ids are spread over the target vocab."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (4000,), generator=g).tolist()
    ids += [vocab_size - 1] * 50 + [vocab_size - 7] * 40  # make sure high ids get in
    d2t, t2d, _ = build_vocab_map(ids, vocab_size, draft_vocab)
    return d2t, t2d


# EAGLE-3.1: every norm option on (speculators 0.9.0 trains three of them by default).
ALL_NORMS = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": True,
             "norm_output": True}


def make_drafter(target_dir: Path, seed: int = 0, load_parts: bool = True,
                 **options) -> Eagle3Drafter:
    """options: EAGLE-3.1's norms; with any on, every norm weight is moved off its all-ones
    start, so a norm applied in the wrong place changes the output."""
    torch.manual_seed(seed)
    tcfg = target_config(target_dir)
    drafter = Eagle3Drafter(Eagle3Config.from_target(tcfg, AUX_IDS, DRAFT_VOCAB, **options))
    if load_parts:
        d2t, t2d = vocab_map(tcfg["vocab_size"])
        embed = torch.randn(tcfg["vocab_size"], tcfg["hidden_size"])
        drafter.load_target_parts(embed, d2t, t2d)
    if options:
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5, generator=g)
    return drafter.eval()


def random_row(drafter: Eagle3Drafter, T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    return ids, aux


# --------------------------------------------------------------------------- layout


def test_state_dict_keys_are_the_sglang_names(random_target_dir):
    drafter = make_drafter(random_target_dir, load_parts=False)
    assert set(drafter.state_dict()) == SGLANG_KEYS | {"embed_tokens.weight"}


def test_eagle31_norms_add_speculators_tensor_names(random_target_dir):
    drafter = make_drafter(random_target_dir, load_parts=False, **ALL_NORMS)
    sd = drafter.state_dict()
    H = drafter.config.target_hidden_size
    norms = {"input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert set(sd) == SGLANG_KEYS | {"embed_tokens.weight"} | norms
    assert sd["input_norm.weight"].shape == (3 * H,)  # one norm over the concatenation
    assert all(sd[f"fc_norm.{i}.weight"].shape == (H,) for i in range(3))  # one per aux state
    # norm_before_residual and norm_output change the computation, not the tensors.
    assert set(make_drafter(random_target_dir, load_parts=False, norm_before_residual=True,
                            norm_output=True).state_dict()) == SGLANG_KEYS | {
        "embed_tokens.weight"}


def test_each_eagle31_norm_changes_what_its_name_says(random_target_dir):
    """On the same weights: the input norms and norm_before_residual change step 0 already;
    norm_output leaves step 0 alone (logits come from norm(out) either way) and changes
    step 1, which is fed norm(out) instead of out."""
    T = 8
    base = make_drafter(random_target_dir, norm_before_fc=False)  # norms off their init too
    ids, aux = random_row(base, T)
    pos, docs = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)

    def logits(**on):
        drafter = make_drafter(random_target_dir, **on)
        drafter.load_state_dict(base.state_dict(), strict=False)  # the shared weights
        with torch.no_grad():
            return forward_ttt(drafter, ids, aux, pos, docs, 2)

    plain = logits(norm_before_fc=False)
    for name in ("norm_before_fc", "fc_norm", "norm_before_residual"):
        step0 = logits(**{name: True})[0]
        assert not torch.allclose(step0, plain[0], atol=1e-4), name
    output = logits(norm_output=True)
    torch.testing.assert_close(output[0], plain[0])
    assert not torch.allclose(output[1], plain[1], atol=1e-4)


def test_shapes_qkv_take_2h_and_fc_fuses_three_target_states(random_target_dir, random_target):
    drafter = make_drafter(random_target_dir, load_parts=False)
    H = random_target.figures["hidden_size"]
    V = random_target.figures["vocab_size"]
    cfg = drafter.config
    sd = drafter.state_dict()
    d = cfg.head_dim
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * d, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (cfg.num_key_value_heads * d, 2 * H)
    assert sd["midlayer.self_attn.v_proj.weight"].shape == (cfg.num_key_value_heads * d, 2 * H)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (H, cfg.num_attention_heads * d)
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert sd["embed_tokens.weight"].shape == (V, H)
    assert sd["d2t"].shape == (DRAFT_VOCAB,) and sd["d2t"].dtype == torch.int64
    assert sd["t2d"].shape == (V,) and sd["t2d"].dtype == torch.bool
    assert "bias" not in " ".join(sd)


def test_fc_input_is_three_times_the_target_hidden_when_it_differs(random_target_dir):
    tcfg = target_config(random_target_dir)
    cfg = Eagle3Config.from_target(tcfg, AUX_IDS, DRAFT_VOCAB).model_copy(
        update={"target_hidden_size": 96})
    drafter = Eagle3Drafter(cfg)
    assert drafter.fc.weight.shape == (tcfg["hidden_size"], 3 * 96)
    d2t, t2d = vocab_map(tcfg["vocab_size"])
    drafter.load_target_parts(torch.randn(tcfg["vocab_size"], tcfg["hidden_size"]), d2t, t2d)
    ids, aux = random_row(drafter, 6)
    docs = torch.zeros(1, 6, dtype=torch.long)
    logits = forward_ttt(drafter, ids, aux, torch.arange(6)[None], docs, 2)
    assert [tuple(x.shape) for x in logits] == [(1, 6, DRAFT_VOCAB)] * 2


def test_embed_tokens_is_nan_until_target_parts_are_loaded(random_target_dir):
    drafter = make_drafter(random_target_dir, load_parts=False)
    assert torch.isnan(drafter.embed_tokens.weight).all()
    assert not drafter.embed_tokens.weight.requires_grad
    ids, aux = random_row(drafter, 5)
    pos, docs = torch.arange(5)[None], torch.zeros(1, 5, dtype=torch.long)
    with torch.no_grad():
        forgotten = forward_ttt(drafter, ids, aux, pos, docs, 1)[0]
    assert torch.isnan(forgotten).all()

    tcfg = target_config(random_target_dir)
    embed = torch.randn(tcfg["vocab_size"], tcfg["hidden_size"])
    d2t, t2d = vocab_map(tcfg["vocab_size"])
    drafter.load_target_parts(embed, d2t, t2d)
    assert torch.equal(drafter.embed_tokens.weight, embed)
    assert torch.equal(drafter.d2t, d2t) and torch.equal(drafter.t2d, t2d)
    with torch.no_grad():
        assert torch.isfinite(forward_ttt(drafter, ids, aux, pos, docs, 1)[0]).all()


def test_load_target_parts_with_head_takes_the_draft_vocab_rows(random_target_dir):
    tcfg = target_config(random_target_dir)
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    d2t, t2d = vocab_map(V)
    draft_ids = d2t + torch.arange(DRAFT_VOCAB)
    assert not torch.equal(draft_ids, torch.arange(DRAFT_VOCAB))  # a non-trivial map
    assert torch.equal(draft_ids, torch.nonzero(t2d).flatten())
    head = torch.randn(V, H)

    drafter = make_drafter(random_target_dir, load_parts=False)
    before = drafter.lm_head.weight.detach().clone()
    drafter.load_target_parts(torch.randn(V, H), d2t, t2d)
    assert torch.equal(drafter.lm_head.weight, before)  # no head given: left as it was

    drafter.load_target_parts(torch.randn(V, H), d2t, t2d, target_head=head)
    assert torch.equal(drafter.draft_to_target_ids(), draft_ids)
    for i in (0, 17, DRAFT_VOCAB - 1):
        assert torch.equal(drafter.lm_head.weight[i], head[int(draft_ids[i])])
    assert torch.equal(drafter.lm_head.weight, head[draft_ids])


# --------------------------------------------------------------------------- masks


def test_ttt_masks_match_a_hand_built_mask_for_two_documents():
    docs = torch.tensor([[0, 0, 0, 1, 1]])
    T = 5
    step0 = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    eye = torch.eye(T, dtype=torch.bool)
    expected = [step0, torch.cat([step0, eye], 1), torch.cat([step0, eye, eye], 1)]
    masks = ttt_masks(docs, 3)
    assert len(masks) == 3
    for j, (got, want) in enumerate(zip(masks, expected, strict=True)):
        assert got.dtype == torch.bool
        assert got.shape == (1, 1, T, (j + 1) * T)
        assert torch.equal(got[0, 0], want), f"step {j}"


def test_ttt_masks_per_row_in_a_batch():
    docs = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    step0 = ttt_masks(docs, 1)[0]
    assert step0.shape == (2, 1, 4, 4)
    assert not step0[0, 0, 2, 1] and step0[1, 0, 2, 1]  # doc boundary only in row 0
    assert torch.equal(step0[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())


# --------------------------------------------------------------------------- semantics


def chain_logits(drafter: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, t: int,
                 steps: int) -> list[torch.Tensor]:
    """What chain drafting computes for anchor t, with ground-truth tokens as the chain input:
    step 0 over anchors 0..t (causal), then one token per step with an explicit KV cache."""
    n = t + 1
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    hidden = drafter.project_aux(aux[:, :n])
    out, logits, (k, v) = drafter.step(ids[:, 1 : n + 1], hidden, torch.arange(n)[None], None,
                                       causal)
    result = [logits[0, t]]
    past = (k, v)
    hidden = out[:, t : t + 1]
    for j in range(1, steps):
        token = ids[:, t + j + 1 : t + j + 2]  # ground truth token t+j+1
        out, logits, (k, v) = drafter.step(token, hidden, torch.tensor([[t + j]]), past, None)
        past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        hidden = out
        result.append(logits[0, -1])
    return result


@pytest.mark.parametrize("norms", [{}, ALL_NORMS], ids=["eagle3", "eagle3.1"])
def test_forward_ttt_equals_incremental_chain_drafting(random_target_dir, norms):
    drafter = make_drafter(random_target_dir, **norms)
    T, steps = 10, 3
    ids, aux = random_row(drafter, T)
    with torch.no_grad():
        ttt = forward_ttt(drafter, ids, aux, torch.arange(T)[None],
                                  torch.zeros(1, T, dtype=torch.long), steps)
        checked = 0
        for t in range(T - steps):  # token t+steps must exist
            chain = chain_logits(drafter, ids, aux, t, steps)
            for j in range(steps):
                torch.testing.assert_close(ttt[j][0, t], chain[j], rtol=1e-4, atol=1e-5,
                                           msg=f"step {j} anchor {t}")
                checked += 1
    assert checked == (T - steps) * steps
    # The steps differ from each other (a chain that ignores its input would pass trivially).
    assert not torch.allclose(ttt[0], ttt[1]) and not torch.allclose(ttt[1], ttt[2])


def test_forward_ttt_differs_from_full_attention_over_later_steps(random_target_dir,
                                                                 monkeypatch):
    """Sanity of the comparison above: attending to all step-1 keys instead of the diagonal
    gives different logits, so the diagonal mask matters."""
    import draftsmith.model.eagle3.model as eagle3

    drafter = make_drafter(random_target_dir)
    T = 8
    ids, aux = random_row(drafter, T)
    pos, docs = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    with torch.no_grad():
        good = forward_ttt(drafter, ids, aux, pos, docs, 2)
        masks = ttt_masks(docs, 2)
        masks[1][..., T:] = torch.ones(T, T, dtype=torch.bool).tril()
        monkeypatch.setattr(eagle3, "ttt_masks", lambda d, s, w=None: masks)
        bad = forward_ttt(drafter, ids, aux, pos, docs, 2)
    torch.testing.assert_close(good[0], bad[0])
    assert not torch.allclose(good[1][0, 1:], bad[1][0, 1:], atol=1e-4)


def test_packed_documents_do_not_see_each_other(random_target_dir):
    drafter = make_drafter(random_target_dir)
    n0, n1, steps = 6, 7, 3
    T = n0 + n1
    ids, aux = random_row(drafter, T, seed=2)
    pos = torch.cat([torch.arange(n0), torch.arange(n1)])[None]
    docs = torch.cat([torch.zeros(n0), torch.ones(n1)]).long()[None]
    other_ids, other_aux = random_row(drafter, T, seed=3)

    def run(i, a):
        with torch.no_grad():
            return [x[0] for x in forward_ttt(drafter, i, a, pos, docs, steps)]

    base = run(ids, aux)
    # Change every token and aux state of document 1: document 0 is unaffected wherever the
    # tokens it reads (up to t+j+2, what its loss looks at) are its own.
    ids1, aux1 = ids.clone(), aux.clone()
    ids1[:, n0:], aux1[:, n0:] = other_ids[:, n0:], other_aux[:, n0:]
    changed1 = run(ids1, aux1)
    for j in range(steps):
        valid = n0 - j - 2
        torch.testing.assert_close(base[j][:valid], changed1[j][:valid], rtol=0, atol=1e-6)
        assert not torch.allclose(base[j][n0:n0 + 2], changed1[j][n0:n0 + 2])

    # And the other way round: document 1 ignores document 0 (block-diagonal, not just causal).
    ids0, aux0 = ids.clone(), aux.clone()
    ids0[:, :n0], aux0[:, :n0] = other_ids[:, :n0], other_aux[:, :n0]
    changed0 = run(ids0, aux0)
    for j in range(steps):
        torch.testing.assert_close(base[j][n0:T - j - 1], changed0[j][n0:T - j - 1],
                                   rtol=1e-5, atol=1e-6)

    # Document 1 packed after document 0 gives what document 1 alone gives.
    with torch.no_grad():
        alone = forward_ttt(drafter, ids[:, n0:], aux[:, n0:], torch.arange(n1)[None],
                                    torch.zeros(1, n1, dtype=torch.long), steps)
    for j in range(steps):
        torch.testing.assert_close(base[j][n0:T - j - 1], alone[j][0, : n1 - j - 1],
                                   rtol=1e-4, atol=1e-5)


def per_step_ttt(drafter: Eagle3Drafter, ids, aux, pos, docs, steps: int) -> list[torch.Tensor]:
    """TTT as written in the paper's terms: at every step the embeddings of tokens t+j+1 are
    looked up and concatenated with the hidden input, and the whole [T, 2H] goes through q, k
    and v (no projection shared between steps)."""
    from draftsmith.model.eagle3.model import shift_left

    masks = ttt_masks(docs, steps)
    hidden = drafter.project_aux(aux)  # [1, T, H]
    keys, values, normed = [], [], []
    for j in range(steps):
        embeds = drafter.embed_tokens(shift_left(ids, j + 1))  # [1, T, H]
        cos, sin = drafter.rope(hidden, pos + j)
        past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
        hidden, (k, v) = drafter.midlayer(embeds, hidden, cos, sin, past, masks[j])
        keys.append(k)
        values.append(v)
        normed.append(drafter.norm(hidden))  # [1, T, H]
    return normed


def test_embedding_projections_shared_by_the_steps_give_the_per_step_outputs_and_gradients(
        random_target_dir, monkeypatch):
    """Training projects the embedding half of q, k and v once a row and gives step j its
    window j: outputs and every parameter's gradient equal per-step projection. A window one
    step off is caught."""
    import draftsmith.model.eagle3.model as eagle3

    drafter = make_drafter(random_target_dir).train()
    T, steps = 23, 3
    ids, aux = random_row(drafter, T, seed=4)
    pos = torch.cat([torch.arange(15), torch.arange(8)])[None]
    docs = torch.cat([torch.zeros(15), torch.ones(8)]).long()[None]
    probe = [torch.randn(1, T, drafter.config.hidden_size, generator=torch.Generator()
                         .manual_seed(j)) for j in range(steps)]

    def outputs_and_grads(fn):
        drafter.zero_grad()
        normed = fn(drafter, ids, aux, pos, docs, steps)
        sum((x * p).sum() for x, p in zip(normed, probe, strict=True)).backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        return [x.detach() for x in normed], grads

    reference, reference_grads = outputs_and_grads(per_step_ttt)
    shared, shared_grads = outputs_and_grads(Eagle3Drafter.forward_ttt_hidden)
    assert set(shared_grads) == set(reference_grads) and "midlayer.input_layernorm.weight" in \
        shared_grads
    for j in range(steps):
        torch.testing.assert_close(shared[j], reference[j], rtol=1e-5, atol=1e-5)
    for name, grad in reference_grads.items():  # float32 rounding: relative to the largest
        error = (shared_grads[name] - grad).abs().max() / grad.abs().max()
        assert error < 1e-5, f"{name}: gradients differ by {error:.2e} of the largest"

    real_layer = Eagle3Drafter.layer_and_norm
    monkeypatch.setattr(Eagle3Drafter, "layer_and_norm",
                        lambda self, qkv, offset, *a: real_layer(self, qkv, max(offset - 1, 0),
                                                                 *a))
    off_by_one, _ = outputs_and_grads(eagle3.Eagle3Drafter.forward_ttt_hidden)
    torch.testing.assert_close(off_by_one[0], reference[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(off_by_one[2], reference[2], atol=1e-3)


@pytest.mark.parametrize("steps", [1, 4])
def test_forward_ttt_returns_one_logit_tensor_per_step(random_target_dir, steps):
    drafter = make_drafter(random_target_dir)
    ids, aux = random_row(drafter, 7)
    out = forward_ttt(drafter, ids, aux, torch.arange(7)[None], torch.zeros(1, 7, dtype=torch.long),
                              steps)
    assert len(out) == steps
    assert all(x.shape == (1, 7, DRAFT_VOCAB) for x in out)
    out[-1].sum().backward()  # gradients flow through the unrolled steps to fc
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    assert drafter.embed_tokens.weight.grad is None


# --------------------------------------------------------------------------- flex attention


def hand_built_ttt_mask(docs: list[int], steps: int) -> list[torch.Tensor]:
    """Written out pair by pair from EAGLE-3's test-time training: a query at anchor q of step j may
    see step-0 key k when k <= q in the same document, and key k of step i in 1..j only when
    k == q."""
    T = len(docs)
    masks = []
    for j in range(steps):
        m = torch.zeros(T, (j + 1) * T, dtype=torch.bool)
        for q in range(T):
            for i in range(j + 1):
                for k in range(T):
                    m[q, i * T + k] = (k <= q and docs[k] == docs[q]) if i == 0 else k == q
        masks.append(m)
    return masks


def test_flex_mask_matches_a_hand_built_dense_mask_for_steps_0_to_k():
    from torch.nn.attention.flex_attention import create_mask

    from draftsmith.model.eagle3.model import ttt_block_masks, ttt_mask_mod

    docs = [0, 0, 0, 1, 1, 2, 2, 2, -1, -1]  # three documents and two padding tokens
    T, steps = len(docs), 4
    doc_t = torch.tensor([docs])
    expected = hand_built_ttt_mask(docs, steps)
    mask_mod = ttt_mask_mod(doc_t, T)
    for j in range(steps):
        flex = create_mask(mask_mod, 1, None, T, (j + 1) * T, device="cpu")  # [1, 1, T, (j+1)T]
        assert torch.equal(flex[0, 0], expected[j]), f"flex step {j}"
        assert torch.equal(ttt_masks(doc_t, steps)[j][0, 0], expected[j]), f"dense step {j}"
    blocks = ttt_block_masks(doc_t, steps)
    assert [b.shape[-1] for b in blocks] == [(j + 1) * T for j in range(steps)]
    # Padding only sees padding: no real token attends to it, and it attends to no real token.
    assert not expected[0][:8, 8:].any() and not expected[0][8:, :8].any()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_gives_the_sdpa_outputs_on_a_packed_row():
    """The CPU half of the equivalence check (flex_attention has no backward on a CPU); the
    GPU half, with gradients, ran on an H200 (docs/results/training-speed.md)."""
    from draftsmith.model.attention_check import compare_attention_paths

    result = compare_attention_paths("cpu", doc_lengths=[40, 3, 70, 15], steps=3, grads=False)
    assert result["output_max_abs"] > 1.0  # outputs are not trivially small
    assert max(result["output_max_diff"]) < 1e-5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_and_sdpa_differ_when_the_mask_is_wrong(monkeypatch):
    """The comparison above can fail: a mask_mod without the document condition differs."""
    import draftsmith.model.eagle3.model as eagle3
    from draftsmith.model.attention_check import compare_attention_paths

    def leaky(document_ids, T, window=None):
        def mask_mod(b, h, q_idx, kv_idx):
            kv_step = kv_idx // T
            kv_pos = kv_idx - kv_step * T
            return ((kv_step == 0) & (kv_pos <= q_idx)) | ((kv_step > 0) & (kv_pos == q_idx))
        return mask_mod

    monkeypatch.setattr(eagle3, "ttt_mask_mod", leaky)
    result = compare_attention_paths("cpu", doc_lengths=[40, 30], steps=2, grads=False)
    assert max(result["output_max_diff"]) > 1e-3


def test_merged_path_gives_the_sdpa_outputs_and_gradients_on_a_packed_row():
    """The merged path (a causal kernel per document, the TTT diagonals merged in by
    log-sum-exp, gradients from the kernel's backward given the merged output) with its float32
    reference kernel, against SDPA over the dense mask: outputs and every parameter's
    gradient. The cuDNN and FlashAttention kernels keep the same contract (on a GPU:
    `python -m draftsmith.model.attention_check --device cuda --path cudnn`)."""
    from draftsmith.model.attention_check import compare_attention_paths

    result = compare_attention_paths("cpu", doc_lengths=[40, 3, 70, 15], steps=3, grads=True,
                                     path="reference")
    assert result["output_max_abs"] > 1.0
    assert max(result["output_max_diff"]) < 1e-5
    assert max(result["grad_max_rel_diff"].values()) < 1e-5


def test_merged_path_differs_when_documents_leak(monkeypatch):
    """The comparison above can fail: one segment for the whole row lets documents see each
    other."""
    from draftsmith.model import ttt_attention
    from draftsmith.model.attention_check import compare_attention_paths

    monkeypatch.setattr(ttt_attention, "document_segments",
                        lambda ids: ((0, ids.numel()),))
    result = compare_attention_paths("cpu", doc_lengths=[40, 30], steps=2, grads=False,
                                     path="reference")
    assert max(result["output_max_diff"]) > 1e-3


def test_packed_rows_carry_their_documents_on_the_host():
    from draftsmith.extract.store import Sample
    from draftsmith.model.ttt_attention import document_segments
    from draftsmith.train.packing import concat_row, padding_row

    def sample(n):
        return Sample(id=f"s{n}", input_ids=torch.arange(n), loss_mask=torch.ones(n),
                      aux=torch.zeros(n, 6), final=torch.zeros(n, 2))

    row = concat_row([sample(5), sample(3), sample(4)], row_tokens=8, pad_to=16)
    assert row.documents == ((0, 5), (5, 8), (8, 12), (12, 16))  # the last run is padding
    assert row.documents == document_segments(row.document_ids)
    assert row.map(lambda t: t.clone()).documents == row.documents
    assert all(isinstance(t, torch.Tensor) for t in row.tensors())
    assert padding_row(sample(2), 7).documents == ((0, 7),)


def test_hf_config_fields_map_to_the_drafter_and_back(random_target_dir):
    """One mapping between Hugging Face config fields and Eagle3Config serves the target's
    config, the exported drafter configs and LlamaConfig; it reads transformers 5's
    rope_parameters too."""
    tcfg = target_config(random_target_dir)
    cfg = Eagle3Config.from_target(tcfg, AUX_IDS, DRAFT_VOCAB)
    rest = {"draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": cfg.target_hidden_size,
            "aux_layer_ids": AUX_IDS}
    assert Eagle3Config.from_hf(cfg.hf_fields(), **rest) == cfg
    assert cfg.llama_config().num_hidden_layers == 1
    assert cfg.llama_config().intermediate_size == cfg.intermediate_size
    scaled = {k: v for k, v in tcfg.items() if k not in ("rope_theta", "rope_scaling")}
    scaled["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    parsed = Eagle3Config.from_hf(scaled, **rest)
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
