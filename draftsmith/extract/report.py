"""How the extract stage's output reads in the run summary."""

from __future__ import annotations

from draftsmith.artifacts import Descriptor
from draftsmith.figures import ExtractFigures


def describe(descriptor: Descriptor) -> str:
    figures = ExtractFigures.of(descriptor)
    if descriptor.figures.get("mode") == "online":
        return (f"skipped (train.mode: online): the trainer captures aux layers "
                f"{figures.aux_layer_ids} of {descriptor.counts['tokens']} tokens itself")
    speed = f", {figures.tokens_per_s:,.0f} tokens/s" if figures.tokens_per_s else ""
    return f"{descriptor.counts['tokens']} tokens, aux layers {figures.aux_layer_ids}{speed}"
