"""A budget-filtered Gauss-Newton step on a parameter block, accepted by a trust region's ratio
test, and a bounded SGD refit of the block: the parts a removal from a network trained end to end
is made of (``block-gauss-newton`` on a network's trailing layers, ``lfoci-newton``'s deep path on
its L-FOCI block).

Step. On the proximal objective of a retrain from w0 on R = D \\ U (tau the recipe's training budget)
    F(w) = L_R(w) - <g_D(w0), w> + (mu / 2) ||w - w0||^2,        mu = 1 / tau (scaled),
one Newton step with the generalised Gauss-Newton curvature G_R of the block (Martens 2010;
``pipeline.curvature.ggn``, on a seeded subsample of R):
    s = -(G_R + (lambda + mu) I)^{-1} (g_R(w0) - g_D(w0)),
lambda the weight decay (inside L_R and G_R), solved by PCG to ``cg_rtol`` or ``cg_max_iter`` (a
truncated solve is still a descent direction of the model); ``preconditioner`` kfac: preconditioned by
(K + d I)^{-1}, d the solve's whole damping (lambda + mu and any retry's), K the K-FAC of G_R on the same
subsample (``pipeline.curvature.kfac``; cross-entropy only, other losses solve unpreconditioned and the
record says so), which buys the products it saves where each runs through the whole network.

Trust region. s is accepted when rho = (F(w0) - F(w0 + s)) / (q(0) - q(s)) >= ``min_ratio``, q the
quadratic model (the same G_R + mu I), F on a seeded probe of R with its linear part made exact
(control variate: F_probe(w) = L_probe(w) + <g_R - g_probe(w0), w - w0> - <g_D, w - w0> +
mu/2 ||w - w0||^2, whose gradient at w0 is g_R - g_D exactly). Otherwise the damping is multiplied
by ``damping_growth`` (from max(lambda + mu, a thousandth of the curvature along the gradient)) and
the step solved again, at most ``max_retries`` times; no accepted step: None (the caller refuses).

Refit. ``epochs`` of the recipe's SGD (its momentum and batch size, its learning rate times
``lr_scale``, cosine decay to zero) on R over the block only (rows outside a row-sliced block are
masked), in eval mode as the caller leaves the model (no dropout draws, batch-norm statistics fixed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.curvature.ggn import BlockGaussNewton
from pipeline.curvature.hessian import BlockObjective, block_gradient
from pipeline.curvature.kfac import BlockKFAC, unsupported_loss
from pipeline.curvature.pcg import pcg
from pipeline.data.sampleset import SampleSet
from pipeline.errors import NonFiniteGradientError
from pipeline.methods.base import RandomStream, stream_seed
from pipeline.methods.finetune import SGD
from pipeline.param_block import ParamBlock
from pipeline.recipe import Recipe
from pipeline.tasks import Task

__all__ = ["TrustRegion", "draw", "gauss_newton_trust_step", "refit_block", "PROBE_STREAM", "REFIT_STREAM"]

# seeded streams of the step's probe and of the refit (hashed with the removal seed; apart from RandomStream's)
PROBE_STREAM = 31
REFIT_STREAM = 32
KFAC_STREAM = 33
PRECONDITIONERS = ("none", "kfac")


@dataclass(frozen=True)
class TrustRegion:
    """The step's settings (each method's Settings carry them under its own field names)."""

    curvature_samples: int | None = 2048
    probe_samples: int | None = 4096
    cg_max_iter: int = 60
    cg_rtol: float = 1e-6
    min_ratio: float = 0.25
    max_retries: int = 4
    damping_growth: float = 2.0
    preconditioner: str = "none"        # or "kfac": K-FAC of G_R preconditions the Gauss-Newton PCG


def draw(data: SampleSet, count: int | None, seed: int) -> SampleSet:
    """A seeded subsample of ``count`` samples of ``data`` in their order (all of it: ``count`` None or >= its size)."""
    if count is None or count >= len(data):
        return data
    g = torch.Generator().manual_seed(seed)
    return data.take(torch.randperm(len(data), generator=g)[:count].sort().values)


def _mean_loss(obj: BlockObjective, data: SampleSet, delta: Tensor, batch_size: int) -> float:
    with torch.no_grad():
        total = sum(float(obj.loss_sum(b)(delta)) for b in data.batches(batch_size))
    return total / len(data)


def gauss_newton_trust_step(model: nn.Module, task: Task, block: ParamBlock, retain: SampleSet, rhs: Tensor,
                            mu: float, lam: float, settings: TrustRegion, *, seed: int, batch_size: int,
                            extra_damping: float = 0.0, inputs: Callable[[SampleSet], SampleSet] | None = None,
                            ) -> tuple[Tensor | None, dict[str, Any]]:
    """The accepted step s (CPU float64; None: none accepted) for ``rhs`` = g_R(w0) - g_D(w0) on the
    block of ``model``, and the trust region's record. ``extra_damping``: Levenberg-Marquardt damping of the
    first solve beyond lambda + mu (it shortens the step; F and the quadratic model keep mu alone). ``inputs``:
    what ``model`` reads of a drawn sample set (a network's suffix: the frozen prefix's outputs), applied to the
    curvature subsample and the probe after they are drawn from ``retain``."""
    if float(rhs.norm()) == 0.0:
        return torch.zeros_like(rhs), {"trials": [], "accepted": True, "note": "g_R = g_D: nothing to move"}
    curvature_set = draw(retain, settings.curvature_samples, stream_seed(seed, RandomStream.CURVATURE_SUBSAMPLE))
    probe = draw(retain, settings.probe_samples, stream_seed(seed, PROBE_STREAM))
    if inputs is not None:
        curvature_set, probe = inputs(curvature_set), inputs(probe)
    if settings.preconditioner not in PRECONDITIONERS:
        raise ValueError(f"the trust region's preconditioner must be one of {PRECONDITIONERS} (got {settings.preconditioner!r})")
    ggn = BlockGaussNewton(model, task, curvature_set, block, lam, reduction="mean", batch_size=batch_size)
    kfac, skipped = None, None
    if settings.preconditioner == "kfac" and (why_not := unsupported_loss(task)) is not None:
        skipped = f"{why_not}: unpreconditioned"
    elif settings.preconditioner == "kfac":
        kfac = BlockKFAC(model, task, curvature_set, block, seed=stream_seed(seed, KFAC_STREAM), batch_size=batch_size)
    obj = BlockObjective(model, task, block)
    w0 = obj.w_block.to("cpu", torch.float64)
    eval_batch = memory.forward_batch_size(model, task, probe, batch_size)
    # the probe's gradient at w0 (mean loss only): the control variate that makes F_probe's linear part exact
    g_probe = block_gradient(model, task, probe, block, 0.0, reduction="mean", batch_size=batch_size)
    f0 = _mean_loss(obj, probe, obj.zeros(), eval_batch) + 0.5 * lam * float(w0 @ w0)

    def objective(s: Tensor) -> float:
        """F_probe(w0 + s) - F_probe(w0): the probe's curvature part, the exact linear part."""
        w = w0 + s
        loss = _mean_loss(obj, probe, s.to(obj.device, obj.dtype), eval_batch) + 0.5 * lam * float(w @ w)
        # L_probe(w) - L_probe(w0) - <g_probe + lam w0, s> + <rhs, s> + mu/2 ||s||^2
        return (loss - f0) - float((g_probe + lam * w0) @ s) + float(rhs @ s) + 0.5 * mu * float(s @ s)

    trials: list[dict[str, Any]] = []
    total = lam + mu + extra_damping  # the damping of the solve, lambda included (G_R holds lambda)
    floor: float | None = None
    sizes = {"curvature_samples": len(curvature_set), "probe_samples": len(probe),
             "preconditioner": "none" if kfac is None else "K-FAC", **({} if kfac is None else {"kfac": kfac.describe()}),
             **({} if skipped is None else {"preconditioner_skipped": skipped})}
    for attempt in range(settings.max_retries + 1):
        if attempt > 0:
            if floor is None:  # a thousandth of the curvature along the gradient
                floor = 1e-3 * float(rhs @ ggn.matvec(rhs)) / float(rhs @ rhs)
            total = max(total, floor) * settings.damping_growth
        extra = total - lam
        result = pcg(lambda v: ggn.matvec(v) + extra * v, -rhs, rtol=settings.cg_rtol, max_iter=settings.cg_max_iter,
                     precondition=None if kfac is None else (lambda r: kfac.solve(r, total)),
                     progress="Gauss-Newton PCG")
        s = result.x
        trial: dict[str, Any] = {"damping": total, "cg_iterations": result.iterations,
                                 "cg_converged": result.converged, "cg_relative_residual": result.relative_residual,
                                 "step_norm": float(s.norm()), "predicted": None, "actual": None, "ratio": None,
                                 "accepted": False}
        trials.append(trial)
        try:
            gs = ggn.matvec(s)
            predicted = -(float(rhs @ s) + 0.5 * (float(s @ gs) + mu * float(s @ s)))
            actual = -objective(s)
        except NonFiniteGradientError as err:
            trial["error"] = str(err)
            continue
        ratio = actual / predicted if predicted > 0 else float("nan")
        trial.update(predicted=predicted, actual=actual, ratio=ratio if math.isfinite(ratio) else None)
        if predicted > 0 and math.isfinite(ratio) and ratio >= settings.min_ratio:
            trial["accepted"] = True
            return s, {"trials": trials, "accepted": True, **sizes, "products": ggn.products}
    return None, {"trials": trials, "accepted": False, **sizes, "products": ggn.products}


