"""Accuracy-type metrics, in percent.

  accuracy   = 100 * (1/N) sum_i [argmax_k z_ik = y_i]                     (single label)
  micro-F1   = 100 * 2 TP / (2 TP + FP + FN), counts over all (sample, label) pairs,
               prediction = [sigmoid(z) >= threshold]                      (multi label)
  UA = 100 - acc(D_f),  RA = acc(D_r),  TA = acc(test)   (Jia et al., NeurIPS 2023,
  "Model Sparsity Can Simplify Machine Unlearning", section 5.1)
For a multi-label task "acc" is micro-F1 (the LEDGAR / LexGLUE convention).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.evaluate.predict import logits_of, output_kind
from pipeline.tasks import Task


def accuracy(logits: Tensor, y: Tensor) -> float:
    """Top-1 accuracy in percent."""
    if len(y) == 0:
        return float("nan")
    return 100.0 * float((logits.argmax(dim=-1) == y.to(logits.device).long()).float().mean())


def micro_f1(logits: Tensor, y: Tensor, threshold: float = 0.5) -> float:
    """Micro-averaged F1 in percent for multi-hot targets ``y`` (N, K)."""
    pred = torch.sigmoid(logits) >= threshold
    truth = y.to(pred.device) > 0.5
    tp = float((pred & truth).sum())
    fp = float((pred & ~truth).sum())
    fn = float((~pred & truth).sum())
    denom = 2 * tp + fp + fn
    return 100.0 * (2 * tp / denom) if denom > 0 else 100.0


ACCURACY_BY_KIND = {"single": accuracy, "multi": micro_f1}


def score_logits(logits: Tensor, y: Tensor, task: Task) -> float:
    return ACCURACY_BY_KIND[output_kind(task)](logits, y)


def task_accuracy(model: nn.Module, task: Task, data: SampleSet, batch_size: int = 256) -> float:
    """Accuracy (single label) or micro-F1 (multi label) of ``model`` on ``data``, in percent."""
    if len(data) == 0:
        return float("nan")
    return score_logits(logits_of(model, task, data, batch_size), data.columns["y"], task)


def ua_ra_ta(model: nn.Module, task: Task, forget: SampleSet, retain: SampleSet, test: SampleSet,
             batch_size: int = 256) -> dict[str, float]:
    return {
        "UA": 100.0 - task_accuracy(model, task, forget, batch_size),
        "RA": task_accuracy(model, task, retain, batch_size),
        "TA": task_accuracy(model, task, test, batch_size),
    }
