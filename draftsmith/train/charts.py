"""Training charts (PNG and SVG): loss and full accuracy per TTT step over training."""

from __future__ import annotations

from pathlib import Path

from draftsmith.plotting import plt, save_figure


def plot_metrics(history: list[dict], steps: int, out_dir: str | Path) -> list[Path]:
    train = [h for h in history if h["split"] == "train"]
    val = [h for h in history if h["split"] == "validation"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for j in range(steps):
        color = f"C{j}"
        ax_loss.plot([h["step"] for h in train], [h[f"loss_{j}"] for h in train], color=color,
                     label=f"step {j}")
        ax_acc.plot([h["step"] for h in train], [h[f"full_acc_{j}"] for h in train], color=color,
                    label=f"train step {j}")
        if val:
            ax_acc.plot([h["step"] for h in val], [h[f"full_acc_{j}"] for h in val], "o--",
                        color=color, label=f"validation step {j}")
    ax_loss.set(title="loss per TTT step", xlabel="optimiser step", ylabel="soft cross-entropy")
    ax_acc.set(title="full accuracy per TTT step", xlabel="optimiser step", ylabel="full_acc",
               ylim=(0, 1))
    ax_loss.legend()
    ax_acc.legend(fontsize="small")
    return save_figure(fig, out_dir, "training")
