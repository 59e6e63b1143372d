"""The draft vocabulary: which target ids the drafter's own head can predict.

d2t holds OFFSETS (target_id = draft_id + d2t[draft_id]); t2d marks the target ids that are in
the draft vocab. SGLang reads d2t only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from draftsmith.errors import ConfigValueError


def build_vocab_map(
    masked_token_ids: Iterable[int], target_vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t [D] int64, t2d [V] bool, coverage): the D most frequent loss-masked ids, ascending.

    When fewer than D distinct ids occur, the lowest unused ids fill the rest. Coverage is the
    share of masked tokens whose id is in the draft vocab.
    """
    if draft_vocab_size > target_vocab_size:
        raise ConfigValueError(
            f"merge.draft_vocab_size={draft_vocab_size} exceeds the target vocab "
            f"({target_vocab_size}); set it to at most {target_vocab_size}"
        )
    counts = Counter(masked_token_ids)
    frequent = sorted(counts, key=lambda t: (-counts[t], t))[:draft_vocab_size]
    chosen = set(frequent)
    filler = (t for t in range(target_vocab_size) if t not in chosen)
    while len(chosen) < draft_vocab_size:
        chosen.add(next(filler))
    draft_ids = torch.tensor(sorted(chosen), dtype=torch.int64)  # [D]
    d2t = draft_ids - torch.arange(draft_vocab_size, dtype=torch.int64)  # [D]
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)  # [V]
    t2d[draft_ids] = True
    total = sum(counts.values())
    coverage = sum(counts[t] for t in frequent) / total if total else 0.0
    return d2t, t2d, coverage


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(d2t.numel(), device=d2t.device)  # [D]
