"""A removal for networks trained end to end: a budget-filtered Gauss-Newton step on the network's
trailing layers, a trust region, and a bounded refit: ``block-gauss-newton``.

Scope. The trailing modules of the network whose forward cost is at most ``scope_cost_share`` of
the whole forward pass (multiply-accumulates counted by forward hooks on one batch: a Linear
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
(what does not depend on U): the scope, the prefix's outputs on D and g_D; a removal keeps the
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
from torch import Tensor, nn

from pipeline.curvature.hessian import block_gradient
from pipeline.data.sampleset import SampleSet
from pipeline.errors import RemovalNotServed
from pipeline.eval_mode import eval_mode_restored
from pipeline.frozen_prefix import Split, cache_frozen_prefix, prefix_digest
from pipeline.methods.base import (
    MethodSettings, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method,
)
from pipeline.methods.trust_region import TrustRegion, gauss_newton_trust_step, refit_block
from pipeline.param_block import ParamBlock
from pipeline.prepared import Binding, Prepared
from pipeline.privacy.release import PrivacyRelease
from pipeline.recipe import Recipe, recipe_of
from pipeline.target import replay_schedule
from pipeline.tasks import Task, output_logits

__all__ = ["BlockGaussNewton", "BlockGaussNewtonPrepared", "BlockGaussNewtonSettings", "Scope", "choose_scope",
           "forward_costs"]

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


# -- the scope ------------------------------------------------------------------------------------
def _macs(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> int:
    out = output_logits(output) if not isinstance(output, Tensor) else output
    if not isinstance(out, Tensor):
        return 0
    if isinstance(module, nn.Linear):
        return int(out.numel()) * module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return int(out.numel()) * (module.in_channels // module.groups) * math.prod(module.kernel_size)
    return 0


def forward_costs(model: nn.Module, task: Task, data: SampleSet, samples: int = 2) -> list[tuple[str, nn.Module, int]]:
    """(qualified name, module, multiply-accumulates on ``samples`` samples) of every leaf module, in the
    order of its first call in the forward pass (modules never called are left out)."""
    names = {id(m): n for n, m in model.named_modules()}
    calls: dict[int, tuple[str, nn.Module, int]] = {}

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if id(module) not in calls:
            calls[id(module)] = (names.get(id(module), ""), module, _macs(module, inputs, output))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            batch = next(data.take(torch.arange(min(samples, len(data)))).batches(samples))
            task.forward(model, batch)
    finally:
        for h in handles:
            h.remove()
    return list(calls.values())


@dataclass
class Scope:
    """Where the model divides (``split`` None: the whole model), the block of the suffix's trainable
    parameters (the model's qualified names), and what the choice rested on."""

    split: Split | None
    block: ParamBlock
    details: dict[str, Any]


def choose_scope(model: nn.Module, task: Task, data: SampleSet, share: float) -> Scope:
    """The largest trailing part of ``model`` that a registered splitter divides off and whose forward cost
    is at most ``share`` of the whole (the smallest part that splits, recorded, when none is that cheap)."""
    from pipeline.frozen_prefix import split_for

    costs = forward_costs(model, task, data)
    total = sum(c for _, _, c in costs) or 1
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        raise ValueError("block-gauss-newton: the model has no trainable parameter to move")
    cost_of = {id(m): c for _, m, c in costs}
    owners = [(name, m) for name, m, _ in costs if any(id(p) in trainable for p in m.parameters(recurse=False))]
    param_names = {id(p): n for n, p in model.named_parameters()}

    def details(split: Split | None, suffix: nn.Module, block: ParamBlock, note: str | None = None) -> dict[str, Any]:
        cost = sum(cost_of.get(id(m), 0) for m in suffix.modules())
        return {"split_at": None if split is None else str(split.start), "cost_share": cost / total,
                "forward_macs_per_sample": total / max(1, min(2, len(data))), "parameters": [p.name for p in block.parts],
                "numel": block.numel, "scope_cost_share": share, **({"note": note} if note else {})}

    if share >= 1.0:
        block = ParamBlock.all_parameters(model)
        return Scope(None, block, details(None, model, block))
    smallest: tuple[Split, ParamBlock, float] | None = None
    for i in range(len(owners)):
        names = []
        for _, m in owners[i:]:
            names += [param_names[id(p)] for p in m.parameters(recurse=False) if id(p) in trainable]
        split = split_for(model, task, ParamBlock.from_rows(model, {n: None for n in names}))
        if split is None:
            continue
        suffix = split.suffix_of(model)
        block = ParamBlock.from_rows(model, {n: None for n, p in suffix.named_parameters() if p.requires_grad})
        cost = sum(cost_of.get(id(m), 0) for m in suffix.modules()) / total
        if cost <= share:
            return Scope(split, block, details(split, suffix, block))
        smallest = (split, block, cost)
    if smallest is None:
        raise ValueError(
            f"settings.scope_cost_share: no registered splitter divides a {type(model).__name__} before its trailing "
            "layers, so the scope cannot be cut off; set scope_cost_share: 1 to move every parameter (the whole model "
            "in each curvature product), or register a splitter (pipeline.frozen_prefix.register_splitter)")
    split, block, cost = smallest
    return Scope(split, block, details(split, split.suffix_of(model), block,
                                       f"the smallest trailing part that splits costs {cost:.3f} of the forward pass, "
                                       f"more than scope_cost_share"))


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
        if split is not None and prefix_digest(split, trained.model) != self.prefix:
            return None
        started = time.perf_counter()
        features = self.features.without(removed)
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
        features, task, digest, t_prefix = trained.train, trained.task, None, 0.0
        if scope.split is not None:
            cache = cache_frozen_prefix(trained.model, trained.task, trained.train, scope.block, trained.batch_size)
            assert cache is not None
            features, task, t_prefix = cache.train, cache.task, cache.seconds
            digest = prefix_digest(scope.split, trained.model)
        suffix = scope.split.suffix_of(trained.model) if scope.split is not None else trained.model
        t = time.perf_counter()
        gradient = block_gradient(suffix, task, features, scope.block, trained.weight_decay, reduction="mean",
                                  batch_size=trained.batch_size)
        t_gradient = time.perf_counter() - t
        return BlockGaussNewtonPrepared(
            binding, details={"scope": scope.details, "scope_seconds": t_scope, "prefix_seconds": t_prefix,
                              "gradient_seconds": t_gradient},
            scope=scope, features=features, task=task, gradient=gradient, prefix=digest)

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
