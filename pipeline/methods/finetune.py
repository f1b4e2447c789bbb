"""Fine-tune ("FT", Warnecke et al. 2023; Jia et al., NeurIPS 2023): a few epochs of SGD with
momentum on the retained data D_r, starting from the trained weights; catastrophic forgetting
of D_f, no guarantee. Also the mini-batch SGD machinery shared by the field's reference
approximate methods (gradient ascent, random labels, SalUn, NegGrad+, SCRUB, l1-sparse).

One step on a batch B of the objective J (mean loss over B, plus (lambda/2)||w_P||^2 for
descent objectives), on the parameters P (PyTorch's SGD convention, dampening 0):
    g   = mask * grad_P J(w)          (mask = 1 unless a saliency mask is given)
    b   <- momentum * b + g
    w_P <- w_P - lr * b
Shuffling is seeded per removal (``stream_seed(problem.seed, FINETUNE_STREAM)``); the model
runs in eval mode (no dropout draws, BatchNorm statistics untouched), so a removal repeats
exactly. The model is updated in place; ``new_parameters`` holds the changed parameters.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Literal, TypeVar

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.prepared import Prepared
from pipeline.methods.base import (
    MethodSettings, RemovalMethod, RemovalOutcome, RemovalProblem, register_method, stream_seed,
)
from pipeline.tasks import Batch, Task

# Random streams of the SGD-based baselines (hashed with the removal seed by ``stream_seed``;
# numbers kept apart from pipeline.methods.base.RandomStream's).
FINETUNE_STREAM = 21
RANDOM_LABEL_STREAM = 22
FORGET_ORDER_STREAM = 23  # the order of D_f's batches where D_r's batches come from FINETUNE_STREAM

T = TypeVar("T")


class SGDSettings(MethodSettings):
    """Settings every SGD-based baseline shares."""

    parameters: Literal["all"] | list[str] = Field(
        "all", description="'all' trainable parameters, or qualified names (e.g. [fc.weight, fc.bias])")
    epochs: int = Field(2, ge=1, description="passes over the method's data")
    lr: float = Field(0.01, gt=0, description="SGD learning rate (constant)")
    momentum: float = Field(0.9, ge=0, lt=1)
    batch_size: int = Field(128, ge=1)


class FineTuneSettings(SGDSettings):
    retain_samples: int | None = Field(
        None, gt=0, description="D_r samples drawn (seeded) per epoch; null = all of D_r")


def selected_parameters(model: nn.Module, names: Literal["all"] | list[str]) -> dict[str, nn.Parameter]:
    """The parameters a baseline updates: every trainable one, or the named ones."""
    params = dict(model.named_parameters())
    if names == "all":
        chosen = {k: p for k, p in params.items() if p.requires_grad}
    else:
        unknown = [k for k in names if k not in params]
        if unknown:
            raise ValueError(f"settings.parameters names unknown parameters {unknown}; "
                             f"the model has e.g. {list(params)[:6]}")
        chosen = {k: params[k] for k in names}
    if not chosen:
        raise ValueError("settings.parameters selects no trainable parameter")
    return chosen


def shuffled_batches(data: SampleSet, batch_size: int, generator: torch.Generator) -> Iterator[Batch]:
    """One epoch of ``data`` in a seeded random order."""
    order = torch.randperm(len(data), generator=generator)
    for start in range(0, len(data), batch_size):
        yield data.take(order[start:start + batch_size]).columns


def draw_positions(n: int, count: int | None, generator: torch.Generator) -> Tensor:
    """Positions (sorted) of a seeded draw of ``count`` of ``n`` samples; all of them (drawing
    nothing from ``generator``) when ``count`` is None or at least ``n``."""
    if count is None or count >= n:
        return torch.arange(n)
    return torch.randperm(n, generator=generator)[:count].sort().values


def retain_draw(retain: SampleSet, count: int | None, generator: torch.Generator) -> SampleSet:
    """All of D_r, or a seeded draw of ``count`` samples of it."""
    if count is None or count >= len(retain):
        return retain
    return retain.take(draw_positions(len(retain), count, generator))


class RetainEpochs:
    """The retained batches of every epoch, drawn up front: per epoch a seeded draw of ``count``
    samples of D_r (all when None), then a seeded order over it, consumed from ``generator`` in the
    order ``FineTune`` consumes it lazily (draw, order, next epoch), so that with the same seed the
    batches are exactly fine-tuning's. ``seen()`` is every retained sample some epoch visits."""

    def __init__(self, retain: SampleSet, count: int | None, epochs: int, batch_size: int,
                 generator: torch.Generator) -> None:
        self.retain, self.batch_size = retain, batch_size
        self.orders: list[Tensor] = []
        for _ in range(epochs):
            drawn = draw_positions(len(retain), count, generator)
            self.orders.append(drawn[torch.randperm(len(drawn), generator=generator)])

    def __call__(self, epoch: int) -> Iterator[Batch]:
        order = self.orders[epoch]
        for start in range(0, len(order), self.batch_size):
            yield self.retain.take(order[start:start + self.batch_size]).columns

    def seen(self) -> SampleSet:
        return self.retain.take(torch.unique(torch.cat(self.orders)))


