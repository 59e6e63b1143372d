"""How the train stage's output reads: its line in the run summary, and its reports (the
metrics table, and the best tau and acceptance with the training chart)."""

from __future__ import annotations

import json
from typing import Any

from draftsmith.artifacts import Descriptor
from draftsmith.figures import TRAIN_METRICS_FILE, TrainFigures
from draftsmith.reports import Report, embedded_image, rounded


def metric_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training and validation rows of the metrics log in one table: the columns every row
    shares, tau and acceptance first, then per TTT position, then the rest; values rounded."""
    first = ["split", "epoch", "step", "tau", "acceptance_replayed"]
    per_position = sorted(
        {k for row in history for k in row
         if k.rsplit("_", 1)[-1].isdigit() and k.rsplit("_", 1)[0] in
         ("full_acc", "cond_acc", "loss")},
        key=lambda k: (("full_acc", "cond_acc", "loss").index(k.rsplit("_", 1)[0]),
                       int(k.rsplit("_", 1)[1])))
    rest = sorted({k for row in history for k in row} - set(first) - set(per_position))
    columns = first + per_position + rest
    return [{c: rounded(row.get(c)) for c in columns} for row in history]


def reports(descriptor: Descriptor) -> list[Report]:
    figures = TrainFigures.of(descriptor)
    history = [json.loads(line)
               for line in (descriptor.dir / TRAIN_METRICS_FILE).read_text().splitlines()]
    rows = metric_rows(history)
    replayed = figures.acceptance_replayed
    validation = [r for r in history if r["split"] == "validation"]
    best = max(validation, key=lambda r: r["tau"]) if validation else {}
    text = (f"# training\n\nbest validation tau **{figures.tau:.3f}** (epoch "
            f"{best.get('epoch', '-')}), acceptance replayed over the validation answers "
            f"(greedy chain decoding) "
            f"**{replayed if replayed is not None else float('nan'):.3f}**\n\n"
            + "".join(f"- TTT position {j}: full_acc {a:.3f}\n"
                      for j, a in enumerate(figures.full_acc)))
    chart = descriptor.dir / "training.png"
    if chart.is_file():
        text += ("\n## loss and accuracy per step, per TTT position\n\n"
                 + embedded_image(chart, "training loss and accuracy per step") + "\n")
    return [
        Report("table", "train: tau, acceptance, accuracy and loss per TTT position, for the "
               "logged training steps and each epoch's validation", key="train", rows=rows),
        Report("markdown", "train: best tau and acceptance, and the training chart",
               key="train-summary", text=text),
    ]


def describe(descriptor: Descriptor) -> str:
    figures = TrainFigures.of(descriptor)
    accs = ", ".join(f"{a:.3f}" for a in figures.full_acc)
    text = (f"validation full_acc per step [{accs}], loss_0 {figures.extra('loss_0'):.3f}, "
            f"simulated tau {figures.tau:.2f}")
    if figures.acceptance_replayed is not None:  # what greedy chain decoding would measure
        text += f", acceptance replayed {figures.acceptance_replayed:.2f}"
    if figures.tokens_per_s is not None:
        text += f", {figures.tokens_per_s:,.0f} tokens/s steady"
    return text
