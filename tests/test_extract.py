"""Hidden-state capture (layer-id convention, final norm, padding) and the shard store."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.extract.capture import HiddenStateCapture
from draftsmith.extract.store import (
    INDEX_FILE,
    Sample,
    ShardReader,
    ShardSpec,
    StoreError,
    finished_shard,
    shard_tensors,
    write_index,
    write_shard,
)
from tests.engine_helpers import ShardWriter

AUX_IDS = [1, 3, 4]


def reference_states(model, input_ids: torch.Tensor):
    """transformers' own hidden states, and the last decoder layer's raw output (via a hook)."""
    captured = {}

    def hook(_module, _inputs, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, output_hidden_states=True)
    finally:
        handle.remove()
    return out.hidden_states, captured["last"]


def test_aux_ids_are_outputs_of_those_layers(random_target_model, random_target):
    model = random_target_model
    L = random_target.figures["num_layers"]
    ids = torch.randint(0, random_target.figures["vocab_size"], (2, 9),
                        generator=torch.Generator().manual_seed(0))
    hidden_states, _ = reference_states(model, ids)
    assert len(hidden_states) == L + 1

    aux, final = HiddenStateCapture(model, AUX_IDS)(ids, torch.ones_like(ids))
    H = random_target.figures["hidden_size"]
    assert aux.shape == (2, 9, 3 * H)
    expected = torch.cat([hidden_states[i + 1] for i in AUX_IDS], dim=-1)
    torch.testing.assert_close(aux, expected, rtol=1e-5, atol=1e-6)
    # Not off by one: the inputs of those layers (hidden_states[i]) are different.
    wrong = torch.cat([hidden_states[i] for i in AUX_IDS], dim=-1)
    assert not torch.allclose(aux, wrong, atol=1e-3)
    # Slices are in the order of the ids.
    torch.testing.assert_close(aux[..., H:2 * H], hidden_states[4], rtol=1e-5, atol=1e-6)


def test_final_is_after_the_final_norm(random_target_model, random_target):
    model = random_target_model
    ids = torch.randint(0, random_target.figures["vocab_size"], (1, 11),
                        generator=torch.Generator().manual_seed(1))
    hidden_states, last_layer_output = reference_states(model, ids)
    _, final = HiddenStateCapture(model, AUX_IDS)(ids, torch.ones_like(ids))
    with torch.no_grad():
        normed = model.model.norm(last_layer_output)
        logits = model(input_ids=ids).logits
        from_final = final.clone() @ model.lm_head.weight.T
    torch.testing.assert_close(final, hidden_states[-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final, normed, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(final, last_layer_output, atol=1e-3)
    # What the trainer does with it gives the target's own logits.
    torch.testing.assert_close(from_final, logits, rtol=1e-4, atol=1e-4)


def test_capture_leaves_no_hooks_behind(random_target_model):
    layers = random_target_model.model.layers
    before = [len(layer._forward_hooks) for layer in layers]
    ids = torch.tensor([[5, 6, 7]])
    HiddenStateCapture(random_target_model, AUX_IDS)(ids, torch.ones_like(ids))
    assert [len(layer._forward_hooks) for layer in layers] == before


def test_right_padded_batch_without_mask_equals_unpadded_single_runs(random_target_model,
                                                                     random_target):
    """The stage runs right-padded batches with no attention mask (so SDPA keeps its fused
    causal kernel): every real token's states must still equal a run of its sample alone."""
    model = random_target_model
    g = torch.Generator().manual_seed(2)
    V = random_target.figures["vocab_size"]
    lengths = [12, 5, 8]
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    T = max(lengths)
    input_ids = torch.randint(0, V, (len(seqs), T), generator=g)  # random padding tokens
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
    capture = HiddenStateCapture(model, AUX_IDS)
    aux, final = capture(input_ids)
    for i, s in enumerate(seqs):
        one_aux, one_final = capture(s[None])
        n = len(s)
        torch.testing.assert_close(aux[i, :n], one_aux[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(final[i, :n], one_final[0], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- store

HIDDEN, K = 8, 3


def make_samples(n: int, seed: int = 0, with_argmax: bool = True) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        T = int(torch.randint(1, 20, (1,), generator=g))
        samples.append(Sample(
            id=f"sample-{seed}-{i}",
            input_ids=torch.randint(0, 512, (T,), generator=g),
            loss_mask=torch.randint(0, 2, (T,), generator=g).to(torch.uint8),
            aux=torch.randn(T, K * HIDDEN, generator=g).to(torch.bfloat16),
            final=torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16),
            target_argmax=torch.randint(0, 512, (T,), generator=g, dtype=torch.int32)
            if with_argmax else None,
        ))
    return samples


def write_store(root, splits: dict[str, list[Sample]], shard_tokens: int = 40):
    meta = {"target_fingerprint": "abc", "aux_layer_ids": [1, 3, 4], "hidden_size": HIDDEN,
            "dtype": "bfloat16"}
    written = {}
    for split, samples in splits.items():
        writer = ShardWriter(root, split, shard_tokens)
        for s in samples:
            writer.add(s)
        written[split] = writer.close()
    write_index(root, meta, written)
    return written


def test_shard_round_trip_many_samples_several_shards(tmp_path):
    train, validation = make_samples(30, seed=0), make_samples(4, seed=1)
    written = write_store(tmp_path, {"train": train, "validation": validation})
    assert len(written["train"]) >= 4  # several shards
    assert sum(len(s["ids"]) for s in written["train"]) == 30
    assert len(list(tmp_path.glob("train-*.safetensors"))) == len(written["train"])

    reader = ShardReader(tmp_path)
    assert reader.aux_layer_ids == [1, 3, 4]
    assert reader.num_tokens("train") == sum(len(s.input_ids) for s in train)
    for split, originals in (("train", train), ("validation", validation)):
        back = list(reader.samples(split))
        assert [s.id for s in back] == [s.id for s in originals]
        for a, b in zip(back, originals, strict=True):
            assert torch.equal(a.input_ids, b.input_ids)
            assert torch.equal(a.loss_mask, b.loss_mask) and a.loss_mask.dtype == torch.uint8
            assert a.aux.dtype == b.aux.dtype and torch.equal(a.aux, b.aux)
            assert a.final.dtype == b.final.dtype and torch.equal(a.final, b.final)
            assert a.target_argmax.dtype == torch.int32
            assert torch.equal(a.target_argmax, b.target_argmax)
    assert list(reader.samples("test")) == []


def test_a_store_without_target_argmax_reads_as_before(tmp_path):
    """SGLang-backend and older stores hold no target argmax: the trainer computes it."""
    write_store(tmp_path, {"train": make_samples(6, with_argmax=False)})
    assert all(s.target_argmax is None for s in ShardReader(tmp_path).samples("train"))


def test_corrupted_shard_is_detected(tmp_path):
    written = write_store(tmp_path, {"train": make_samples(12)})
    path = tmp_path / written["train"][1]["file"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one bit of tensor data, the file still parses
    path.write_bytes(bytes(data))
    reader = ShardReader(tmp_path)
    with pytest.raises(StoreError, match="checksum"):
        list(reader.samples("train"))


def test_index_that_disagrees_with_a_shard_is_detected(tmp_path):
    write_store(tmp_path, {"train": make_samples(6)})
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["splits"]["train"][0]["tokens"][0] += 1
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(StoreError, match="token counts"):
        list(ShardReader(tmp_path, verify_checksums=False).samples("train"))


def test_store_without_index_is_refused(tmp_path):
    written = write_store(tmp_path, {"train": make_samples(5)})
    assert written["train"]
    (tmp_path / INDEX_FILE).unlink()
    with pytest.raises(StoreError, match=INDEX_FILE):
        ShardReader(tmp_path)


def test_samples_are_served_by_id_in_any_order(tmp_path):
    train = make_samples(25, seed=3)
    write_store(tmp_path, {"train": train})
    reader = ShardReader(tmp_path)
    assert len(reader) == 25 and "sample-3-7" in reader and "nope" not in reader
    assert reader.ids("train") == [s.id for s in train]
    for original in reversed(train):
        back = reader.sample(original.id)
        assert torch.equal(back.aux, original.aux) and torch.equal(back.final, original.final)
        assert torch.equal(back.input_ids, original.input_ids)
    with pytest.raises(KeyError, match="nope"):
        reader.sample("nope")


def test_truncated_shard_is_detected_even_without_checksums(tmp_path):
    written = write_store(tmp_path, {"train": make_samples(12)})
    path = tmp_path / written["train"][0]["file"]
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(StoreError, match="truncated"):
        list(ShardReader(tmp_path, verify_checksums=False).samples("train"))


def test_dtype_that_disagrees_with_the_index_is_detected(tmp_path):
    write_store(tmp_path, {"train": make_samples(6)})
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["dtype"] = "float16"  # the shards hold bfloat16
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(StoreError, match="aux is torch.bfloat16"):
        list(ShardReader(tmp_path).samples("train"))


def test_duplicate_sample_ids_are_refused(tmp_path):
    write_store(tmp_path, {"train": make_samples(4, seed=5), "validation": make_samples(4, seed=5)})
    with pytest.raises(StoreError, match="sample-5-0"):
        ShardReader(tmp_path)


def test_a_shard_counts_as_done_only_with_a_matching_receipt(tmp_path):
    samples = make_samples(3)
    spec = ShardSpec("train", 0, tuple(s.id for s in samples),
                     tuple(len(s.input_ids) for s in samples))
    assert finished_shard(tmp_path, spec) is None
    record = write_shard(tmp_path, spec, shard_tensors(samples))
    assert finished_shard(tmp_path, spec) == record
    other = ShardSpec("train", 0, spec.ids[:2], spec.tokens[:2])  # a different plan
    assert finished_shard(tmp_path, other) is None
    path = tmp_path / spec.file
    path.write_bytes(path.read_bytes() + b"x")  # file replaced after its receipt
    assert finished_shard(tmp_path, spec) is None
    with pytest.raises(ValueError, match="token counts"):
        write_shard(tmp_path, other, shard_tensors(samples))


def test_shards_are_standard_safetensors_files(tmp_path):
    from safetensors import safe_open

    samples = make_samples(9, seed=4)
    written = write_store(tmp_path, {"train": samples}, shard_tokens=10_000)
    with safe_open(str(tmp_path / written["train"][0]["file"]), framework="pt") as f:
        aux = f.get_tensor("aux")
        offsets = f.get_tensor("offsets")
    assert torch.equal(aux, torch.cat([s.aux for s in samples]))
    assert offsets.tolist()[-1] == sum(len(s.input_ids) for s in samples)


def test_a_shard_given_as_row_blocks_equals_the_concatenated_one(tmp_path):
    samples = make_samples(5, seed=6)
    spec = ShardSpec("train", 0, tuple(s.id for s in samples),
                     tuple(len(s.input_ids) for s in samples))
    whole = shard_tensors(samples)
    blocks = {**whole, "aux": [s.aux for s in samples], "final": [s.final for s in samples]}
    a = write_shard(tmp_path / "a", spec, whole)
    b = write_shard(tmp_path / "b", spec, blocks)
    assert a["sha256"] == b["sha256"]
    assert (tmp_path / "a" / spec.file).read_bytes() == (tmp_path / "b" / spec.file).read_bytes()
