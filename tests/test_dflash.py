"""The DFlash drafter: its training forward (anchored blocks of a packed row) against drafting
one block at a time, the masks, the block loss and its counts, export and import in the
speculators layout, and lossless block drafting in the embedded engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.data.vocab import build_vocab_map
from draftsmith.export.convert import export_drafter, import_drafter, read_drafter
from draftsmith.export.formats import ExportError
from draftsmith.model.dflash.loss import anchors_of, block_row_loss_on_device
from draftsmith.model.dflash.model import (
    DFlashConfig,
    DFlashDrafter,
    anchored_dense_mask,
    anchored_mask_mod,
)
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine, Sampling, plain_generate
from draftsmith.target import load_target_head_and_embedding, load_target_model
from tests.test_eagle3 import vocab_map

AUX_IDS = [1, 3, 4]
DRAFT_VOCAB = 256
BLOCK = 4
MASK = 5


def make_dflash(target_dir: Path, seed: int = 0, causal: bool = False, layers: int = 2,
                draft_vocab: int = DRAFT_VOCAB, embed: torch.Tensor | None = None
                ) -> DFlashDrafter:
    """A DFlash drafter on the target's shape, every norm moved off its all-ones start."""
    torch.manual_seed(seed)
    tcfg = json.loads((target_dir / "config.json").read_text())
    cfg = DFlashConfig.from_target(tcfg, AUX_IDS, draft_vocab, num_hidden_layers=layers,
                                   block_size=BLOCK, mask_token_id=MASK, causal=causal)
    drafter = DFlashDrafter(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    d2t, t2d = vocab_map(tcfg["vocab_size"], draft_vocab)
    if embed is None:
        embed = torch.randn(tcfg["vocab_size"], tcfg["hidden_size"], generator=g)
    drafter.load_target_parts(embed, d2t, t2d)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=g)
    return drafter.eval()


def random_row(cfg: DFlashConfig, T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    aux = torch.randn(T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    return ids, aux


def one_block(drafter: DFlashDrafter, ids, aux, positions, anchor: int) -> torch.Tensor:
    """What drafting computes at `anchor`: the context of positions 0..anchor-1, then the block
    [x_anchor, mask, ...] at positions anchor.. (the embedded engine's and vLLM's way)."""
    context = drafter.context(aux[None, :anchor])
    kv = drafter.context_kv(context, positions[None, :anchor])
    B = drafter.config.block_size
    block = drafter.block_ids(ids[anchor:anchor + 1], B)
    mask = torch.cat([torch.ones(B, anchor, dtype=torch.bool),
                      drafter.within_block(B, "cpu")], dim=1)[None, None]
    return drafter.block_hidden(block, positions[anchor] + torch.arange(B)[None], kv,
                                mask)[0]  # [B, H]


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_training_blocks_equal_drafting_one_block_at_a_time(random_target_dir, causal):
    drafter = make_dflash(random_target_dir, causal=causal)
    T = 14
    ids, aux = random_row(drafter.config, T)
    positions = torch.arange(T)
    anchors = torch.tensor([1, 2, 5, 9, 10])
    with torch.no_grad():
        blocks = drafter.forward_blocks(ids, aux, positions, torch.zeros(T, dtype=torch.long),
                                        anchors)  # [A, B, H]
        for j, a in enumerate(anchors.tolist()):
            torch.testing.assert_close(blocks[j], one_block(drafter, ids, aux, positions, a),
                                       rtol=1e-4, atol=1e-5, msg=f"anchor {a}")
        # The flag matters: the anchor sees the masks after it only without causality.
        other = make_dflash(random_target_dir, causal=not causal)
        other.load_state_dict(drafter.state_dict())
        flipped = other.forward_blocks(ids, aux, positions, torch.zeros(T, dtype=torch.long),
                                       anchors)
    assert not torch.allclose(blocks[:, 0], flipped[:, 0], atol=1e-5)


def test_blocks_of_packed_documents_see_only_their_own_document(random_target_dir):
    drafter = make_dflash(random_target_dir)
    n0, n1 = 7, 8
    ids, aux = random_row(drafter.config, n0 + n1)
    docs = torch.tensor([0] * n0 + [1] * n1)
    positions = torch.cat([torch.arange(n0), torch.arange(n1)])  # restart per document
    anchors = torch.tensor([n0 + 3])
    with torch.no_grad():
        packed = drafter.forward_blocks(ids, aux, positions, docs, anchors)[0]
        alone = drafter.forward_blocks(ids[n0:], aux[n0:], positions[n0:],
                                       torch.zeros(n1, dtype=torch.long),
                                       torch.tensor([3]))[0]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True])
