"""How the deploy stage's output reads in the run summary."""

from __future__ import annotations

from draftsmith.artifacts import Descriptor
from draftsmith.figures import DeployFigures


def describe(descriptor: Descriptor) -> str:
    figures = DeployFigures.of(descriptor)
    text = f"{figures.engine} engine, {figures.num_steps} draft steps"
    if figures.url:
        text += f", serving at {figures.url}"
    return text
