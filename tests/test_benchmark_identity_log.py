"""How the benchmark logs outputs that leave greedy decoding: an error only where identity is
exact. In bf16 a verify forward rounds otherwise than one-token steps (the H100 run of
2026-12-06: 52/60 identical at batch 1), and an ERROR there cried wolf."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from draftsmith.bench.benchmark import identity_log


def engine_of(dtype: torch.dtype) -> SimpleNamespace:
    return SimpleNamespace(runner=SimpleNamespace(model=torch.nn.Linear(2, 2).to(dtype)))


@pytest.mark.parametrize(("dtype", "lossless", "level"), [
    (torch.float32, False, logging.ERROR),    # exact: a difference is a bug
    (torch.float32, True, logging.WARNING),   # every difference at a near tie (batches)
    (torch.bfloat16, False, logging.WARNING),
    (torch.float16, False, logging.WARNING)])
def test_differences_are_an_error_only_where_identity_is_exact(dtype, lossless, level):
    got, why = identity_log(engine_of(dtype), lossless)
    assert got == level
    if dtype == torch.float32:
        assert why == ""
    else:
        assert str(dtype).removeprefix("torch.") in why and "exact in float32" in why
