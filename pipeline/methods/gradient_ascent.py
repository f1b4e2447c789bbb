"""Gradient ascent on the forget set ("GA", Thudi et al. 2022; a reference approximate method
of Jia et al., NeurIPS 2023 and Fan et al., ICLR 2024): raise the loss of D_f.

For ``epochs`` seeded passes over D_f in batches B, one SGD step (momentum, constant lr) on
    J(w) = -(1/|B|) sum_{z in B} loss(w, z)
i.e. w_P <- w_P + lr * grad_P mean-loss_B(w) for the first step (no weight decay: the ascent
objective has no minimum for the penalty to shape). No guarantee; it over-forgets when run
long, so the defaults are short. The model is updated in place.
"""
from __future__ import annotations

import time

import torch
from pydantic import Field

from pipeline.prepared import Prepared
from pipeline.methods.base import RemovalMethod, RemovalOutcome, RemovalProblem, register_method, stream_seed
from pipeline.methods.finetune import (
    FINETUNE_STREAM, SGD, SGDSettings, forget_loss, mean_batch_loss, outcome, run_epochs, selected_parameters,
    shuffled_batches,
)


class GradientAscentSettings(SGDSettings):
    epochs: int = Field(1, ge=1, description="passes over D_f")
    lr: float = Field(1e-3, gt=0, description="SGD learning rate (constant)")
    momentum: float = Field(0.0, ge=0, lt=1)
    batch_size: int = Field(64, ge=1)


@register_method
class GradientAscent(RemovalMethod):
    name = "gradient-ascent"
    Settings = GradientAscentSettings

    def remove(self, problem: RemovalProblem, settings: GradientAscentSettings, prepared: Prepared) -> RemovalOutcome:  # type: ignore[override]
        started = time.perf_counter()
        timings: dict[str, float] = {}
        model, task, forget = problem.model, problem.task, problem.forget
        params = selected_parameters(model, settings.parameters)
        gen = torch.Generator().manual_seed(stream_seed(problem.seed, FINETUNE_STREAM))
        opt = SGD(params, lr=settings.lr, momentum=settings.momentum)
        before = forget_loss(model, task, forget, problem.batch_size)
        run_epochs(problem, settings.epochs, lambda _: shuffled_batches(forget, settings.batch_size, gen),
                   lambda b: -mean_batch_loss(model, task, b), opt, timings, "ascent")
        after = forget_loss(model, task, forget, problem.batch_size)
        return outcome(params, {"steps": opt.steps, "forget_loss": {"before": before, "after": after},
                                "parameters": list(params), "timings": timings,
                                "seconds": time.perf_counter() - started})
