"""What a removal did, measured: accuracy of the model before and after on the forget set,
the retain set (the new training set) and the test split. Used to verify a removal before it
is published and to draw a campaign's curves.

Accuracies here are shares in [0, 1] (``pipeline.evaluate.classification.task_accuracy`` / 100),
None for a task without a classification loss or an empty set.

A removal that moved only the last part of a model (a decision layer, the last transformer layers)
leaves the part before it as it was in both models: ``RemovalMetrics`` then runs that frozen prefix
once over the data split and the test split (``pipeline.frozen_prefix``) and both models' suffixes
over its outputs, and keeps those outputs for the next batch of a campaign while the prefix stays
the same (checked by a digest of every parameter and buffer outside the moved block). The numbers
are the whole models' (the prefix is the same function in both).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from pipeline.checkpoint import load_into
from pipeline.data import SampleSet, load_source
from pipeline.evaluate.classification import task_accuracy
from pipeline.evaluate.predict import OUTPUT_KINDS
from pipeline.frozen_prefix import Split, prefix_outputs, split_for
from pipeline.models.card import load_model_dir
from pipeline.models.registry import build
from pipeline.param_block import ParamBlock
from pipeline.prepared import content_digest, digest_tensor
from pipeline.removal import RemovalRun
from pipeline.tasks import Task

__all__ = ["RemovalMetrics", "accuracy_share", "removal_metrics"]


def accuracy_share(model: nn.Module, task: Task, data: SampleSet | None, batch_size: int = 1024) -> float | None:
    """Accuracy (micro-F1 for multi-label) as a share in [0, 1]; None without a
    classification loss or without data."""
    if data is None or len(data) == 0 or task.loss not in OUTPUT_KINDS:
        return None
    value = task_accuracy(model, task, data, batch_size) / 100.0
    return value if math.isfinite(value) else None


def _subset(full: SampleSet, ids: Sequence[int]) -> SampleSet | None:
    return full.take(full.positions_of(list(ids), field="sample_ids")) if ids else None


def _moved_split(parent: nn.Module, new: nn.Module, task: Task) -> tuple[Split, str] | None:
    """The split before the parameters the removal changed, and a digest of everything outside
    them (None: no split applies, or nothing moved)."""
    new_params = dict(new.named_parameters())
    moved = [name for name, p in parent.named_parameters() if not torch.equal(p, new_params[name])]
    if not moved or not all(dict(parent.named_parameters())[n].requires_grad for n in moved):
        return None
    split = split_for(parent, task, ParamBlock.from_rows(parent, {name: None for name in moved}))
    if split is None:
        return None
    digest = content_digest()
    for name, tensor in (*parent.named_parameters(), *parent.named_buffers()):
        if name not in moved:
            digest_tensor(digest, name, tensor)
    return split, digest.hexdigest()


class RemovalMetrics:
    """``removal_metrics`` with the frozen prefix's outputs kept between calls (a campaign's
    batches): keyed by the prefix's digest, the split point and the data reference."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str, str, str], SampleSet] = {}

    def _through(self, key: tuple[str, str, str], split: Split, parent: nn.Module, task: Task, name: str,
                 data: SampleSet) -> SampleSet:
        full_key = (*key, name)
        if full_key not in self._cache:
            parent.eval()
            self._cache = {k: v for k, v in self._cache.items() if k[:3] == key}  # one prefix at a time
            self._cache[full_key] = prefix_outputs(split, parent, task, data, 256)
        return self._cache[full_key]

    def __call__(self, parent_dir: str | Path, run: RemovalRun, sample_ids: Sequence[int],
                 cumulative_ids: Sequence[int] = ()) -> dict[str, Any]:
        """Accuracies of the parent and of the new model on: this batch's forget set
        (``sample_ids``), all samples removed so far by the caller (``cumulative_ids``), the new
        retain set, and the test split."""
        parent, task, card = load_model_dir(parent_dir)
        new, _ = build(run.card.preset, run.card.options)
        new.to(next(parent.parameters()).dtype)
        load_into(new, run.new_state, source="removal result")
        splits = load_source(card.data.source, card.data.options)
        full = splits[card.data.split].astype(next(parent.parameters()).dtype)
        test = splits.get("test") if card.data.split != "test" else None
        test = None if test is None else test.astype(next(parent.parameters()).dtype)
        moved = _moved_split(parent, new, task)
        models: dict[str, nn.Module] = {"": new, "_before": parent}
        eval_task = task
        if moved is not None:  # both models through the shared prefix's outputs, computed once
            split, digest = moved
            key = (digest, str(split.start), json.dumps(card.data.model_dump(mode="json"), sort_keys=True))
            full = self._through(key, split, parent, task, card.data.split, full)
            test = None if test is None else self._through(key, split, parent, task, "test", test)
            models = {"": split.suffix_of(new), "_before": split.suffix_of(parent)}
            eval_task = split.task
        removed = set(int(i) for i in run.card.training.removed_ids)
        keep = torch.tensor([int(i) not in removed for i in full.sample_ids.tolist()], dtype=torch.bool)
        sets = {
            "forget": _subset(full, sample_ids),
            "cumulative_forget": _subset(full, cumulative_ids),
            "retain": full.take(torch.nonzero(keep).squeeze(1)),
            "test": test,
        }
        metrics: dict[str, Any] = {"n_train": run.card.training.n, "n_removed_total": len(run.card.training.removed_ids),
                                   "batch_samples": len(sample_ids),
                                   "measured_on": "the whole models" if moved is None else
                                   f"the moved part from {moved[0].start} on, over the unchanged prefix's outputs"}
        for name, data in sets.items():
            for suffix, model in models.items():
                metrics[f"{name}_accuracy{suffix}"] = accuracy_share(model, eval_task, data)
        before, after = metrics["retain_accuracy_before"], metrics["retain_accuracy"]
        metrics["retain_accuracy_drop"] = None if before is None or after is None else before - after
        return metrics


def removal_metrics(parent_dir: str | Path, run: RemovalRun, sample_ids: Sequence[int],
                    cumulative_ids: Sequence[int] = ()) -> dict[str, Any]:
    """``RemovalMetrics()(...)``: one verification, nothing kept."""
    return RemovalMetrics()(parent_dir, run, sample_ids, cumulative_ids)
