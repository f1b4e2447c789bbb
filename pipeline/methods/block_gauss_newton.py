"""A removal for networks trained end to end: a budget-filtered Gauss-Newton step on the network's
trailing layers, a trust region, and a bounded refit: ``block-gauss-newton``.

Scope (``pipeline.methods.trailing_scope``). The trailing modules of the network whose forward cost is at most
``scope_cost_share`` of the whole forward pass (multiply-accumulates counted by forward hooks on one batch: a Linear
out.numel x in_features, a Conv out.numel x in_channels / groups x kernel size; other modules
count nothing), cut where a registered splitter divides the model (``pipeline.frozen_prefix``:
nn.Sequential, ``vggface``, ``reid-resnet50``, the text presets). Every trainable parameter of the
suffix moves (the block P); the prefix before it runs once over D (cached features), never inside
a curvature product. With ``scope_cost_share: 1`` the whole model is the scope.

Step. The target is a retrain from the trained weights w0 on R = D \\ U with the model card's
recipe, whose budget tau = sum of its learning rates / (1 - momentum) as heavy ball applies them
(``pipeline.target.ReplaySchedule.training_time``; infinity for a recipe run to an optimum). On the proximal objective
    F(w) = L_R(w) - <g_D(w0), w> + (mu / 2) ||w - w0||^2,     mu = filter_scale / tau,
one Newton step with the generalised Gauss-Newton curvature G_R of the scope (Martens 2010;
``pipeline.curvature.ggn.BlockGaussNewton``, on a seeded subsample of ``curvature_samples`` of R):
    s = -(G_R + (lambda + mu) I)^{-1} (g_R(w0) - g_D(w0)),
with g_R = (n g_D - m g_U) / (n - m) (a pass over U; g_D is prepared) and lambda the card's weight
decay (inside L_R and G_R). At an optimum of L_D with mu = 0 and a convex loss of an affine model
this is the exact Newton step to the minimiser of L_R; the damping mu filters the directions the
training budget could not move (curvature h << 1/tau) as retraining leaves them
(docs/METHODS.md). Solved by the project's PCG (``pipeline.curvature.pcg``) to ``cg_rtol`` or
``cg_max_iter`` iterations (a truncated solve is still a descent direction of the model).

Trust region and refit (``pipeline.methods.trust_region``, shared with ``lfoci-newton``'s deep path): the
step is accepted when the ratio of the actual to the predicted decrease of F on a seeded probe of
``probe_samples`` of R is at least ``min_ratio``, else solved again with ``damping_growth`` times the
damping, at most ``max_retries`` times; when no step is accepted the request is refused
(``RemovalNotServed`` -> ``needs_retrain``) and the model is left as it was. Then ``refit_epochs`` of
the recipe's SGD (learning rate times ``refit_lr_scale``, cosine decay) on R over the scope's parameters,
through the suffix on the cached features, in eval mode; skipped (recorded) without an SGD recipe.

A heuristic: no noise, no certificate (the release says so). Prepared once per model version
(what does not depend on U): the scope, the prefix's outputs on D (refused before anything is computed where
they would take more than half the memory budget: ``trailing_scope.scope_inputs``) and g_D; a removal keeps the
features of D \\ U for the next version (``after_removal``: only the suffix moved) and recomputes
g_D there. The record gives each part's seconds: the preparation's (prefix, gradient), then the
removal's gradients, step (curvature, solves, ratio tests) and refit.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from pipeline.curvature.hessian import block_gradient
from pipeline.data.sampleset import SampleSet
from pipeline.errors import RemovalNotServed
from pipeline.eval_mode import eval_mode_restored
from pipeline.methods.base import (
    MethodSettings, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method,
)
from pipeline.methods.trailing_scope import Scope, carried_inputs, choose_scope, scope_inputs
from pipeline.methods.trust_region import TrustRegion, gauss_newton_trust_step, refit_block
from pipeline.prepared import Binding, Prepared
from pipeline.privacy.release import PrivacyRelease
from pipeline.recipe import Recipe, recipe_of
from pipeline.target import replay_schedule
from pipeline.tasks import Task

__all__ = ["BlockGaussNewton", "BlockGaussNewtonPrepared", "BlockGaussNewtonSettings"]


class BlockGaussNewtonSettings(MethodSettings):
    scope_cost_share: float = Field(
        0.34, gt=0, le=1, description="the scope: the trailing modules whose forward cost (multiply-accumulates) is at "
                                      "most this share of the whole forward pass (1: the whole model)")
    curvature_samples: int | None = Field(
        2048, gt=0, description="Gauss-Newton products over a seeded subsample of this many retained samples (null: all)")
    filter_scale: float = Field(
        1.0, ge=0, description="mu = filter_scale / tau, tau = the recipe's sum of learning rates / (1 - momentum): "
                               "directions the training budget could not move are not moved (0: the plain Newton step)")
    budget: float | None = Field(
        None, gt=0, description="tau itself (null: from the model card's recipe, pipeline.target.ReplaySchedule.training_time)")
    preconditioner: Literal["none", "kfac"] = Field(
        "none", description="the Gauss-Newton PCG's preconditioner: kfac = (K-FAC + damping I)^{-1}, K-FAC on the "
                            "curvature subsample (one pass over it)")
    cg_max_iter: int = Field(60, gt=0, description="PCG iterations per solve")
    cg_rtol: float = Field(1e-6, gt=0, description="PCG stops at this relative residual")
    probe_samples: int | None = Field(
        4096, gt=0, description="the trust region's ratio test evaluates the objective on a seeded probe of this many "
                                "retained samples (null: all)")
    min_ratio: float = Field(0.25, ge=0, lt=1, description="accept a step when actual / predicted decrease >= this")
    max_retries: int = Field(4, ge=0, description="damping increases tried after the first step is rejected")
    damping_growth: float = Field(2.0, gt=1, description="the damping is multiplied by this at each retry")
    refit_epochs: float = Field(0.5, ge=0, description="epochs of the recipe's SGD on R over the scope after the step "
                                                       "(0: none)")
    refit_lr_scale: float = Field(0.2, ge=0, description="refit learning rate = the recipe's lr x this")


# -- the prepared state ---------------------------------------------------------------------------
@dataclass
class BlockGaussNewtonPrepared(Prepared):
    """The scope, D's features at the split (the prefix's outputs; D itself without a split), g_D on the
    block at the trained weights, and the prefix's digest (``after_removal`` checks it)."""

    scope: Scope | None = None
    features: SampleSet | None = None
    task: Task | None = None
    gradient: Tensor | None = None
    prefix: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    what = ("the scope (trailing layers by forward cost), the prefix's outputs on D and the mean gradient g_D of the "
            "scope's parameters")

    def after_removal(self, trained: Any, removed: Tensor, outcome: Any, binding: Binding) -> "Prepared | None":
        """Only the suffix moved: the features of D \\ U stay; g_D is recomputed at the new weights."""
        assert self.scope is not None and self.features is not None and self.task is not None
        split = self.scope.split
        features = carried_inputs(self.scope, self.features, self.prefix, trained.model, removed)
        if features is None:
            return None
        started = time.perf_counter()
        with eval_mode_restored(trained.model):
            suffix = split.suffix_of(trained.model) if split is not None else trained.model
            gradient = block_gradient(suffix, self.task, features, self.scope.block, trained.weight_decay,
                                      reduction="mean", batch_size=trained.batch_size)
        seconds = time.perf_counter() - started
        return BlockGaussNewtonPrepared(binding, seconds, {**self.details, "updated_from_removal": True,
                                                           "gradient_seconds": seconds},
                                        scope=self.scope, features=features, task=self.task, gradient=gradient,
                                        prefix=self.prefix)


