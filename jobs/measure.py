"""What a removal did, measured: accuracy of the model before and after on the forget set,
the retain set (the new training set) and the test split. Used to verify a removal before it
is published and to draw a campaign's curves."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from jobs.removal import RemovalRun, training_set
from pipeline.checkpoint import load_into
from pipeline.data import SampleSet, load_source
from pipeline.models.card import load_model_dir
from pipeline.models.registry import build
from pipeline.tasks import Task

# Losses whose targets are class indices: accuracy = argmax of the logits.
CLASSIFICATION_LOSSES = frozenset({"cross_entropy"})


@torch.no_grad()
def accuracy(model: nn.Module, task: Task, data: SampleSet | None, batch_size: int = 1024) -> float | None:
    """Share of correctly classified samples, or None for non-classification tasks or no data."""
    if data is None or len(data) == 0 or task.loss not in CLASSIFICATION_LOSSES:
        return None
    model.eval()
    correct = 0
    for batch in data.batches(batch_size):
        correct += int((task.forward(model, batch).argmax(dim=-1) == batch["y"]).sum())
    return correct / len(data)


def _subset(full: SampleSet, ids: Sequence[int]) -> SampleSet | None:
    return full.take(full.positions_of(list(ids), field="sample_ids")) if ids else None


def removal_metrics(parent_dir: str | Path, run: RemovalRun, forget_ids: Sequence[int],
                    cumulative_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Accuracies of the parent and of the new model on: this batch's forget set, all samples
    removed so far by the caller (``cumulative_ids``), the new retain set, and the test split."""
    parent, task, card = load_model_dir(parent_dir)
    new, _ = build(run.card.preset, run.card.options)
    load_into(new, run.new_state, source="removal result")
    splits = load_source(card.data.source, card.data.options)
    full = splits[card.data.split]
    sets = {
        "forget": _subset(full, forget_ids),
        "cumulative_forget": _subset(full, cumulative_ids),
        "retain": training_set(run.card),
        "test": splits.get("test") if card.data.split != "test" else None,
    }
    metrics: dict[str, Any] = {"n_train": run.card.training.n, "n_removed_total": len(run.card.training.removed_ids),
                               "batch_samples": len(forget_ids)}
    for name, data in sets.items():
        metrics[f"{name}_accuracy"] = accuracy(new, task, data)
        metrics[f"{name}_accuracy_before"] = accuracy(parent, task, data)
    before, after = metrics["retain_accuracy_before"], metrics["retain_accuracy"]
    metrics["retain_accuracy_drop"] = None if before is None or after is None else before - after
    return metrics
