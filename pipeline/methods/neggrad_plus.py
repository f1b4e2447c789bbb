"""NegGrad+ (Kurmanji, Triantafillou, Hayes, Triantafillou, "Towards Unbounded Machine Unlearning",
NeurIPS 2023): gradient descent on the retained data balanced against gradient ascent on the forget
set. A benchmark of 18 methods (Triantafillou et al. 2024) recommends a tuned NegGrad+ as the
baseline to beat.

Each step pairs a batch B_r of D_r with a batch B_f of D_f and takes one SGD step (momentum,
constant lr; ``pipeline.methods.finetune.SGD``) on the parameters P of

    J(w) = alpha (1/|B_r|) sum_{z in B_r} loss(w, z) - (1 - alpha) (1/|B_f|) sum_{z in B_f} loss(w, z)
           + (lambda/2) ||w_P||^2

(lambda the model's weight decay, as fine-tuning adds it). An epoch is one seeded pass over D_r,
or over a seeded draw of ``retain_samples`` of it (the batches are exactly fine-tuning's for the
same seed: ``RetainEpochs``); D_f is shuffled once per epoch (its own stream) and cycled, step i of
the epoch taking forget batch i mod ceil(m / forget_batch_size), as the authors' code zips the
retain loader with ``itertools.cycle`` of the forget loader. A term whose weight is 0 is not
computed: alpha = 1 is fine-tuning, weight for weight; alpha = 0 is gradient ascent on D_f (with the
weight decay). No guarantee. The model runs in eval mode and is updated in place.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch
from pydantic import Field
from torch import Tensor

from pipeline.methods.base import RemovalMethod, RemovalOutcome, RemovalProblem, register_method, stream_seed
from pipeline.methods.finetune import (
    FINETUNE_STREAM, FORGET_ORDER_STREAM, SGD, LossRecord, RetainEpochs, SGDSettings, l2, mean_batch_loss, outcome,
    run_epochs, selected_parameters,
)
from pipeline.prepared import Prepared
from pipeline.tasks import Batch


class NegGradPlusSettings(SGDSettings):
    alpha: float = Field(0.99, ge=0, le=1, description="weight of the retained loss; 1 - alpha weighs the "
                                                       "forget loss, ascended")
    forget_batch_size: int | None = Field(None, ge=1, description="D_f samples per step; null = batch_size")
    retain_samples: int | None = Field(
        None, gt=0, description="D_r samples drawn (seeded) per epoch; null = all of D_r")


def cycled_forget_batches(problem: RemovalProblem, batch_size: int, generator: torch.Generator) -> Iterator[Batch]:
    """Endless batches of D_f: one seeded order, replayed (``itertools.cycle`` over a shuffled loader)."""
    forget = problem.forget
    order = torch.randperm(len(forget), generator=generator)
    chunks = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    while True:
        for chunk in chunks:
            yield forget.take(chunk).columns


@register_method
class NegGradPlus(RemovalMethod):
    """Minimise alpha L_{B_r}(w) - (1 - alpha) L_{B_f}(w) + (lambda/2)||w_P||^2, B_f cycling over D_f."""

    name = "neggrad-plus"
    Settings = NegGradPlusSettings

    def remove(self, problem: RemovalProblem, settings: NegGradPlusSettings, prepared: Prepared) -> RemovalOutcome:  # type: ignore[override]
        started = time.perf_counter()
        timings: dict[str, float] = {}
        model, task, alpha = problem.model, problem.task, settings.alpha
        params = selected_parameters(model, settings.parameters)
        retain_epochs = RetainEpochs(problem.retain, settings.retain_samples, settings.epochs, settings.batch_size,
                                     torch.Generator().manual_seed(stream_seed(problem.seed, FINETUNE_STREAM)))
        forget_gen = torch.Generator().manual_seed(stream_seed(problem.seed, FORGET_ORDER_STREAM))
        forget_batch_size = settings.forget_batch_size or settings.batch_size
        losses = LossRecord(problem, retain_epochs.seen(), timings)
        opt = SGD(params, lr=settings.lr, momentum=settings.momentum)

        def pairs(epoch: int) -> Iterator[tuple[Batch, Batch]]:
            return zip(retain_epochs(epoch), cycled_forget_batches(problem, forget_batch_size, forget_gen))

        def objective(pair: tuple[Batch, Batch]) -> Tensor:
            retain_batch, forget_batch = pair
            value: Tensor | float = alpha * mean_batch_loss(model, task, retain_batch) if alpha > 0 else 0.0
            if alpha < 1:
                value = value - (1 - alpha) * mean_batch_loss(model, task, forget_batch)
            return value + l2(params, problem.weight_decay)  # type: ignore[return-value]

        run_epochs(problem, settings.epochs, pairs, objective, opt, timings, "neggrad_plus")
        return outcome(params, {"steps": opt.steps, **losses.after(), "parameters": list(params),
                                "timings": timings, "seconds": time.perf_counter() - started})
