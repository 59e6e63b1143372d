"""RoundClock: a round's phases in order, each from the end of the last."""

import time

import pytest
import torch

from draftsmith.serve.round_clock import RoundClock


def test_each_phase_runs_from_the_end_of_the_last():
    clock = RoundClock(torch.device("cpu"))
    for _ in range(2):  # reused round after round
        began = time.perf_counter()
        clock.start()
        time.sleep(0.02)
        clock.end("draft")
        time.sleep(0.01)
        clock.end("verify")
        took = time.perf_counter() - began
        spent = clock.read()
        assert list(spent) == ["draft", "verify"]
        assert spent["draft"] >= 0.02 and spent["verify"] >= 0.01
        assert spent["draft"] + spent["verify"] <= took


def test_phases_out_of_order_or_unfinished_are_refused():
    clock = RoundClock(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="'verify' ended out of order"):
        clock.start()
        clock.end("verify")
    clock.start()
    clock.end("draft")
    with pytest.raises(RuntimeError, match="read before every phase"):
        clock.read()
    with pytest.raises(RuntimeError, match="start\\(\\) first"):
        RoundClock(torch.device("cpu")).end("draft")


def test_a_round_adds_its_phases_to_the_generation():
    from draftsmith.serve.embedded import Generation

    clock, result = RoundClock(torch.device("cpu")), Generation(tokens=[], seconds=0.0)
    for _ in range(2):
        clock.start()
        time.sleep(0.01)
        clock.end("draft")
        clock.end("verify")
        clock.add_to(result)
    assert result.draft_seconds >= 0.02 and 0 <= result.verify_seconds < result.draft_seconds
