"""SalUn (Fan, Liu, Zhang, Wei, Wong, Liu, "SalUn: Empowering Machine Unlearning via Gradient-
based Weight Saliency", ICLR 2024): random-label fine-tuning of the salient weights only.

Saliency of each weight: the magnitude of the gradient of the forget loss at the trained w,
    s = | grad_w (1/|D_f|) sum_{z in D_f} loss(w, z) |,
and the mask keeps the top ``sparsity`` fraction of all selected weights (one global
threshold over every selected parameter, as the paper's code does):
    mask = [s >= quantile_{1 - sparsity}(s)].
Then random-label fine-tuning (``pipeline.methods.random_labels``) with every gradient
multiplied by the mask, so weights outside the mask keep their trained values exactly.
"""
from __future__ import annotations

import time

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.prepared import Prepared
from pipeline.methods.base import RemovalMethod, RemovalOutcome, RemovalProblem, register_method
from pipeline.methods.finetune import outcome, selected_parameters
from pipeline.methods.random_labels import RandomLabelSettings, random_label_finetune


class SalUnSettings(RandomLabelSettings):
    sparsity: float = Field(0.5, gt=0, le=1, description="fraction of the selected weights in the mask")


def forget_gradient(problem: RemovalProblem, params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """grad of the mean forget loss with respect to each selected parameter."""
    names = list(params)
    total = [torch.zeros_like(p) for p in params.values()]
    model, task, forget = problem.model, problem.task, problem.forget
    for batch in forget.batches(problem.batch_size):
        loss = task.per_sample_loss(task.forward(model, batch), batch).sum() / len(forget)
        grads = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
        for acc, g in zip(total, grads):
            if g is not None:
                acc.add_(g)
    return dict(zip(names, total))


def saliency_masks(gradients: dict[str, Tensor], sparsity: float) -> dict[str, Tensor]:
    """0/1 masks keeping the top ``sparsity`` fraction of |gradient| over all parameters."""
    flat = torch.cat([g.abs().flatten() for g in gradients.values()])
    keep = max(1, int(round(sparsity * flat.numel())))
    threshold = torch.topk(flat, keep).values.min()
    return {k: (g.abs() >= threshold).to(g.dtype) for k, g in gradients.items()}


@register_method
class SalUn(RemovalMethod):
    name = "salun"
    Settings = SalUnSettings

    def remove(self, problem: RemovalProblem, settings: SalUnSettings, prepared: Prepared) -> RemovalOutcome:  # type: ignore[override]
        started = time.perf_counter()
        timings: dict[str, float] = {}
        with problem.stage("saliency", timings):
            masks = saliency_masks(forget_gradient(problem, selected_parameters(problem.model, settings.parameters)),
                                   settings.sparsity)
        rl = RandomLabelSettings(**settings.model_dump(exclude={"sparsity"}))
        record = random_label_finetune(problem, rl, masks, timings)
        params = record.pop("params")
        kept = int(sum(float(m.sum()) for m in masks.values()))
        total = sum(m.numel() for m in masks.values())
        return outcome(params, {**record, "mask": {"kept": kept, "of": total, "fraction": kept / total},
                                "timings": timings, "seconds": time.perf_counter() - started})