def _row_masks(model: nn.Module, block: ParamBlock) -> dict[str, Tensor]:
    """0/1 masks of a row-sliced block's parts (whole parameters need none)."""
    params = dict(model.named_parameters())
    masks = {}
    for part in block.parts:
        if part.rows is not None:
            p = params[part.name]
            mask = torch.zeros(p.shape[0], *([1] * (p.dim() - 1)), dtype=p.dtype, device=p.device)
            mask[part.rows.to(p.device)] = 1.0
            masks[part.name] = mask
    return masks


def refit_block(model: nn.Module, task: Task, block: ParamBlock, retain: SampleSet, recipe: Recipe | None,
                lam: float, *, epochs: float, lr_scale: float, seed: int,
                inputs: Callable[[SampleSet], SampleSet] | None = None, epoch_size: int | None = None,
                ahead: Callable[[SampleSet], Any] | None = None) -> dict[str, Any]:
    """``epochs`` of the recipe's SGD on R over the block (in place), cosine decay to zero. ``inputs``: what ``model``
    reads of a batch of R (a network's suffix: the frozen prefix's outputs); ``ahead``: called once per pass over R
    with the samples its steps will visit (to compute their frozen-prefix rows in one go). ``epoch_size``: the
    samples an epoch counts (default |R|; more where ``retain`` is a pool drawn from a larger R, whose epoch sets
    the steps)."""
    if epochs == 0 or lr_scale == 0:
        return {"skipped": "refit epochs or learning-rate scale is 0"}
    if recipe is None or recipe.optimizer != "sgd" or recipe.lr <= 0 or recipe.batch_size < 1:
        return {"skipped": "the model card's recipe has no SGD learning rate to refit with"}
    if len(retain) == 0:
        return {"skipped": "no retained sample to refit on"}
    params = dict(model.named_parameters())
    chosen = {part.name: params[part.name] for part in block.parts}
    lr0 = recipe.lr * lr_scale
    opt = SGD(chosen, lr=lr0, momentum=recipe.momentum, masks=_row_masks(model, block))
    per_epoch = math.ceil((len(retain) if epoch_size is None else epoch_size) / recipe.batch_size)
    steps = max(1, math.ceil(epochs * per_epoch))
    gen = torch.Generator().manual_seed(stream_seed(seed, REFIT_STREAM))
    done = 0
    with torch.enable_grad():
        while done < steps:
            order = torch.randperm(len(retain), generator=gen)
            if ahead is not None:
                ahead(retain.take(order[:(steps - done) * recipe.batch_size]))
            for start in range(0, len(order), recipe.batch_size):
                if done >= steps:
                    break
                batch = retain.take(order[start:start + recipe.batch_size])
                batch = (batch if inputs is None else inputs(batch)).columns
                opt.lr = lr0 * 0.5 * (1.0 + math.cos(math.pi * done / steps))
                loss = task.per_sample_loss(task.forward(model, batch), batch).mean()
                loss = loss + 0.5 * lam * sum(p.pow(2).sum() for p in chosen.values())
                opt.step(loss)
                done += 1
    return {"steps": done, "epochs": epochs, "lr": lr0, "momentum": recipe.momentum,
            "batch_size": recipe.batch_size, "samples": len(retain) if epoch_size is None else epoch_size}
