"""SCRUB (Kurmanji, Triantafillou, Hayes, Triantafillou, "Towards Unbounded Machine Unlearning",
NeurIPS 2023, Algorithm 1): a student, initialised at the trained model (the teacher, kept frozen),
moves away from the teacher on the forget set and stays close to it on the retained data.

With d(x; w) = T^2 KL(p_T(f(x; w_o)) || p_T(f(x; w))), the divergence at temperature T between the
teacher's (w_o) and the student's (w) predictive distributions (the authors' ``DistillKL``:
p_T = softmax(logits / T), the T^2 keeping gradient magnitudes comparable across T), each of
``epochs`` epochs runs
    1. if the epoch is among the first ``max_steps``: a max-step pass, one seeded pass over D_f in
       batches B_f of ``forget_batch_size``, one SGD step per batch on
           J_max(w) = -(1/|B_f|) sum_{x in B_f} d(x; w)                  (ascent on d; no weight decay)
    2. a min-step pass over D_r (or a seeded draw of ``retain_samples`` of it, the batches exactly
       fine-tuning's for the same seed), one SGD step per batch B_r on
           J_min(w) = alpha (1/|B_r|) sum d(x; w) + gamma (1/|B_r|) sum loss(w, z) + (lambda/2)||w_P||^2
One SGD optimizer (momentum, constant lr) serves both passes, as in the authors' code; their
published defaults: 3 epochs, 2 max-step epochs, lr 5e-4, momentum 0.9, batch 128 on D_r and 32 on
D_f, alpha 0.001, gamma 0.99, T = 4 (their lr schedule decays only after epoch 3, so it is constant
here; their optimizer's weight decay, 5e-4 on both passes, is here the model's own lambda, on the
min-steps only: an ascent objective gets none, as in gradient-ascent).

The divergence is the KL between the task's predictive distributions: softmax for cross-entropy,
independent Bernoullis (mean over labels) for multi-label BCE, and for MSE the Gaussian whose
negative log-likelihood the loss is, KL = mean over outputs of (f_t - f)^2 (T cancels exactly).

Eval mode (the pipeline's convention) makes the forward pass deterministic, so the first max-step
pass starts at the teacher, where d and its gradient vanish (up to rounding): it moves nothing, and the
forget signal comes from the later max-step epochs, once the min-steps have moved the student. (The
authors run the student in train mode, where batch statistics already make it differ.) The teacher
is the model itself evaluated at a copy of the selected parameters (``torch.func.functional_call``):
one copy of P, not of the model. No guarantee; the model is updated in place.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.func import functional_call

from pipeline.methods.base import RemovalMethod, RemovalOutcome, RemovalProblem, register_method, stream_seed
from pipeline.methods.finetune import (
    FINETUNE_STREAM, FORGET_ORDER_STREAM, SGD, LossRecord, RetainEpochs, SGDSettings, l2, outcome, run_epochs,
    selected_parameters, shuffled_batches,
)
from pipeline.prepared import Prepared
from pipeline.tasks import Batch, Task, output_logits

Divergence = Callable[[Tensor, Tensor, float], Tensor]


class ScrubSettings(SGDSettings):
    epochs: int = Field(3, ge=1, description="epochs; each ends with a min-step pass over D_r")
    max_steps: int = Field(2, ge=0, description="the first this many epochs start with a max-step pass over D_f")
    lr: float = Field(5e-4, gt=0, description="SGD learning rate (constant), both passes")
    batch_size: int = Field(128, ge=1, description="D_r samples per min-step")
    forget_batch_size: int = Field(32, ge=1, description="D_f samples per max-step")
    alpha: float = Field(0.001, ge=0, description="weight of the teacher-student divergence on D_r")
    gamma: float = Field(0.99, ge=0, description="weight of the task loss on D_r")
    temperature: float = Field(4.0, gt=0, description="T of the divergence (softmax(logits / T), times T^2)")
    retain_samples: int | None = Field(
        None, gt=0, description="D_r samples drawn (seeded) per epoch; null = all of D_r")

    @model_validator(mode="after")
    def _max_steps_within_epochs(self) -> "ScrubSettings":
        if self.max_steps > self.epochs:
            raise ValueError(f"max_steps ({self.max_steps}) exceeds epochs ({self.epochs}): max-steps run in the "
                             "first max_steps epochs; raise epochs or lower max_steps")
        return self


def _per_sample_mean(values: Tensor) -> Tensor:
    return values.reshape(values.shape[0], -1).mean(dim=1)


def softmax_kl(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """T^2 (1/B) sum_i KL(softmax(t_i / T) || softmax(s_i / T)), classes along dim 1 (as
    cross-entropy has them), other dims averaged."""
    log_p_s = F.log_softmax(student / temperature, dim=1)
    log_p_t = F.log_softmax(teacher / temperature, dim=1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=1)
    return temperature ** 2 * _per_sample_mean(kl).mean()


def bernoulli_kl(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """T^2 (1/B) sum_i mean_labels KL(Bern(sigmoid(t / T)) || Bern(sigmoid(s / T)))."""
    s, t = student / temperature, teacher / temperature
    p_t = torch.sigmoid(t)
    kl = p_t * (F.logsigmoid(t) - F.logsigmoid(s)) + (1 - p_t) * (F.logsigmoid(-t) - F.logsigmoid(-s))
    return temperature ** 2 * _per_sample_mean(kl).mean()


def gaussian_kl(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """(1/B) sum_i mean_outputs (t - s)^2: KL between the Gaussians whose negative log-likelihood the
    MSE loss is (variance K/2 per output); T^2 KL at outputs / T is the same number, so T is unused."""
    return _per_sample_mean((teacher - student).pow(2)).mean()


DIVERGENCES: dict[str, Divergence] = {"cross_entropy": softmax_kl, "bce_multilabel": bernoulli_kl, "mse": gaussian_kl}


def divergence_for(task: Task) -> Divergence:
    if task.loss not in DIVERGENCES:
        raise ValueError(f"scrub has no teacher-student divergence for the loss '{task.loss}'; "
                         f"it supports {sorted(DIVERGENCES)}")
    return DIVERGENCES[task.loss]


def teacher_forward(model: nn.Module, task: Task, batch: Batch, teacher: dict[str, Tensor]) -> Tensor:
    """The model's outputs with the selected parameters at the teacher's values (no gradient)."""
    args, kwargs = task.model_args(batch)
    with torch.no_grad():
        return output_logits(functional_call(model, teacher, args, kwargs))


@register_method
class Scrub(RemovalMethod):
    """Alternate max-steps on D_f (ascend d) and min-steps on D_r (alpha d + gamma loss + weight decay)."""

    name = "scrub"
    Settings = ScrubSettings

    def remove(self, problem: RemovalProblem, settings: ScrubSettings, prepared: Prepared) -> RemovalOutcome:  # type: ignore[override]
        started = time.perf_counter()
        timings: dict[str, float] = {}
        model, task, forget = problem.model, problem.task, problem.forget
        divergence, T = divergence_for(task), settings.temperature
        params = selected_parameters(model, settings.parameters)
        teacher = {k: p.detach().clone() for k, p in params.items()}
        retain_epochs = RetainEpochs(problem.retain, settings.retain_samples, settings.epochs, settings.batch_size,
                                     torch.Generator().manual_seed(stream_seed(problem.seed, FINETUNE_STREAM)))
        forget_gen = torch.Generator().manual_seed(stream_seed(problem.seed, FORGET_ORDER_STREAM))
        losses = LossRecord(problem, retain_epochs.seen(), timings)
        opt = SGD(params, lr=settings.lr, momentum=settings.momentum)

        def max_objective(batch: Batch) -> Tensor:
            return -divergence(task.forward(model, batch), teacher_forward(model, task, batch, teacher), T)

        def min_objective(batch: Batch) -> Tensor:
            out = task.forward(model, batch)
            value = settings.gamma * task.per_sample_loss(out, batch).mean()
            if settings.alpha > 0:
                value = value + settings.alpha * divergence(out, teacher_forward(model, task, batch, teacher), T)
            return value + l2(params, problem.weight_decay)

        max_steps = min_steps = 0
        for epoch in range(settings.epochs):
            if epoch < settings.max_steps:
                before = opt.steps
                run_epochs(problem, 1, lambda _: shuffled_batches(forget, settings.forget_batch_size, forget_gen),
                           max_objective, opt, timings, "scrub_max")
                max_steps += opt.steps - before
            before = opt.steps
            run_epochs(problem, 1, lambda _, e=epoch: retain_epochs(e), min_objective, opt, timings, "scrub_min")
            min_steps += opt.steps - before

        with problem.stage("losses", timings):
            with torch.no_grad():
                forget_divergence = sum(
                    float(divergence(task.forward(model, b), teacher_forward(model, task, b, teacher), T))
                    * task.batch_size_of(b)
                    for b in forget.batches(problem.batch_size)) / len(forget)
        return outcome(params, {"steps": {"max": max_steps, "min": min_steps}, **losses.after(),
                                "forget_divergence": {"before": 0.0, "after": forget_divergence},
                                "parameters": list(params), "timings": timings,
                                "seconds": time.perf_counter() - started})