def test_flex_mask_is_the_dense_mask(causal):
    from torch.nn.attention.flex_attention import create_mask

    docs = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, -1])
    anchors = torch.tensor([1, 3, 4, 6, 9])
    dense = anchored_dense_mask(docs, anchors, BLOCK, causal)[0, 0]
    T, Q = docs.numel(), anchors.numel() * BLOCK
    flex = create_mask(anchored_mask_mod(docs, anchors, BLOCK, causal, T), 1, 1, Q, T + Q,
                       device="cpu")[0, 0]
    assert torch.equal(dense, flex)
    # Hand-checked: block 1 (anchor 3) sees positions 0..2 of document 0 and its own block;
    # block 2 (anchor 4, the first of document 1) sees no context; the padding anchor nothing.
    assert dense[BLOCK, :T].tolist() == [True] * 3 + [False] * 7
    assert not dense[2 * BLOCK, :T].any() and not dense[4 * BLOCK, :T].any()
    own = dense[BLOCK:2 * BLOCK, T + BLOCK:T + 2 * BLOCK]
    assert torch.equal(own, torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril() if causal
                       else torch.ones(BLOCK, BLOCK, dtype=torch.bool))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_gives_the_sdpa_blocks_on_a_packed_row(random_target_dir):
    """The CUDA path (flex attention over the block mask) against the dense-mask SDPA path,
    run eagerly here: the same blocks, padding anchors included."""
    drafter = make_dflash(random_target_dir)
    docs = torch.tensor([0] * 9 + [1] * 7)
    positions = torch.cat([torch.arange(9), torch.arange(7)])
    ids, aux = random_row(drafter.config, 16)
    anchors = torch.tensor([0, 2, 5, 9, 12, 0])
    with torch.no_grad():
        dense = drafter.forward_blocks(ids, aux, positions, docs, anchors, "sdpa")
        flex = drafter.forward_blocks(ids, aux, positions, docs, anchors, "flex")
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the block loss


def packed_row(cfg: DFlashConfig, docs: list[int], loss_mask: list[int], seed: int = 1):
    from draftsmith.train.packing import PackedRow

    T = len(docs)
    g = torch.Generator().manual_seed(seed)
    docs_t = torch.tensor(docs)
    positions = torch.cat([torch.arange(int((docs_t == d).sum())) for d in docs_t.unique()])
    return PackedRow(input_ids=torch.randint(0, cfg.vocab_size, (T,), generator=g),
                     loss_mask=torch.tensor(loss_mask).bool(),
                     aux=torch.randn(T, 3 * cfg.target_hidden_size, generator=g),
                     final=torch.randn(T, cfg.target_hidden_size, generator=g),
                     position_ids=positions, document_ids=docs_t)


