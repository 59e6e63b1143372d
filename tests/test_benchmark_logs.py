"""What the benchmark's log tells a user about figures that need a second look.

- Outputs that leave greedy decoding: an error only where identity is exact. In bf16 a verify
  forward rounds otherwise than one-token steps (the H100 run of 2026-12-06: 52/60 identical
  at batch 1), and an ERROR there cried wolf.
- Speed pairs far apart: a warning that says what would steady them."""

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


# Speed pairs that disagree -----------------------------------------------------------------

def generations(seconds: float, rounds: int) -> list:
    """Four prompts of 8 tokens, each in `rounds` rounds, taking `seconds` apiece."""
    from draftsmith.serve.embedded import Generation

    per_round = [8 // rounds] * rounds
    return [Generation(tokens=list(range(8)), seconds=seconds, round_tokens=per_round,
                       prefill_seconds=seconds / 10, draft_seconds=seconds / 4,
                       verify_seconds=seconds / 2) for _ in range(4)]


@pytest.mark.parametrize(("first_speedup", "warned"), [(1.5, False), (1.2, True)])
def test_speed_pairs_far_apart_are_a_warning_with_what_to_change(monkeypatch, caplog,
                                                                first_speedup, warned):
    """bf16 on an H100 (2026-12-06): the first pair gave 1.28x and the two after it 1.56x. The
    report keeps the median; the log says the pairs disagree and what would steady them."""
    from draftsmith.bench import benchmark
    from draftsmith.config import BenchmarkConfig

    # Every later pass: plain 0.02 s a prompt of 8 tokens in 8 rounds, speculative 0.0133 s in
    # 4 rounds: 1.5x.
    monkeypatch.setattr(benchmark, "decode_again",
                        lambda engine, prompts, cfg, eos, side:
                        generations(0.02, 8) if side == "plain" else generations(0.02 / 1.5, 4))
    first = {"greedy_tokens_per_s": 400.0, "speculative_tokens_per_s": 400.0 * first_speedup,
             "speedup": first_speedup, "ms_per_plain_token": 9.0,
             "ms_per_round": {"draft": 9.0, "verify": 9.0, "other": 9.0}, "speedup_limit": 9.0,
             "ms_per_prompt": {"plain": 9.0, "speculative": 9.0}}
    engine = SimpleNamespace(num_steps=3)
    cfg = BenchmarkConfig(num_prompts=4, max_new_tokens=8, repeats=3, warmup_prompts=1)
    with caplog.at_level(logging.WARNING, logger=benchmark.log.name):
        figures = benchmark.repeated_speedups(engine, [[1]] * 4, cfg, None, first)
    disagree = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert bool(disagree) is warned
    if warned:
        assert "1.20x (plain first)" in disagree[0] and "1.50x (speculative first)" in disagree[0]
        assert "benchmark.warmup_prompts (now 1)" in disagree[0]
    assert figures["speedup"] == 1.5
    # The median pair's step costs: a later pair's where the first is off, else the first's.
    assert figures["step_costs_from"] == ("speed pair 2 of 3" if warned else "speed pair 1 of 3")
    assert (figures["ms_per_round"] == first["ms_per_round"]) is not warned
