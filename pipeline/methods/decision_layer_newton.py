"""Converged Newton on the decision layer, matrix-free, from its prepared state: ``decision-layer-newton``.

The block is the whole last Linear layer (theta = [W, b]) of a Sequential under cross-entropy over
the frozen prefix's cached outputs (``pipeline.decision_layer.DecisionLayerState``, prepared once
per model version). A removal lands on the layer's target (``target``, ``pipeline.target``) by
minimising
    F(theta) = L_{D\\U}(theta) - <a, theta - theta_0> + (mu/2)||theta - theta_0||^2,
    grad F   = grad_P L_{D\\U} - a + mu (theta - theta_0)
  minimiser             a = 0, mu = 0: the retrained optimum of the layer;
  retrain, replay       the layer Retrain's recipe gives (recipe replay, ``pipeline.target.replay``,
                        prepared once and carried between versions): theta_T, then a =
                        grad_P L_{D\\U}(theta_T), mu = 0, whose unique minimiser is theta_T (the
                        layer's objective is strictly convex);
  retrain, budget-damped (a layer above ``replay_max_parameters``) a = grad_P L_D(theta_0),
                        mu = 1/tau (the replay's one-window form);
by Newton's method with the exact Hessian at the current weights, never built (``pipeline.curvature.newton``):
closed-form products over the cached inputs, each Newton system solved by PCG to the forcing
tolerance, preconditioned with the prepared H_P(D)^{-1} (recycled by L-BFGS from the CG pairs of the
earlier systems), until ||grad F|| <= max(newton_atol, newton_rtol ||grad F_0||); otherwise, or when
less than ``min_gradient_reduction`` of the residual was removed, ``RemovalNotServed`` (the model is
left as it was). The retained gradient comes from the prepared grad_P L_D minus the forgotten
samples' own: a removal passes over its m samples and over the cached inputs only.

Noise (``epsilon``): Sekhari et al.'s Gaussian on the layer, ``certified`` only where
``pipeline.privacy.certify`` says so (the layer is the whole model and convex), else heuristic.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Literal

import torch
from pydantic import Field
from torch import nn

from pipeline import memory
from pipeline.curvature import block_gradient
from pipeline.curvature.linear_layer import closed_form_layer, layer_order, native_bfloat16, products_dtype
from pipeline.curvature.newton import newton_minimise
from pipeline.curvature.softmax_layer import SoftmaxLayerObjective, dense_preconditioner, working_bytes
from pipeline.decision_layer import DecisionLayerState, decision_layer_block
from pipeline.errors import RemovalNotServed
from pipeline.methods.base import (
    MethodSettings, RandomStream, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method,
)
from pipeline.methods.block_choice import trainable_numel
from pipeline.param_block import ParamBlock
from pipeline.prepared import Binding
from pipeline.privacy import certify
from pipeline.privacy.noise import secret_gaussian_noise
from pipeline.recipe import start_weights
from pipeline.target import REPLAY_MAX_PARAMETERS, TargetKind, budget_damping, resolve_target
from pipeline.tasks import Task

__all__ = ["DecisionLayerNewton", "DecisionLayerNewtonSettings", "MATRIX_FREE_MAX_CG", "MIN_CURVATURE_ROWS"]

#: CG iterations per Newton system when cg_max_iter is unset.
MATRIX_FREE_MAX_CG = 200

#: The fewest curvature rows a memory budget may cut the products to (all of R when it has fewer):
#: below this a subsampled Hessian steers the Newton steps poorly.
MIN_CURVATURE_ROWS = 1024


class DecisionLayerNewtonSettings(certify.PrivacySettings, MethodSettings):
    parameters: list[str] = Field(
        default_factory=list, description="the decision layer's weight and bias; empty: the model's last module, "
                                          "when that is a Linear layer")
    target: TargetKind = Field(
        "retrain", description="retrain: where the card's recipe run on D \\ U lands (the minimiser for a converging "
                               "recipe; recipe replay or its budget-damped form for SGD: pipeline.target); minimiser: "
                               "grad L_{D\\U} = 0 on the layer")
    replay_max_parameters: int = Field(
        REPLAY_MAX_PARAMETERS, gt=0, description="retrain on an SGD recipe: the largest layer the recipe replay holds "
                                                 "P x P matrices for; larger layers take the budget-damped step")
    curvature_samples: int | None = Field(
        16384, gt=0, description="Hessian products on a seeded subsample of this many retained samples (null: all); "
                                 "the gradient and the objective stay exact, so the minimiser is the same")
    curvature_products: Literal["auto", "layer", "bfloat16"] = Field(
        "auto", description="precision of the Hessian products (they only steer the Newton direction; the gradient, "
                            "the objective and the stopping test keep the layer's precision). layer: the layer's own; "
                            "bfloat16: curvature rows in bfloat16, float32 in between (CG asked for no more than "
                            "1.6e-2); auto: bfloat16 for a float32 layer where this machine multiplies bfloat16 "
                            "natively, else layer")
    newton_preconditioner: Literal["auto", "kronecker", "none"] = Field(
        "auto", description="PCG preconditioner. auto: the prepared H_P(D)^{-1} when it was kept, else kronecker; "
                            "kronecker: (A (x) G + lambda I)^{-1}")
    newton_forcing: float = Field(
        0.5, gt=0, lt=1, description="each Newton system solved to relative residual "
                                     "min(newton_forcing, sqrt(||grad|| / ||grad_0||)) (inexact Newton)")
    newton_recycle: int = Field(
        40, ge=0, description="the last this many CG directions of the earlier Newton systems (with their Hessian "
                              "products) update the preconditioner by limited-memory BFGS (Morales & Nocedal 2000); "
                              "0 = off")
    newton_max_steps: int = Field(60, ge=1, description="most Newton steps")
    newton_rtol: float = Field(1e-3, ge=0, description="stop once ||grad F|| <= newton_rtol x its start")
    newton_atol: float = Field(1e-10, ge=0, description="... or once it is <= newton_atol")
    cg_max_iter: int | None = Field(None, gt=0, description=f"CG iterations per system (default {MATRIX_FREE_MAX_CG})")
    max_backtracks: int = Field(20, ge=0, description="Armijo halvings of a Newton step")
    min_gradient_reduction: float = Field(
        0.5, ge=0, le=1, description="a removal that removes less than this share of the residual is not served")


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


@register_method
class DecisionLayerNewton(RemovalMethod):
    name = "decision-layer-newton"
    Settings = DecisionLayerNewtonSettings
    PREPARED_FROM = ("parameters",)

    def prepare(self, trained: TrainedModel, settings: DecisionLayerNewtonSettings,  # type: ignore[override]
                binding: Binding) -> DecisionLayerState:
        block = decision_layer_block(trained.model, settings.parameters)
        state = DecisionLayerState.build(binding, trained.model, trained.task, trained.train, block,
                                         trained.weight_decay, trained.batch_size)
        kind, schedule, _ = resolve_target(settings.target, trained.card, trained.weight_decay, block.numel,
                                           settings.replay_max_parameters)
        if kind == "replay":  # the replay's checkpoints do not depend on U: prepared here, counted as preparation
            assert trained.card is not None and schedule is not None
            suffix, task, _ = state.suffix_and_data(trained.model, trained.task, trained.train)
            layer = closed_form_layer(suffix, task, block)
            assert layer is not None
            state.layer_replay(trained.model, trained.task, trained.train, schedule,
                               block.gather(start_weights(trained.card)), _layer_order(suffix, block, layer),
                               block.numel == trainable_numel(trained.model))
            state.details["replay"] = {"checkpoints": len(state.replay.prepared.checkpoints) if state.replay else 0,
                                       "seconds": state.replay.prepared.seconds if state.replay else 0.0}
        return state

    def remove(self, problem: RemovalProblem, settings: DecisionLayerNewtonSettings,  # type: ignore[override]
               prepared: DecisionLayerState) -> RemovalOutcome:
        solved = solve_decision_layer(problem, settings, prepared)
        return solved.publish(problem, settings)


class SolvedLayer:
    """A converged decision-layer solve, written into the model, not yet noised or recorded.
    ``verify()``: grad_P L_{D\\U} at the layer's current weights over the features it was solved
    over (the closed form, no pass through the model)."""

    def __init__(self, block: ParamBlock, record: dict[str, Any], timings: dict[str, float], g: torch.Tensor,
                 anchor: torch.Tensor, start_norm: float, residual_before: float, w_start: torch.Tensor,
                 subsampled: bool, history: list[dict[str, Any]], verify: Callable[[], torch.Tensor], mu: float = 0.0):
        self.block, self.record, self.timings, self.g, self.anchor, self.mu = block, record, timings, g, anchor, mu
        self.start_norm, self.residual_before, self.w_start = start_norm, residual_before, w_start
        self.subsampled, self.history, self.verify = subsampled, history, verify

    def publish(self, problem: RemovalProblem, settings: DecisionLayerNewtonSettings,
                moved: list[str] | None = None, moved_reason: str | None = None) -> RemovalOutcome:
        """The published weights: the solve's, noise on the layer (calibrated, secret); the release;
        the record of exactly those weights (with noise, nothing computed from the weights before it);
        the new parameters, with ``moved`` (parameters outside the layer the caller moved before the
        solve, which was then made over their new features) among them."""
        model, block = problem.model, self.block
        params = dict(model.named_parameters())
        g, timings = self.g, self.timings
        cal = certify.calibration(settings, problem.m, problem.n, problem.weight_decay)
        noised = cal.sigma > 0
        full_block = block.numel == trainable_numel(model)
        release = certify.release(
            model, problem.task, problem.weight_decay, settings, cal, full_block=full_block, steps=len(self.history),
            damping_used=0.0, subsampled=self.subsampled, shortened=any(h["step_length"] != 1.0 for h in self.history),
            start_gradient_norm=self.start_norm, final_gradient_norm=_norm(g),
            inexact_solve=("each Newton system solved inexactly (PCG to the forcing term "
                           f"{settings.newton_forcing:g} or better), not Sekhari's exact-Hessian step"),
            other_reasons=[moved_reason] if moved and moved_reason else None,
            bounds=certify.data_bounds(model, problem.task, problem.train) if noised else None)
        block.add_to_model(model, secret_gaussian_noise(block.numel, cal.sigma))
        new_parameters = {name: params[name].detach().clone() for name in [*(p.name for p in block.parts),
                                                                             *(moved or [])]}
        if noised:  # the record describes the published weights: nothing of the solution before the noise
            with problem.stage("verify_published", timings):
                g = self.verify()
        norm = _norm(_target_residual(g, self.anchor, self.mu, block, params, self.w_start))
        w_published = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
        record = dict(self.record)
        record["newton"] = {**record["newton"], "history": certify.published_history(record["newton"]["history"], noised)}
        record["gradient_norms"] = {**record["gradient_norms"], "residual_after": norm, "retain_mean_block_after": _norm(g)}
        record["gradient_share"] = {"retained_removed": 1.0 - norm / self.residual_before if self.residual_before > 0
                                    else 1.0}
        record["published"] = "the weights published: the solve's" + (" and the noise added" if noised else "")
        record.update({"noise": cal.as_record(), "epsilon_spent": None if math.isinf(cal.epsilon) else cal.epsilon,
                       "delta_spent": None if math.isinf(cal.epsilon) else cal.delta,
                       "step_norm": _norm(w_published - self.w_start), "timings": timings,
                       "release": release.model_dump(mode="json")})
        return RemovalOutcome(new_parameters, record, release)


def solve_decision_layer(problem: RemovalProblem, settings: DecisionLayerNewtonSettings,
                         state: DecisionLayerState, start_gradient: torch.Tensor | None = None) -> SolvedLayer:
    """The converged Newton solve on the layer (module docstring), written into ``problem.model``;
    ``RemovalNotServed`` (the model left as it was) when it does not converge or removes too little.
    ``start_gradient``: grad_P L_D at the removal's start when ``state`` was built at other weights
    (the head method's, after its hidden step): the anchor keeps the start's."""
    n, m, lam, task, bs = problem.n, problem.m, problem.weight_decay, problem.task, problem.batch_size
    timings: dict[str, float] = {}
    block = state.block
    assert block is not None and state.training_gradient is not None
    suffix, task, data = state.suffix_and_data(problem.model, problem.task, problem.train)
    work = replace(problem, model=suffix, task=task, train=data)
    params = dict(problem.model.named_parameters())
    saved = {part.name: params[part.name].detach().clone() for part in block.parts}
    w_start = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
    with problem.stage("gradients", timings):
        g_forget = block_gradient(work.model, task, work.forget, block, lam, reduction="sum", batch_size=bs)
        # grad L_{D\U} = (n grad L_D - g_U) / (n - m): only the m forgotten samples are passed over
        g = (n * state.training_gradient - g_forget) / (n - m)
    r0 = state.training_gradient if start_gradient is None else start_gradient  # grad_P L_D(w) at the start
    full_model = block.numel == trainable_numel(problem.model)
    kind, schedule, why = resolve_target(settings.target, problem.card, lam, block.numel,
                                         settings.replay_max_parameters)
    target: dict[str, Any] = {"setting": settings.target, "how": kind, "why": why}
    mu = 0.0
    anchor = torch.zeros_like(r0)
    if kind == "budget_damped":
        assert schedule is not None
        anchor, mu = r0, budget_damping(schedule, n - m)
        target.update(equation="grad_P L_D\\U(w') - grad_P L_D(w_start) + mu (w' - w_start) = 0", mu=mu,
                      training_budget=1.0 / mu)
    elif kind == "replay":
        assert schedule is not None and problem.card is not None
        with problem.stage("target_replay", timings):
            theta_target, replayed = _replay_target(problem, work, state, block, schedule, full_model)
            anchor = _layer_gradient(work, task, block, state, theta_target, lam)
        target.update(equation="grad_P L_D\\U(w') = grad_P L_D\\U(w_replay)  (w' = w_replay, the layer being "
                               "strictly convex)", replay=replayed)
    else:
        target["equation"] = "grad_P L_D\\U(w') = 0"
    residual = g - anchor
    g0 = _norm(residual)
    tol = max(settings.newton_atol, settings.newton_rtol * g0)
    try:
        with problem.stage("curvature_and_solve", timings):
            history, solvers, verify = _matrix_free_newton(work, task, block, lam, anchor, residual, tol, settings,
                                                           state, mu)
        with problem.stage("verify", timings):  # at the published (rounded) weights
            g = verify()
        norm_g = _norm(_target_residual(g, anchor, mu, block, params, w_start))
        reduction = 1.0 - norm_g / g0 if g0 > 0 else 1.0
        if reduction < settings.min_gradient_reduction:
            raise RemovalNotServed(
                f"the Newton solve removed {100 * reduction:.1f}% of the residual on the decision layer "
                f"(needs {100 * settings.min_gradient_reduction:.0f}%): a local step cannot serve this request",
                {"residual_before": g0, "residual_after": norm_g, "steps": history})
    except RemovalNotServed as err:
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
        err.diagnostics.setdefault("block_numel", block.numel)
        raise
    subsampled = "curvature_rows_cut" in solvers[0] or solvers[0]["curvature_rows"] < n - m
    record = {
        "block": {"numel": block.numel, "parts": block.describe()},
        "frozen_prefix": None if state.prefix is None else state.prefix.describe(),
        "target": target,
        "curvature": {"operator": "closed-form products at the current weights (matrix-free)", "solvers": solvers,
                      "retained_gradient": "prepared grad L_D minus the forgotten samples'"},
        "newton": {"steps": len(history), "max_steps": settings.newton_max_steps, "tolerance": tol,
                   "converged": norm_g <= tol, "history": history, "solved_over": "the start weights of every other "
                   "parameter (the frozen prefix's cached outputs)"},
        "gradient_norms": {"forget_sum_block": _norm(g_forget), "data_mean_block_start": _norm(r0),
                           "residual_before": g0, "residual_after": norm_g, "retain_mean_block_after": _norm(g)},
        "gradient_share": {"retained_removed": reduction},
    }
    return SolvedLayer(block, record, timings, g, anchor, _norm(r0), g0, w_start, subsampled, history, verify, mu)


def _target_residual(g: torch.Tensor, anchor: torch.Tensor, mu: float, block: ParamBlock,
                     params: dict[str, torch.Tensor], w_start: torch.Tensor) -> torch.Tensor:
    """grad F = grad_P L_D\\U - a + mu (w - w_start) at the layer's current weights."""
    if mu == 0.0:
        return g - anchor
    w = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
    return g - anchor + mu * (w - w_start)


def _replay_target(problem: RemovalProblem, work: RemovalProblem, state: DecisionLayerState, block: ParamBlock,
                   schedule: Any, full_model: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """The layer's recipe-replay target in block order (``DecisionLayerState.layer_replay``) and its record."""
    assert problem.card is not None
    layer = closed_form_layer(work.model, work.task, block)
    assert layer is not None
    order = _layer_order(work.model, block, layer)
    theta_init = block.gather(start_weights(problem.card))
    replay = state.layer_replay(problem.model, problem.task, problem.train, schedule, theta_init, order, full_model)
    retained = work.retain.sample_ids
    theta, record = replay.target(retained)
    return theta[order], record


def _layer_gradient(work: RemovalProblem, task: Task, block: ParamBlock, state: DecisionLayerState,
                    theta: torch.Tensor, lam: float) -> torch.Tensor:
    """grad_P L_D\\U (mean, lambda theta included) at block weights ``theta``, in block order, by the closed
    form of the layer's replay oracle over the retained rows."""
    replay = state.replay
    assert replay is not None
    layer = closed_form_layer(work.model, task, block)
    assert layer is not None
    order = _layer_order(work.model, block, layer)
    keep = torch.isin(replay.sample_ids, work.retain.sample_ids)
    layered = torch.empty(theta.numel(), dtype=torch.float64)
    layered[order] = theta
    gradient = replay.oracle.grad(layered, torch.nonzero(keep).squeeze(1)) + lam * layered
    return gradient[order]


def _layer_order(model: nn.Module, block: ParamBlock, layer: nn.Linear) -> torch.Tensor:
    """Block entry i -> its (class, input-with-bias) flat index class * (d + 1) + input in ``layer``."""
    names = {name: ("weight" if p is layer.weight else "bias") for name, p in model.named_parameters()
             if p is layer.weight or p is layer.bias}
    return layer_order(block, names, layer.out_features, layer.in_features)


def _matrix_free_newton(work: RemovalProblem, task: Task, block: ParamBlock, lam: float, anchor: torch.Tensor,
                        residual: torch.Tensor, tol: float, settings: DecisionLayerNewtonSettings,
                        state: DecisionLayerState, mu: float = 0.0
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any]:
    """Minimise L_{D\\U}(w) - <anchor, w_P> + (mu/2)||w_P - w_start||^2 over the decision layer (``newton_minimise``); the
    result is written into the layer. Returns (history, solvers, verify): ``verify()`` is
    grad_P L_{D\\U} (mean, lambda w_P included) at the weights the layer then holds (rounded to its
    dtype), in block order, by the same closed form in the passes' last precision. Raises
    ``RemovalNotServed`` when ||grad|| <= tol is not reached."""
    layer = closed_form_layer(work.model, task, block)
    assert layer is not None and layer.bias is not None  # DecisionLayerState.build checked both
    params = dict(work.model.named_parameters())
    k, d = layer.out_features, layer.in_features
    order = _layer_order(work.model, block, layer)

    def to_theta(v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(k * (d + 1), dtype=torch.float64)
        out[order] = v.to("cpu", torch.float64)
        return out.reshape(k, d + 1)

    smoothing = float(getattr(task, "loss_options", {}).get("label_smoothing", 0.0))
    keep = xt = x_norm = start_logits = None
    kept = state.inputs is not None and state.inputs.shape == (len(work.train), d + 1)
    n_retain = len(work.train) - len(work.forget_positions)
    # products in the layer's own precision (float32 model: float32 products, float64 everywhere else),
    # or in bfloat16 (``curvature_products``); the preconditioner keeps the layer's
    product_dtype = products_dtype(layer)
    device = state.inputs.device if kept else torch.device("cpu")
    curvature_dtype = torch.bfloat16 if settings.curvature_products == "bfloat16" or (
        settings.curvature_products == "auto" and product_dtype == torch.float32 and native_bfloat16(device)) \
        else product_dtype
    count, budget_note = _curvature_rows_within_budget(
        n_retain, d, k, settings, product_dtype, curvature_dtype, prepared_rows=len(work.train) if kept else None,
        state=state, order=order)
    if kept:
        # the prepared X~ of D (and X~^T, logits, ||X~||_F), the forgotten rows masked: no copy of D_r
        # per removal, and no pass over X~ at the start
        x, xt, x_norm, start_logits = state.inputs, state.inputs_t, state.inputs_norm, state.logits
        keep = torch.ones(len(work.train), dtype=torch.bool)
        keep[work.forget_positions] = False
        labels = work.train.columns["y"]
        inputs_note = "prepared X~ of D, forgotten rows masked"
    else:
        retain = work.retain
        x = torch.ones(len(retain), d + 1, dtype=product_dtype)  # x~ = (x, 1), one copy
        x[:, :d] = retain.columns["x"].reshape(len(retain), d)
        labels = retain.columns["y"]
        inputs_note = "copy of D_r (the prepared X~ did not fit the memory budget)"
    targets = (1 - smoothing) * nn.functional.one_hot(labels.long(), k).to(torch.float64) + smoothing / k
    w_start = block.gather({name: p.detach() for name, p in params.items()}).to("cpu", torch.float64)
    theta0 = to_theta(w_start)
    rows = None
    if count < n_retain:
        gen = work.generator(RandomStream.CURVATURE_SUBSAMPLE)
        rows = torch.randperm(n_retain, generator=gen)[:count].sort().values
        if keep is not None:  # the same retained samples, as rows of D
            rows = torch.nonzero(keep).squeeze(1)[rows]
    objective = SoftmaxLayerObjective(x, targets, lam, to_theta(anchor), theta0, rows, curvature_dtype, keep, xt, x_norm,
                                      proximal=mu)
    choice = settings.newton_preconditioner
    preconditioner: Any = choice
    if choice == "auto":  # the prepared inverse; the Kronecker-factored one where none was kept
        preconditioner = choice = "kronecker"
        if state.inverse is not None:
            preconditioner = dense_preconditioner(state.layer_inverse(order, product_dtype), (k, d + 1))
            choice = "prepared H_P(D)^-1"
    result = newton_minimise(objective, theta0, tol=tol, max_steps=settings.newton_max_steps,
                             preconditioner=preconditioner, forcing=settings.newton_forcing,
                             max_cg=settings.cg_max_iter or MATRIX_FREE_MAX_CG, max_backtracks=settings.max_backtracks,
                             recycle=settings.newton_recycle,
                             start=None if start_logits is None else (start_logits, to_theta(residual)))
    history = [{"step": h["step"], "residual_norm_after": h["gradient_norm"], "step_length": h["step_length"],
                "solver": "pcg-matrix-free", "iterations": h["cg_iterations"],
                "relative_residual": h["cg_relative_residual"]} for h in result.history]
    if settings.newton_recycle:
        choice = f"{choice}, updated by the last {settings.newton_recycle} CG pairs (L-BFGS)"
    solvers = [{"solver": "pcg-matrix-free", "preconditioner": choice, "passes_over_inputs": result.passes,
                "converged": result.converged, "product_dtype": str(curvature_dtype).removeprefix("torch."),
                "pass_dtype": result.pass_dtype if not result.float64_from else
                f"float32 for {result.float64_from - 1} steps, then float64 (float32 could not certify or resolve "
                "the tolerance)",
                "gradient_rounding_floor": result.gradient_floor,
                "curvature_rows": n_retain if rows is None else len(rows), "inputs": inputs_note,
                **({"curvature_rows_cut": budget_note} if budget_note else {})}]
    if not result.converged:
        raise RemovalNotServed(
            f"matrix-free Newton did not reach ||grad|| <= {tol:.3g} in {settings.newton_max_steps} steps "
            f"(left {result.gradient_norm:.3g}; raise newton_max_steps or newton_rtol)",
            {"residual_before": result.start_gradient_norm, "residual_after": result.gradient_norm, "steps": history})
    with torch.no_grad():
        block.add_to_model(work.model, result.theta.reshape(-1)[order] - w_start)

    def verify() -> torch.Tensor:
        published = to_theta(block.gather({name: p.detach() for name, p in params.items()}))
        gradient = objective.gradient(published, objective.probabilities(objective.logits(published))) \
            + objective.anchor - mu * (published - objective.reference)  # (F's target terms taken off)
        return gradient.reshape(-1)[order]

    return history, solvers, verify


def _curvature_rows_within_budget(n_retain: int, d: int, k: int, settings: DecisionLayerNewtonSettings,
                                  product_dtype: torch.dtype, curvature_dtype: torch.dtype, *,
                                  prepared_rows: int | None, state: DecisionLayerState,
                                  order: torch.Tensor) -> tuple[int, str | None]:
    """How many retained rows the products may use: ``curvature_samples`` (all of R when unset),
    cut to what the memory budget holds beside the iteration's other arrays
    (``pipeline.curvature.softmax_layer.working_bytes``; a subsampled Hessian leaves the minimiser as
    it is), never below MIN_CURVATURE_ROWS; ``MemoryBudgetError`` before anything is allocated when
    even that does not fit. ``prepared_rows``: the rows of a prepared X~ of D (else R is copied).
    Returns (rows, a note when the budget cut them)."""
    budget = memory.available_in(memory.current_budget())
    want = n_retain if settings.curvature_samples is None else min(int(settings.curvature_samples), n_retain)
    preconditioner = 0.0
    if settings.newton_preconditioner == "auto" and state.inverse is not None:
        if not state.has_layer_inverse(order, product_dtype):
            # layer_ordered: a float64 permuted copy, its symmetrised sum, and the cast that is kept
            preconditioner = (k * (d + 1)) ** 2 * (2 * 8 + product_dtype.itemsize)
    kronecker = settings.newton_preconditioner == "kronecker"

    def plan(copies_rows: bool) -> tuple[float, float]:
        return working_bytes(prepared_rows or n_retain, d, k, input_itemsize=product_dtype.itemsize,
                             curvature_itemsize=curvature_dtype.itemsize,
                             work_itemsize=4 if curvature_dtype in (torch.bfloat16, torch.float32) else 8,
                             copies_inputs=prepared_rows is None, copies_curvature_rows=copies_rows,
                             preconditioner_bytes=preconditioner, kronecker=kronecker,
                             recycle=settings.newton_recycle, max_cg=settings.cg_max_iter or MATRIX_FREE_MAX_CG)

    # the rows are all of X~ in its own precision (no copy) only when R is copied whole, in that precision
    fixed, per_row = plan(copies_rows=not (want == n_retain and prepared_rows is None
                                           and curvature_dtype == product_dtype))
    if fixed + want * per_row <= budget.bytes:
        return want, None
    fixed, per_row = plan(copies_rows=True)  # a subsample is a copy
    least = min(want, MIN_CURVATURE_ROWS)
    room = budget.bytes - fixed
    fit = min(want, int(room // per_row)) if room > 0 else 0
    if fit < least:
        raise memory.MemoryBudgetError(
            f"{budget.named()} cannot hold the matrix-free Newton iteration on the {k} x {d + 1} decision layer "
            f"with {least} curvature rows (needs ~{memory.format_bytes(fixed + least * per_row)}): raise "
            f"{memory.SETTING}")
    return fit, (f"{want} curvature rows asked, {fit} fit {budget.named()} "
                 f"(~{memory.format_bytes(fixed)} fixed, {memory.format_bytes(per_row)} per row)")
