"""What a removal did, measured: accuracy of the model before and after on the forget set,
the retain set (the new training set) and the test split. Used to verify a removal before it
is published and to draw a campaign's curves.

Accuracies here are shares in [0, 1] (``pipeline.evaluate.classification.task_accuracy`` / 100),
None for a task without a classification loss or an empty set.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from pipeline.checkpoint import load_into
from pipeline.data import SampleSet, load_source
from pipeline.evaluate.classification import task_accuracy
from pipeline.evaluate.predict import OUTPUT_KINDS
from pipeline.models.card import load_model_dir
from pipeline.models.registry import build
from pipeline.removal import RemovalRun, training_set
from pipeline.tasks import Task


def accuracy_share(model: nn.Module, task: Task, data: SampleSet | None, batch_size: int = 1024) -> float | None:
    """Accuracy (micro-F1 for multi-label) as a share in [0, 1]; None without a
    classification loss or without data."""
    if data is None or len(data) == 0 or task.loss not in OUTPUT_KINDS:
        return None
    value = task_accuracy(model, task, data, batch_size) / 100.0
    return value if math.isfinite(value) else None


def _subset(full: SampleSet, ids: Sequence[int]) -> SampleSet | None:
    return full.take(full.positions_of(list(ids), field="sample_ids")) if ids else None


def removal_metrics(parent_dir: str | Path, run: RemovalRun, sample_ids: Sequence[int],
                    cumulative_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Accuracies of the parent and of the new model on: this batch's forget set
    (``sample_ids``), all samples removed so far by the caller (``cumulative_ids``), the new
    retain set, and the test split."""
    parent, task, card = load_model_dir(parent_dir)
    new, _ = build(run.card.preset, run.card.options)
    load_into(new, run.new_state, source="removal result")
    splits = load_source(card.data.source, card.data.options)
    full = splits[card.data.split]
    sets = {
        "forget": _subset(full, sample_ids),
        "cumulative_forget": _subset(full, cumulative_ids),
        "retain": training_set(run.card),
        "test": splits.get("test") if card.data.split != "test" else None,
    }
    metrics: dict[str, Any] = {"n_train": run.card.training.n, "n_removed_total": len(run.card.training.removed_ids),
                               "batch_samples": len(sample_ids)}
    for name, data in sets.items():
        metrics[f"{name}_accuracy"] = accuracy_share(new, task, data)
        metrics[f"{name}_accuracy_before"] = accuracy_share(parent, task, data)
    before, after = metrics["retain_accuracy_before"], metrics["retain_accuracy"]
    metrics["retain_accuracy_drop"] = None if before is None or after is None else before - after
    return metrics
