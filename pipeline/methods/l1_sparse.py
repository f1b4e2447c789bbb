"""l1-sparse unlearning (Jia, Liu, Ram, Yao, Liu, Liu, Sharma, Liu, "Model Sparsity Can Simplify
Machine Unlearning", NeurIPS 2023, "sparsity-aware unlearning"): fine-tuning on D_r with an l1
penalty that pulls the weights towards a sparse model, its weight decaying linearly over the epochs.

Epoch t = 0, ..., T-1 of T takes SGD steps (momentum, constant lr; the batches exactly fine-tuning's
for the same seed) on batches B of D_r (or of a seeded draw of ``retain_samples`` of it) of

    J_t(w) = (1/|B|) sum_{z in B} loss(w, z) + (lambda/2) ||w_P||^2 + gamma_t ||w_P||_1,
    gamma_t = gamma (1 - t / T)

(gamma at the first epoch, gamma / T at the last: the paper's linearly decaying weight, in the form
of the authors' code, ``unlearn/FT.py`` of OPTML-Group/Unlearn-Sparse, with no l1-free epochs, so that
their gamma values carry over). Their l1 norm runs over every parameter; over the
parameters P here, which is the same gradient, since the others do not move. The subgradient of
|w| at 0 is 0 (torch's). gamma = 0 is fine-tuning, weight for weight. No guarantee. The model runs in
eval mode and is updated in place.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.methods.base import RemovalMethod, RemovalOutcome, RemovalProblem, register_method, stream_seed
from pipeline.methods.finetune import (
    FINETUNE_STREAM, SGD, LossRecord, RetainEpochs, SGDSettings, l2, mean_batch_loss, outcome, run_epochs,
    selected_parameters,
)
from pipeline.prepared import Prepared
from pipeline.tasks import Batch


class L1SparseSettings(SGDSettings):
    epochs: int = Field(5, ge=1, description="passes over D_r; the l1 weight decays linearly across them")
    gamma: float = Field(5e-4, ge=0, description="l1 weight of the first epoch; epoch t of T uses gamma (1 - t/T)")
    retain_samples: int | None = Field(
        None, gt=0, description="D_r samples drawn (seeded) per epoch; null = all of D_r")


def l1_weight(gamma: float, epoch: int, epochs: int) -> float:
    """gamma_t = gamma (1 - t / T) for epoch t = 0, ..., T-1."""
    return gamma * (1.0 - epoch / epochs)


def l1_norm(params: dict[str, nn.Parameter]) -> Tensor:
    return sum(p.abs().sum() for p in params.values())  # type: ignore[return-value]


@register_method
class L1Sparse(RemovalMethod):
    """Minimise mean loss on D_r + (lambda/2)||w_P||^2 + gamma_t ||w_P||_1, gamma_t decaying linearly."""

    name = "l1-sparse"
    Settings = L1SparseSettings

    def remove(self, problem: RemovalProblem, settings: L1SparseSettings, prepared: Prepared) -> RemovalOutcome:  # type: ignore[override]
        started = time.perf_counter()
        timings: dict[str, float] = {}
        model, task = problem.model, problem.task
        params = selected_parameters(model, settings.parameters)
        retain_epochs = RetainEpochs(problem.retain, settings.retain_samples, settings.epochs, settings.batch_size,
                                     torch.Generator().manual_seed(stream_seed(problem.seed, FINETUNE_STREAM)))
        weights = [l1_weight(settings.gamma, t, settings.epochs) for t in range(settings.epochs)]
        losses = LossRecord(problem, retain_epochs.seen(), timings)
        with torch.no_grad():
            norm_before = float(l1_norm(params))
        opt = SGD(params, lr=settings.lr, momentum=settings.momentum)

        def batches(epoch: int) -> Iterator[tuple[float, Batch]]:
            return ((weights[epoch], b) for b in retain_epochs(epoch))

        def objective(item: tuple[float, Batch]) -> Tensor:
            gamma_t, batch = item
            value = mean_batch_loss(model, task, batch) + l2(params, problem.weight_decay)
            return value + gamma_t * l1_norm(params) if gamma_t > 0 else value

        run_epochs(problem, settings.epochs, batches, objective, opt, timings, "l1_sparse")
        with torch.no_grad():
            norm_after = float(l1_norm(params))
        return outcome(params, {"steps": opt.steps, **losses.after(), "l1_weights": weights,
                                "l1_norm": {"before": norm_before, "after": norm_after},
                                "parameters": list(params), "timings": timings,
                                "seconds": time.perf_counter() - started})
