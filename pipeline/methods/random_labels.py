"""Random labels ("RL", Golatkar et al. 2020's baseline as run by Fan et al., ICLR 2024 and
Jia et al., NeurIPS 2023): fine-tune on D_f relabelled at random together with D_r.

Each forget sample gets a label drawn uniformly from the *other* classes,
    y' = (y + u) mod K,  u ~ Uniform{1, ..., K-1}   (seeded per removal; K = model outputs),
then ``epochs`` seeded passes of SGD (momentum, constant lr) over the union of the relabelled
D_f and D_r (or a seeded draw of ``retain_samples`` of D_r per epoch) minimise the mean loss
+ (lambda/2)||w_P||^2. Single-label classification only. The model is updated in place.
``masks`` restricts the update to masked weights (used by SalUn).
"""
from __future__ import annotations

import time

import torch
from pydantic import Field
from torch import Tensor

from pipeline.data.sampleset import SampleSet
from pipeline.prepared import Prepared
from pipeline.methods.base import RemovalMethod, RemovalOutcome, RemovalProblem, register_method, stream_seed
from pipeline.methods.finetune import (
    FINETUNE_STREAM, RANDOM_LABEL_STREAM, SGD, SGDSettings, forget_loss, l2, mean_batch_loss, outcome,
    retain_draw, run_epochs, selected_parameters, shuffled_batches,
)


class RandomLabelSettings(SGDSettings):
    retain_samples: int | None = Field(
        None, gt=0, description="D_r samples drawn (seeded) per epoch beside D_f; null = all of D_r")


def random_other_labels(y: Tensor, num_classes: int, generator: torch.Generator) -> Tensor:
    """A label != y for each sample, uniform over the K - 1 other classes."""
    if num_classes < 2:
        raise ValueError("random labels need at least two classes")
    shift = torch.randint(1, num_classes, y.shape, generator=generator)
    return (y.long() + shift) % num_classes


def num_classes(problem: RemovalProblem) -> int:
    """K from the model's output on one forget sample; refuses non-classification tasks."""
    if problem.task.loss != "cross_entropy":
        raise ValueError(f"random labels need a single-label classification task (cross_entropy); "
                         f"this task's loss is '{problem.task.loss}'")
    with torch.no_grad():
        logits = problem.task.forward(problem.model, problem.forget.take([0]).columns)
    return int(logits.shape[-1])


def relabelled_forget(problem: RemovalProblem) -> SampleSet:
    forget = problem.forget
    gen = torch.Generator().manual_seed(stream_seed(problem.seed, RANDOM_LABEL_STREAM))
    y_new = random_other_labels(forget.columns["y"], num_classes(problem), gen)
    return SampleSet({**forget.columns, "y": y_new}, forget.sample_ids)


def concatenate(a: SampleSet, b: SampleSet) -> SampleSet:
    return SampleSet({k: torch.cat([a.columns[k], b.columns[k]]) for k in a.columns},
                     torch.cat([a.sample_ids, b.sample_ids]))


def random_label_finetune(problem: RemovalProblem, settings: RandomLabelSettings,
                          masks: dict[str, Tensor] | None, timings: dict[str, float]) -> dict:
    """The RL fine-tuning loop (updates ``problem.model`` in place); returns the record."""
    model, task = problem.model, problem.task
    params = selected_parameters(model, settings.parameters)
    relabelled = relabelled_forget(problem)
    retain = problem.retain
    gen = torch.Generator().manual_seed(stream_seed(problem.seed, FINETUNE_STREAM))
    opt = SGD(params, lr=settings.lr, momentum=settings.momentum, masks=masks)
    before = forget_loss(model, task, problem.forget, problem.batch_size)
    run_epochs(problem, settings.epochs,
               lambda _: shuffled_batches(concatenate(relabelled, retain_draw(retain, settings.retain_samples, gen)),
                                          settings.batch_size, gen),
               lambda b: mean_batch_loss(model, task, b) + l2(params, problem.weight_decay), opt, timings,
               "random_label_finetune")
    after = forget_loss(model, task, problem.forget, problem.batch_size)
    return {"params": params, "steps": opt.steps, "forget_loss": {"before": before, "after": after},
            "parameters": list(params)}


@register_method
class RandomLabels(RemovalMethod):
    name = "random-labels"
    Settings = RandomLabelSettings

    def remove(self, problem: RemovalProblem, settings: RandomLabelSettings, prepared: Prepared) -> RemovalOutcome:  # type: ignore[override]
        started = time.perf_counter()
        timings: dict[str, float] = {}
        record = random_label_finetune(problem, settings, None, timings)
        params = record.pop("params")
        return outcome(params, {**record, "timings": timings, "seconds": time.perf_counter() - started})
