"""Benchmark results drawn: charts (PNG and SVG) of tokens/s and acceptance length per
measured setting, and markdown tables."""

from __future__ import annotations

from pathlib import Path

from draftsmith.plotting import plt, save_figure


def plot_benchmark(labels: list[str], tokens_per_s: list[float],
                   acceptance: list[float | None], out_dir: str | Path,
                   title: str) -> list[Path]:
    fig, (ax_speed, ax_accept) = plt.subplots(1, 2, figsize=(10, 4))
    ax_speed.bar(labels, tokens_per_s, color=[f"C{i}" for i in range(len(labels))])
    ax_speed.set(title="throughput", ylabel="tokens/s")
    shown = [(lbl, a) for lbl, a in zip(labels, acceptance, strict=True) if a is not None]
    ax_accept.bar([lbl for lbl, _ in shown], [a for _, a in shown], color="C2")
    ax_accept.set(title="acceptance length", ylabel="tokens per verify forward")
    fig.suptitle(title)
    return save_figure(fig, out_dir, "benchmark")


def markdown_table(rows: list[dict]) -> str:
    """Rows as a markdown table, columns in the order they first appear."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
    body = "\n".join("| " + " | ".join(str(r.get(k, "")) for k in columns) + " |" for r in rows)
    return f"{header}\n{body}\n"