def test_block_loss_counts_what_greedy_block_drafting_accepts(random_target_dir):
    """Position k of the block at anchor a counts when token a+k is assistant text of a's
    document; it is right when the drafter's argmax there is the target's argmax for token
    a+k; full_acc counts runs of right drafts from k = 1, and the runs laid out for replay are
    the accepted drafts of each round: all written out here anchor by anchor."""
    drafter = make_dflash(random_target_dir, draft_vocab=512)  # full vocab: every argmax in it
    cfg = drafter.config
    docs = [0] * 9 + [1] * 7
    mask = [0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    row = packed_row(cfg, docs, mask)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    # Steer the target's argmax to the drafter's guess at some positions, so runs are > 0.
    loss, counts, runs = block_row_loss_on_device(drafter, row, head, BLOCK - 1,
                                                  [1.0, 0.5, 0.25], "cpu", with_runs=True)
    assert anchors_of(row, "cpu").tolist() == [1, 2, 3, 4, 6, 7, 10, 11, 12, 13, 14]
    target_arg = (row.final @ head.T).argmax(-1)  # [T] the target's guess of token t+1
    to_target = drafter.draft_to_target_ids()
    T = len(docs)
    positions, chain_correct, prefix_correct = [0] * 3, [0] * 3, [0] * 3
    expected_runs = [0] * T
    with torch.no_grad():
        for a in anchors_of(row, "cpu").tolist():
            hidden = one_block(drafter, row.input_ids, row.aux, row.position_ids, a)  # [B, H]
            chain = True
            for k in range(1, BLOCK):
                exists = a + k < T
                right = exists and int(to_target[drafter.lm_head(hidden[k]).argmax()]) == int(
                    target_arg[a + k - 1])
                before, chain = chain, chain and right
                expected_runs[a - 1] += int(chain and exists)
                if exists and mask[a + k] and docs[a + k] == docs[a]:
                    positions[k - 1] += 1
                    chain_correct[k - 1] += int(chain)
                    prefix_correct[k - 1] += int(before)
    assert counts[2].tolist() == positions and positions[0] == 11
    assert counts[3].tolist() == chain_correct
    assert counts[4].tolist() == prefix_correct
    assert counts[1].tolist() == positions  # full vocab: every counted position has a loss
    assert runs.tolist() == expected_runs
    assert torch.isfinite(loss) and loss > 0
    drafter.train()
    loss, _ = block_row_loss_on_device(drafter, row, head, BLOCK - 1, [1.0, 0.5, 0.25], "cpu",
                                       max_anchors=4)
    loss.backward()
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert drafter.embed_tokens.weight.grad is None  # the target's, frozen


def test_training_samples_anchors_by_seed_and_pads_to_static_shapes(random_target_dir):
    drafter = make_dflash(random_target_dir, draft_vocab=512)
    cfg = drafter.config
    row = packed_row(cfg, [0] * 16, [0, 0] + [1] * 14)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    run = lambda seed, **kw: block_row_loss_on_device(  # noqa: E731
        drafter, row, head, BLOCK - 1, [1.0, 1.0, 1.0], "cpu", noise_seed=seed, max_anchors=3,
        **kw)
    with torch.no_grad():
        first, counts = run(7)
        again, _ = run(7)
        other, _ = run(8)
        padded, padded_counts = run(7, pad_anchors=True)
    assert first == again and first != other  # the step's seed picks the anchors
    assert counts[2, 0] == 3  # max_anchors blocks
    torch.testing.assert_close(padded, first)  # padding blocks carry nothing
    assert torch.equal(padded_counts, counts)


# --------------------------------------------------------------------------- export, import


def test_speculators_export_is_what_vllm_reads_and_round_trips(random_target_dir, tmp_path):
    drafter = make_dflash(random_target_dir, causal=True)
    config = export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama",
                            tmp_path / "vllm", extras={"verifier": {"name_or_path": "/t"}})
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [c + 1 for c in AUX_IDS]  # vLLM: inputs
    assert config["mask_token_id"] == MASK and config["block_size"] == BLOCK
    assert config["sliding_window_non_causal"] is False  # vLLM: causal = not this
    assert config["sample_from_anchor"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    back = read_drafter(tmp_path / "vllm")
    assert back.kind == "dflash" and back.config == drafter.config
    import_drafter(tmp_path / "vllm", tmp_path / "native")
    native = read_drafter(tmp_path / "native")
    for name, tensor in drafter.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(native.tensors[name], tensor), name
    with pytest.raises(ExportError, match="unknown layout 'sglang' for a dflash drafter"):
        export_drafter(drafter.state_dict(), drafter.config, "sglang", "llama", tmp_path / "s")
    from typer.testing import CliRunner

    from draftsmith.cli import app

    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "vllm")])
    assert shown.exit_code == 0, shown.output
    assert "kind: dflash" in shown.output and f"block_size: {BLOCK}" in shown.output


def test_dflash_files_draftsmith_cannot_run_are_refused(random_target_dir, tmp_path):
    drafter = make_dflash(random_target_dir)
    out = tmp_path / "vllm"
    export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama", out)
    config = json.loads((out / "config.json").read_text())
    for edit, words in (({"sample_from_anchor": True}, "sample_from_anchor"),
                        ({"dflash_config": {"use_swa": True}}, "use_swa")):
        (out / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ExportError, match=words):
            read_drafter(out)
    (out / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "model.safetensors"))
    weights.pop("layers.1.self_attn.k_norm.weight")
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        read_drafter(out)


# --------------------------------------------------------------------------- embedded engine


@pytest.fixture(scope="module")
def dflash_engine(random_target, random_target_dir, tmp_path_factory):
    """A DFlash drafter whose lm_head starts from the target's head (so it drafts the
    target's likely tokens sometimes), exported and loaded by the embedded engine."""
    embed, head = load_target_head_and_embedding(random_target)
    tcfg = json.loads((random_target_dir / "config.json").read_text())
    d2t, t2d, _ = build_vocab_map(list(range(tcfg["vocab_size"])), tcfg["vocab_size"],
                                  tcfg["vocab_size"])
    drafter = make_dflash(random_target_dir, draft_vocab=tcfg["vocab_size"], embed=embed)
    drafter.load_target_parts(embed, d2t, t2d, target_head=head)
    out = tmp_path_factory.mktemp("dflash-drafter")
    export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama", out)
    engine = EmbeddedSpeculativeEngine.load(load_target_model(random_target.path), out,
                                            num_steps=BLOCK - 1)
    yield drafter, engine
    engine.runner.close()