def _trust_region(settings: BlockGaussNewtonSettings) -> TrustRegion:
    return TrustRegion(curvature_samples=settings.curvature_samples, probe_samples=settings.probe_samples,
                       cg_max_iter=settings.cg_max_iter, cg_rtol=settings.cg_rtol, min_ratio=settings.min_ratio,
                       max_retries=settings.max_retries, damping_growth=settings.damping_growth,
                       preconditioner=settings.preconditioner)


def _budget(trained: TrainedModel | RemovalProblem, settings: BlockGaussNewtonSettings) -> tuple[float | None, Recipe | None]:
    """(tau, the recipe): tau from settings.budget or the card's recipe (None when neither is known)."""
    card = trained.card
    recipe = recipe_of(card) if card is not None else None
    if settings.budget is not None:
        return settings.budget, recipe
    if recipe is None:
        return None, None
    n = int(card.training.n) + len(card.training.removed_ids)  # the recipe ran on the first version's data
    schedule = replay_schedule(card, card.training.weight_decay)
    return (math.inf if schedule is None else schedule.training_time(n)), recipe


# -- the method -----------------------------------------------------------------------------------
@register_method
class BlockGaussNewton(RemovalMethod):
    name = "block-gauss-newton"
    Settings = BlockGaussNewtonSettings
    PREPARED_FROM = ("scope_cost_share",)

    def prepare(self, trained: TrainedModel, settings: BlockGaussNewtonSettings,  # type: ignore[override]
                binding: Binding) -> BlockGaussNewtonPrepared:
        started = time.perf_counter()
        scope = choose_scope(trained.model, trained.task, trained.train, settings.scope_cost_share)
        t_scope = time.perf_counter() - started
        inputs = scope_inputs(trained.model, trained.task, trained.train, scope, trained.batch_size)
        features, task = inputs.features, inputs.task
        suffix = scope.split.suffix_of(trained.model) if scope.split is not None else trained.model
        t = time.perf_counter()
        gradient = block_gradient(suffix, task, features, scope.block, trained.weight_decay, reduction="mean",
                                  batch_size=trained.batch_size)
        t_gradient = time.perf_counter() - t
        return BlockGaussNewtonPrepared(
            binding, details={"scope": scope.details, "scope_seconds": t_scope, "prefix_seconds": inputs.seconds,
                              "gradient_seconds": t_gradient},
            scope=scope, features=features, task=task, gradient=gradient, prefix=inputs.prefix)

    def remove(self, problem: RemovalProblem, settings: BlockGaussNewtonSettings,  # type: ignore[override]
               prepared: BlockGaussNewtonPrepared) -> RemovalOutcome:
        assert prepared.scope is not None and prepared.features is not None and prepared.gradient is not None
        timings: dict[str, float] = {}
        scope, block, task = prepared.scope, prepared.scope.block, prepared.task
        assert task is not None
        suffix = scope.split.suffix_of(problem.model) if scope.split is not None else problem.model
        n, m, lam = problem.n, problem.m, problem.weight_decay
        tau, recipe = _budget(problem, settings)
        if settings.filter_scale > 0 and tau is None:
            raise ValueError("settings.budget: the model has no card with a recipe, so the training budget tau is "
                             "unknown; give budget (sum of learning rates / (1 - momentum)) or filter_scale: 0")
        mu = 0.0 if settings.filter_scale == 0 or tau is None or math.isinf(tau) else settings.filter_scale / tau
        forget = prepared.features.take(problem.forget_positions)
        retain = prepared.features.without(problem.forget_positions)

        with problem.stage("gradients", timings):
            g_u = block_gradient(suffix, task, forget, block, lam, reduction="mean", batch_size=problem.batch_size)
            g_d = prepared.gradient
            rhs = (m / (n - m)) * (g_d - g_u)  # g_R - g_D, g_R = (n g_D - m g_U) / (n - m)

        with problem.stage("step", timings):
            step, trust = gauss_newton_trust_step(suffix, task, block, retain, rhs, mu, lam, _trust_region(settings),
                                                  seed=problem.seed, batch_size=problem.batch_size)
        record: dict[str, Any] = {
            "scope": scope.details,
            "filter": {"tau": tau, "mu": mu, "filter_scale": settings.filter_scale, "weight_decay": lam},
            "gradients": {"rhs_norm": float(rhs.norm()), "forget_gradient_norm": float(g_u.norm()),
                          "training_gradient_norm": float(g_d.norm())},
            "trust_region": trust,
        }
        if step is None:
            raise RemovalNotServed(
                f"no Gauss-Newton step on the scope passed the trust region's ratio test in "
                f"{len(trust['trials'])} tries (best ratio {max((t['ratio'] for t in trust['trials'] if t['ratio'] is not None), default=float('nan')):.3g}, "
                f"needs {settings.min_ratio}): the quadratic model does not describe this removal; retrain",
                {**record, "timings": timings})

        params = dict(suffix.named_parameters())
        saved = {part.name: params[part.name].detach().clone() for part in block.parts}
        try:
            block.add_to_model(suffix, step)
            with problem.stage("refit", timings):
                record["refit"] = refit_block(suffix, task, block, retain, recipe, lam, epochs=settings.refit_epochs,
                                              lr_scale=settings.refit_lr_scale, seed=problem.seed)
        except BaseException:
            with torch.no_grad():
                for name, value in saved.items():
                    params[name].copy_(value)
            raise
        record["step_norm"] = float(step.norm())
        record["timings"] = timings
        new = {part.name: params[part.name].detach().clone() for part in block.parts}
        return RemovalOutcome(new, record, PrivacyRelease.non_private(
            "no noise: a Gauss-Newton step and a refit of a non-convex network's trailing layers (a heuristic "
            "removal, no certificate)"))
