"""PNG figures with matplotlib (Agg backend; no display needed)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from pipeline.evaluate.curves import RemovalCurve
from pipeline.evaluate.scorecard import GAP_METRICS


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_removal_curves(curves: Sequence[RemovalCurve], path: str | Path, title: str = "Sequential removals") -> Path:
    """Accuracy on removed / retained / test samples against the number removed, one colour per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for i, curve in enumerate(curves):
        colour = f"C{i}"
        forget = [(n, a) for n, a in zip(curve.removed, curve.forget_accuracy) if not math.isnan(a)]
        if forget:
            ax.plot(*zip(*forget), "-o", color=colour, ms=3, label=f"{curve.label} removed")
        ax.plot(curve.removed, curve.retain_accuracy, "--", color=colour, label=f"{curve.label} retained")
        ax.plot(curve.removed, curve.test_accuracy, ":", color=colour, label=f"{curve.label} test")
    ax.set_xlabel("number of samples removed")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_scorecard(rows: dict[str, dict[str, float]], path: str | Path, title: str = "Unlearning scorecard") -> Path:
    """Grouped bars of UA / RA / TA / MIA per method."""
    plt = _pyplot()
    names = list(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(names) + 2), 4.0), dpi=120)
    width = 0.8 / len(GAP_METRICS)
    for j, metric in enumerate(GAP_METRICS):
        xs = [i + (j - (len(GAP_METRICS) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [rows[n].get(metric, float("nan")) for n in names], width, label=metric)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("%")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
