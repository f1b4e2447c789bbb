"""Batched forward passes for evaluation: logits, probabilities, per-sample losses.

The model is put in eval mode (no dropout, batch-norm running statistics) and no graph is
kept. Probabilities depend on the task's loss: softmax for single-label cross-entropy,
element-wise sigmoid for multi-label BCE (``OUTPUT_KINDS``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.data.sampleset import SampleSet
from pipeline.eval_mode import eval_mode_restored
from pipeline.tasks import Task

# loss name -> ("single" | "multi", logits -> probabilities)
OUTPUT_KINDS: dict[str, tuple[str, Callable[[Tensor], Tensor]]] = {
    "cross_entropy": ("single", lambda z: torch.softmax(z, dim=-1)),
    "bce_multilabel": ("multi", torch.sigmoid),
}


def output_kind(task: Task) -> str:
    if task.loss not in OUTPUT_KINDS:
        raise ValueError(f"evaluation needs a classification loss; task loss '{task.loss}' is not one of {sorted(OUTPUT_KINDS)}")
    return OUTPUT_KINDS[task.loss][0]


@torch.no_grad()
def logits_of(model: nn.Module, task: Task, data: SampleSet, batch_size: int = 256) -> Tensor:
    """(N, K) float32 logits on CPU. ``batch_size`` is lowered to fit the memory budget."""
    batch_size = memory.forward_batch_size(model, task, data, batch_size)
    with eval_mode_restored(model):
        parts = [task.forward(model, batch).float().cpu() for batch in data.batches(batch_size)]
    return torch.cat(parts) if parts else torch.empty(0)


def probabilities(logits: Tensor, task: Task) -> Tensor:
    return OUTPUT_KINDS[task.loss][1](logits) if task.loss in OUTPUT_KINDS else logits


@torch.no_grad()
def per_sample_losses(model: nn.Module, task: Task, data: SampleSet, batch_size: int = 256) -> Tensor:
    batch_size = memory.forward_batch_size(model, task, data, batch_size)
    with eval_mode_restored(model):
        parts = [task.per_sample_loss(task.forward(model, b), b).float().cpu() for b in data.batches(batch_size)]
    return torch.cat(parts)


def retrieval_method(model: nn.Module) -> str | None:
    """The name of the model's retrieval-feature method (class attribute ``retrieval_method``:
    re-ID ``features``, VGG-Face ``embed``), or None when the model declares none."""
    name = getattr(model, "retrieval_method", None)
    return name if isinstance(name, str) and callable(getattr(model, name, None)) else None


@torch.no_grad()
def features_of(model: nn.Module, data: SampleSet, batch_size: int = 256, method: str | None = None) -> Tensor:
    """Retrieval features: ``model.<method>(x)`` batched (default: the model's declared method).
    ``batch_size`` is lowered to fit the memory budget."""
    method = method or retrieval_method(model)
    fn = getattr(model, method, None) if method else None
    if not callable(fn):
        raise ValueError(f"{type(model).__name__} declares no retrieval-feature method (retrieval_method)")
    batch_size = memory.call_batch_size(model, fn, data, batch_size)
    with eval_mode_restored(model):
        return torch.cat([fn(batch["x"]).float().cpu() for batch in data.batches(batch_size)])