def mean_batch_loss(model: nn.Module, task: Task, batch: Batch) -> Tensor:
    return task.per_sample_loss(task.forward(model, batch), batch).mean()


class SGD:
    """Manual SGD with momentum on named parameters, with an optional 0/1 mask per parameter."""

    def __init__(self, params: dict[str, nn.Parameter], *, lr: float, momentum: float,
                 masks: dict[str, Tensor] | None = None) -> None:
        self.params, self.lr, self.momentum, self.masks = params, lr, momentum, masks or {}
        self.buffers: dict[str, Tensor] = {}
        self.steps = 0

    def step(self, objective: Tensor) -> None:
        names = list(self.params)
        grads = torch.autograd.grad(objective, [self.params[k] for k in names], allow_unused=True)
        with torch.no_grad():
            for name, g in zip(names, grads):
                if g is None:
                    continue
                if name in self.masks:
                    g = g * self.masks[name]
                buf = self.buffers.get(name)
                buf = g.clone() if buf is None else buf.mul_(self.momentum).add_(g)
                self.buffers[name] = buf
                self.params[name].sub_(self.lr * buf)
        self.steps += 1


def l2(params: dict[str, nn.Parameter], weight_decay: float) -> Tensor | float:
    if weight_decay == 0:
        return 0.0
    return 0.5 * weight_decay * sum(p.pow(2).sum() for p in params.values())


def run_epochs(problem: RemovalProblem, epochs: int, epoch_batches: Callable[[int], Iterable[T]],
               objective: Callable[[T], Tensor], optimizer: SGD, timings: dict[str, float],
               stage: str) -> None:
    """``epochs`` passes; each batch's ``objective`` is minimised by one optimizer step (a "batch"
    is whatever ``epoch_batches`` yields: a Batch, or e.g. a pair of them)."""
    with problem.stage(stage, timings):
        for epoch in range(epochs):
            for batch in epoch_batches(epoch):
                optimizer.step(objective(batch))


def outcome(params: dict[str, nn.Parameter], record: dict) -> RemovalOutcome:
    return RemovalOutcome({k: p.detach().clone() for k, p in params.items()}, record)


def mean_loss(model: nn.Module, task: Task, data: SampleSet, batch_size: int) -> float:
    """(1/|S|) sum_{z in S} loss(w, z), without gradients."""
    with torch.no_grad():
        total = sum(float(task.per_sample_loss(task.forward(model, b), b).sum()) for b in data.batches(batch_size))
    return total / len(data)


def forget_loss(model: nn.Module, task: Task, forget: SampleSet, batch_size: int) -> float:
    return mean_loss(model, task, forget, batch_size)


class LossRecord:
    """Mean losses on D_f and on the retained samples a removal visits (``RetainEpochs.seen``),
    measured at construction (before the removal) and by ``after()``; timed as stage "losses"."""

    def __init__(self, problem: RemovalProblem, retain_seen: SampleSet, timings: dict[str, float]) -> None:
        self.problem, self.retain_seen, self.timings = problem, retain_seen, timings
        self.before = self._measure()

    def _measure(self) -> tuple[float, float]:
        p = self.problem
        with p.stage("losses", self.timings):
            return (mean_loss(p.model, p.task, p.forget, p.batch_size),
                    mean_loss(p.model, p.task, self.retain_seen, p.batch_size))

    def after(self) -> dict:
        forget, retain = self._measure()
        return {"forget_loss": {"before": self.before[0], "after": forget},
                "retain_loss": {"before": self.before[1], "after": retain, "samples": len(self.retain_seen)}}


@register_method
class FineTune(RemovalMethod):
    """Minimise (1/|B|) sum_B loss + (lambda/2)||w_P||^2 over batches of D_r, from the trained w."""

    name = "finetune"
    Settings = FineTuneSettings

    def remove(self, problem: RemovalProblem, settings: FineTuneSettings, prepared: Prepared) -> RemovalOutcome:  # type: ignore[override]
        started = time.perf_counter()
        timings: dict[str, float] = {}
        model, task = problem.model, problem.task
        params = selected_parameters(model, settings.parameters)
        gen = torch.Generator().manual_seed(stream_seed(problem.seed, FINETUNE_STREAM))
        retain = problem.retain
        opt = SGD(params, lr=settings.lr, momentum=settings.momentum)
        before = forget_loss(model, task, problem.forget, problem.batch_size)
        run_epochs(problem, settings.epochs,
                   lambda _: shuffled_batches(retain_draw(retain, settings.retain_samples, gen), settings.batch_size, gen),
                   lambda b: mean_batch_loss(model, task, b) + l2(params, problem.weight_decay), opt, timings, "finetune")
        after = forget_loss(model, task, problem.forget, problem.batch_size)
        return outcome(params, {"steps": opt.steps, "forget_loss": {"before": before, "after": after},
                                "parameters": list(params), "timings": timings,
                                "seconds": time.perf_counter() - started})
