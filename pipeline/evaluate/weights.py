"""Weight-space measures used by the Newton-removal papers (Guo et al. 2020; Sekhari et al.
2021; Mehta et al. 2022).

  residual gradient norm  ||grad L_{D_r}(w')||_2 with L_{D_r}(w) = mean_{D_r} loss + (lambda/2)||w||^2
                          (0 at the exact retrained optimum; small = w' is near-stationary on D_r)
  distance                ||w' - w_retrain||_2 over the trainable parameters, also relative to
                          ||w_original - w_retrain||_2 (1 = no progress, 0 = exact).
"""
from __future__ import annotations

import math
from typing import Mapping

from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.eval_mode import eval_mode_restored
from pipeline.tasks import Task
from pipeline.training import gradient_norm


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def residual_gradient_norm(model: nn.Module, task: Task, retain: SampleSet, weight_decay: float,
                           batch_size: int = 256) -> float:
    """||grad L_{D_r}(w)||_2 over the trainable parameters (model in eval mode)."""
    with eval_mode_restored(model):
        return gradient_norm(model, task, retain, weight_decay, batch_size)


def weight_distance(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    """||a - b||_2 over the keys both share (they must share every key)."""
    if set(a) != set(b):
        raise ValueError(f"weight sets differ: only in first {sorted(set(a) - set(b))[:5]}, only in second {sorted(set(b) - set(a))[:5]}")
    total = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return math.sqrt(total)


def relative_distance(candidate: Mapping[str, Tensor], original: Mapping[str, Tensor],
                      reference: Mapping[str, Tensor]) -> float:
    """||candidate - reference|| / ||original - reference|| (nan when original == reference)."""
    base = weight_distance(original, reference)
    return weight_distance(candidate, reference) / base if base > 0 else float("nan")


__all__ = ["trainable_state", "residual_gradient_norm", "weight_distance", "relative_distance"]