def test_block_drafting_is_lossless_and_drafts_what_the_drafter_computes(
        dflash_engine, random_target_tokenizer, monkeypatch):
    drafter, engine = dflash_engine
    real, calls = engine._draft, []

    def recorded(tokens, aux, drafted_upto, cache, sampling):
        drafts, probs, cache = real(tokens, aux, drafted_upto, cache, sampling)
        calls.append((list(tokens), drafts))
        return drafts, probs, cache

    monkeypatch.setattr(engine, "_draft", recorded)
    for text in ("def add(a, b):\n", "x = [1, 2, 3]"):
        prompt = random_target_tokenizer.encode(text)
        got = engine.generate(prompt, 20, None)
        assert got.tokens == plain_generate(engine.runner, prompt, 20, None).tokens
        assert sum(got.round_tokens) == len(got.tokens) - 1
        assert all(1 <= n <= BLOCK for n in got.round_tokens)
    from draftsmith.extract.capture import HiddenStateCapture

    to_target = drafter.draft_to_target_ids()
    for tokens, drafts in calls:  # from scratch: a fresh target forward, one block
        n = len(tokens) - 1
        ids = torch.tensor([tokens])
        aux, _ = HiddenStateCapture(engine.runner.model, AUX_IDS)(
            ids[:, :n], torch.ones(1, n, dtype=torch.long))
        with torch.no_grad():
            hidden = one_block(drafter, ids[0], aux[0], torch.arange(len(tokens)), n)
            expected = [int(to_target[drafter.lm_head(h).argmax()]) for h in hidden[1:]]
        assert drafts == expected


def test_replay_of_its_own_output_makes_the_block_engines_rounds(dflash_engine,
                                                                 random_target_tokenizer):
    _, engine = dflash_engine
    for text in ("def add(a, b):\n", "x = [1, 2, 3]"):
        prompt = random_target_tokenizer.encode(text)
        made = engine.generate(prompt, 20, None)
        assert engine.replay(prompt, made.tokens).round_tokens == made.round_tokens


def test_block_drafting_sampled_keeps_the_target_distribution_machinery(
        dflash_engine, random_target_tokenizer):
    """Sampled: drafts come with their distributions; the run is reproducible by seed."""
    _, engine = dflash_engine
    prompt = random_target_tokenizer.encode("def add(a, b):\n")
    one = engine.generate(prompt, 16, None, Sampling(0.8, seed=3))
    two = engine.generate(prompt, 16, None, Sampling(0.8, seed=3))
    assert one.tokens == two.tokens and len(one.tokens) == 16


def test_the_engine_refuses_what_a_block_cannot_draft(dflash_engine):
    drafter, engine = dflash_engine
    with pytest.raises(ValueError, match="at most block_size - 1 = 3 tokens"):
        EmbeddedSpeculativeEngine(engine.runner.model, drafter, num_steps=BLOCK)
    with pytest.raises(ValueError, match="no tree"):
        EmbeddedSpeculativeEngine(engine.runner.model, drafter, num_steps=2, topk=2)


def test_a_wider_mlp_is_built_exported_and_read_back(random_target_dir, tmp_path):
    """drafter.intermediate_size reaches both kinds' shapes through the registry, and the
    speculators export carries it to vLLM's config (read back as the same shape)."""
    from draftsmith.config import DrafterConfig
    from draftsmith.model.kinds import build_drafter, kind_named

    tcfg = json.loads((random_target_dir / "config.json").read_text())
    wide = 3 * tcfg["intermediate_size"]
    eagle = kind_named("eagle3").build_config(tcfg, AUX_IDS, DRAFT_VOCAB,
                                              DrafterConfig(intermediate_size=wide))
    assert eagle.intermediate_size == wide
    assert kind_named("eagle3").build_config(
        tcfg, AUX_IDS, DRAFT_VOCAB, DrafterConfig()).intermediate_size == tcfg["intermediate_size"]
    settings = DrafterConfig(kind="dflash", intermediate_size=wide,
                             dflash={"mask_token_id": MASK, "block_size": BLOCK})
    cfg = kind_named("dflash").build_config(tcfg, AUX_IDS, DRAFT_VOCAB, settings)
    drafter = build_drafter(cfg)
    assert drafter.layers[0].mlp.gate_proj.weight.shape == (wide, tcfg["hidden_size"])
    d2t, t2d = vocab_map(tcfg["vocab_size"], DRAFT_VOCAB)
    drafter.load_target_parts(torch.randn(tcfg["vocab_size"], tcfg["hidden_size"]), d2t, t2d)
    config = export_drafter(drafter.state_dict(), cfg, "speculators", "llama", tmp_path / "v")
    assert config["transformer_layer_config"]["intermediate_size"] == wide
    assert read_drafter(tmp_path / "v").config.intermediate_size == wide
