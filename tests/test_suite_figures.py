"""The suite's per-set figures: sums before dividing, and the bootstrap interval."""

from __future__ import annotations

from draftsmith.bench.suite import bootstrap_interval, set_rows
from draftsmith.data.evalsets import EvalPrompt


def prompt(i: int, name: str = "chat", split: str = "test") -> EvalPrompt:
    return EvalPrompt(f"{name}-{i}", name, split, ({"role": "user", "content": "hi"},))


def test_acceptance_sums_before_dividing_and_counts_positions():
    # a long answer of acceptance 3 and a short one of acceptance 1: 34 tokens in 12 rounds
    per_prompt = [
        {"verify_rounds": 10, "round_tokens": 30, "accepted_by_position": [10, 10, 0],
         "identical": True, "completion_tokens": 30, "speculative_s": 1.0, "greedy_s": 2.0,
         "plain_tokens": 30},
        {"verify_rounds": 2, "round_tokens": 4, "accepted_by_position": [2, 0, 0],
         "identical": False, "completion_tokens": 4, "speculative_s": 1.0, "greedy_s": 1.0,
         "plain_tokens": 4},
        {"verify_rounds": 5, "round_tokens": 10, "accepted_by_position": [5, 0, 0],
         "identical": True, "completion_tokens": 10, "speculative_s": 1.0, "greedy_s": 1.0,
         "plain_tokens": 10}]
    rows = set_rows([prompt(0), prompt(1), prompt(2, "math", "dev")], per_prompt, 3, 500)
    chat, math = rows
    assert (chat["set"], chat["split"], chat["prompts"]) == ("chat", "test", 2)
    assert chat["acceptance"] == round(34 / 12, 4)  # not the mean of 3.0 and 2.0
    assert chat["per_position"] == [1.0, round(10 / 12, 4), 0.0]
    assert chat["identical"] == "1/2" and chat["lossless"] is False
    assert chat["speedup"] == round((34 / 2) / (34 / 3), 3)
    assert math["acceptance"] == 2.0 and math["ci95"] == [2.0, 2.0]


def test_the_interval_holds_the_figure_and_narrows_with_more_prompts():
    tokens = [30, 4, 20, 9, 14, 25]
    rounds = [10, 2, 8, 5, 6, 9]
    point = sum(tokens) / sum(rounds)
    low, high = bootstrap_interval(tokens, rounds, 2000)
    assert low < point < high and bootstrap_interval(tokens, rounds, 2000) == [low, high]
    wide = high - low
    low, high = bootstrap_interval(tokens * 10, rounds * 10, 2000)
    assert low < point < high and (high - low) < wide / 2


def test_the_speedup_is_the_median_of_the_pairs():
    from draftsmith.bench.vllm_bench import median_speedups, speed_pair

    def rows(*tps):
        return [{"concurrency": c, "tokens_per_s": t} for c, t in zip((1, 4), tps, strict=True)]

    pairs = [speed_pair(rows(30, 90), rows(20, 80), "speculative first"),
             speed_pair(rows(33, 84), rows(20, 80), "baseline first"),
             speed_pair(rows(24, 100), rows(20, 80), "speculative first")]
    assert pairs[0]["speedups"] == {1: 1.5, 4: 1.125}
    assert median_speedups(pairs) == {1: 1.5, 4: 1.125}
