"""How the export stage's output reads in the run summary."""

from __future__ import annotations

from draftsmith.artifacts import Descriptor
from draftsmith.figures import ExportFigures


def describe(descriptor: Descriptor) -> str:
    figures = ExportFigures.of(descriptor)
    return f"{figures.format} drafter validated: {figures.drafter_dir}"
