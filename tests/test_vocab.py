"""draftsmith.data.vocab: the draft vocabulary and its d2t (offsets) / t2d maps."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data.vocab import build_vocab_map, draft_to_target_ids


def target_ids(d2t: torch.Tensor) -> list[int]:
    """What SGLang does with d2t: target = draft + d2t[draft]."""
    return [draft + int(d2t[draft]) for draft in range(d2t.numel())]


def test_hand_example():
    # counts: 7 -> 4, 3 -> 3, 9 -> 2, 1 -> 1, 5 -> 1 (total 11)
    masked = [7, 3, 7, 9, 3, 7, 1, 9, 3, 7, 5]
    d2t, t2d, coverage = build_vocab_map(masked, target_vocab_size=12, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and d2t.shape == (3,)
    assert t2d.dtype == torch.bool and t2d.shape == (12,)
    assert target_ids(d2t) == [3, 7, 9]  # the three most frequent, ascending
    assert d2t.tolist() == [3, 6, 7]  # offsets, not ids
    assert t2d.nonzero().flatten().tolist() == [3, 7, 9]
    assert coverage == pytest.approx(9 / 11)
    assert draft_to_target_ids(d2t).tolist() == [3, 7, 9]


def test_ties_prefer_lower_ids():
    d2t, t2d, coverage = build_vocab_map([5, 2, 8, 8], target_vocab_size=10, draft_vocab_size=2)
    assert target_ids(d2t) == [2, 8]
    assert coverage == pytest.approx(3 / 4)


def test_most_frequent_ids_are_chosen_and_ascending():
    generator = torch.Generator().manual_seed(0)
    vocab, draft = 300, 40
    # Zipf-like: id i appears about 1000 / (rank + 1) times, with ranks shuffled over the ids.
    order = torch.randperm(vocab, generator=generator).tolist()
    masked = [tok for rank, tok in enumerate(order) for _ in range(1000 // (rank + 1))]
    d2t, t2d, coverage = build_vocab_map(masked, vocab, draft)
    chosen = target_ids(d2t)
    assert chosen == sorted(chosen) and len(set(chosen)) == draft
    assert set(chosen) == set(order[:draft])
    assert t2d.sum().item() == draft
    assert t2d.nonzero().flatten().tolist() == chosen
    assert torch.all(d2t >= 0)
    in_vocab = sum(1 for t in masked if t in set(chosen))
    assert coverage == pytest.approx(in_vocab / len(masked))


def test_too_few_distinct_ids_pads_with_lowest_unused_ids():
    d2t, t2d, coverage = build_vocab_map([4, 4, 1, 6], target_vocab_size=10, draft_vocab_size=6)
    # seen: 1, 4, 6; filler: the lowest unused 0, 2, 3
    assert target_ids(d2t) == [0, 1, 2, 3, 4, 6]
    assert t2d.tolist() == [i in {0, 1, 2, 3, 4, 6} for i in range(10)]
    assert coverage == 1.0


def test_no_data_gives_the_lowest_ids():
    d2t, t2d, coverage = build_vocab_map([], target_vocab_size=8, draft_vocab_size=4)
    assert target_ids(d2t) == [0, 1, 2, 3]
    assert d2t.tolist() == [0, 0, 0, 0]
    assert coverage == 0.0


def test_full_vocab_is_identity():
    d2t, t2d, coverage = build_vocab_map([3, 3, 1], target_vocab_size=5, draft_vocab_size=5)
    assert d2t.tolist() == [0] * 5
    assert bool(t2d.all())
    assert coverage == 1.0


def test_draft_vocab_larger_than_target_is_refused():
    with pytest.raises(ValueError, match=r"merge\.draft_vocab_size=600.*at most 512"):
        build_vocab_map([1, 2], target_vocab_size=512, draft_vocab_size=600)
