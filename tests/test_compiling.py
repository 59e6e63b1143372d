"""compiled_once: one torch.compile per function and options, shared by every caller."""

from __future__ import annotations

import torch

from draftsmith import compiling


def test_a_function_is_compiled_once_for_every_caller(monkeypatch):
    made = []

    def fake_compile(fn, **options):
        made.append(options)
        return lambda *args: fn(*args)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(compiling, "_COMPILED", {})

    def plus_one(x):
        return x + 1

    first = compiling.compiled_once(plus_one, dynamic=False)
    assert compiling.compiled_once(plus_one, dynamic=False) is first
    other = compiling.compiled_once(plus_one)  # other options: another compiled function
    assert other is not first and made == [{"dynamic": False}, {}]
    assert first(1) == 2 and other(2) == 3
