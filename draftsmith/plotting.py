"""Shared chart plumbing: a headless backend, and every chart saved as PNG and SVG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402, F401  (re-exported for the chart modules)


def save_figure(fig, out_dir: str | Path, stem: str) -> list[Path]:
    """Write `stem`.png and `stem`.svg into out_dir and close the figure."""
    fig.tight_layout()
    paths = [Path(out_dir) / f"{stem}.png", Path(out_dir) / f"{stem}.svg"]
    for path in paths:
        fig.savefig(path)
    plt.close(fig)
    return paths
