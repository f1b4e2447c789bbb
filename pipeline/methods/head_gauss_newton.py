"""The decision-layer Newton removal plus one Gauss-Newton step on the hidden layers of the head:
``head-gauss-newton``.

The model is a classifier head: an nn.Sequential of Linear layers and parameter-free modules under
cross-entropy (usually the trainable head over cached features). Its decision layer is solved as
``decision-layer-newton`` solves it (its ``target``); the parameters outside it move by their part
of one truncated Gauss-Newton step on the whole head, taken at the start weights
(``pipeline.curvature.gauss_newton``), towards the same target (``pipeline.target``): Retrain's
budget-damped step for an SGD recipe (mu = 1/tau added to the ridge),

    w' = w + (G_{D\\U} + (lambda + mu) I)^{-1} (sum_U grad loss(w, z) - m mean_D grad loss(w, z)) / (n - m),

or the step towards grad L_{D\\U} = 0 for the minimiser; the decision layer is then solved over the
hidden layers' new features, so the record and the checks describe the published weights,
with products over the ``hidden_step_rows`` retained samples of largest curvature trace and
``hidden_step_iterations`` PCG iterations from the EK-FAC solution; no hidden step (recorded) where
those rows hold less than ``hidden_step_min_trace_share`` of the retained trace. Prepared once per
model version: the decision layer's state and the head's EK-FAC factors, mean gradient and traces.
A heuristic: no noise on the hidden layers, and the release says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from pipeline.curvature.gauss_newton import GaussNewtonStep, HeadCurvature, gauss_newton_step, head_layout
from pipeline.decision_layer import DecisionLayerState, decision_layer_block
from pipeline.methods.base import RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method
from pipeline.errors import RemovalNotServed
from pipeline.methods.decision_layer_newton import DecisionLayerNewtonSettings, solve_decision_layer
from pipeline.prepared import Binding, Prepared
from pipeline.target import budget_damping, resolve_target

__all__ = ["HeadGaussNewton", "HeadGaussNewtonSettings", "HeadPrepared"]


class HeadGaussNewtonSettings(DecisionLayerNewtonSettings):
    hidden_step_rows: int = Field(1024, gt=0, description="Gauss-Newton products over this many retained samples of "
                                                          "largest curvature trace 1 - sum_c p_c^2")
    hidden_step_iterations: int = Field(2, ge=0, description="PCG iterations from the EK-FAC solution")
    hidden_step_damping: float = Field(0.0, ge=0, description="damping added to the weight decay")
    hidden_step_min_trace_share: float = Field(
        0.9, ge=0, le=1, description="no hidden step (recorded) where the rows kept hold less than this share of the "
                                     "retained curvature trace (the truncated Gauss-Newton matrix would understate it)")


@dataclass
class HeadPrepared(Prepared):
    """The decision layer's state and the head's Gauss-Newton factors, at one model version."""

    layer: DecisionLayerState | None = None
    head: HeadCurvature | None = None

    what = ("the decision layer's state (pipeline.decision_layer) and the head's EK-FAC Gauss-Newton factors, mean "
            "gradient and curvature traces on D (pipeline.curvature.gauss_newton)")


@register_method
class HeadGaussNewton(RemovalMethod):
    name = "head-gauss-newton"
    Settings = HeadGaussNewtonSettings
    PREPARED_FROM = ("parameters",)

    def prepare(self, trained: TrainedModel, settings: HeadGaussNewtonSettings,  # type: ignore[override]
                binding: Binding) -> HeadPrepared:
        block = decision_layer_block(trained.model, settings.parameters)
        layer = DecisionLayerState.build(binding, trained.model, trained.task, trained.train, block,
                                         trained.weight_decay, trained.batch_size)
        head = HeadCurvature.prepare(trained.model, trained.task, trained.train, trained.batch_size)
        return HeadPrepared(binding, details={"decision_layer": layer.details, "head_factors": head.details},
                            layer=layer, head=head)

    def remove(self, problem: RemovalProblem, settings: HeadGaussNewtonSettings,  # type: ignore[override]
               prepared: HeadPrepared) -> RemovalOutcome:
        assert prepared.layer is not None and prepared.head is not None
        timings: dict[str, float] = {}
        with problem.stage("hidden_step", timings):  # at the start weights, before the decision layer moves
            hidden = _hidden_step(problem, prepared, settings)
        params = dict(problem.model.named_parameters())
        saved = {name: params[name].detach().clone() for name in hidden.delta}
        state, start_gradient = prepared.layer, None
        if hidden.delta:  # the hidden layers move first; the decision layer is then solved over their new features
            with torch.no_grad():
                for name, delta in hidden.delta.items():
                    params[name].add_(delta.to(params[name].dtype))
            with problem.stage("hidden_features", timings):
                state = DecisionLayerState.build(prepared.binding, problem.model, problem.task, problem.train,
                                                 prepared.layer.block, problem.weight_decay, problem.batch_size,
                                                 dense=False)
            start_gradient = prepared.layer.training_gradient  # the anchor stays the start's
        try:
            solved = solve_decision_layer(problem, settings, state, start_gradient)
        except RemovalNotServed:
            with torch.no_grad():
                for name, value in saved.items():
                    params[name].copy_(value)
            raise
        solved.timings.update(timings)
        outcome = solved.publish(problem, settings, moved=list(hidden.delta),
                                 moved_reason="hidden layers moved by a truncated Gauss-Newton step, without noise")
        outcome.record["hidden_step"] = hidden.record
        outcome.record["newton"]["solved_over"] = ("the hidden layers' features after the hidden step" if hidden.delta
                                                   else outcome.record["newton"]["solved_over"])
        return outcome


def _hidden_step(problem: RemovalProblem, prepared: HeadPrepared, settings: HeadGaussNewtonSettings) -> GaussNewtonStep:
    """The parameters outside the decision layer, moved by their part of one Gauss-Newton step on
    the head (none where the step was skipped: its record says why)."""
    assert prepared.layer is not None and prepared.layer.block is not None
    inside = {part.name for part in prepared.layer.block.parts}
    outside_names = [k for k in head_layout(problem.model, problem.task).parameter_names() if k not in inside]
    if not outside_names:
        raise ValueError("the head Gauss-Newton step has nothing to move: the decision layer is the whole head; use "
                         "method decision-layer-newton")
    # the target (pipeline.target): a step towards the minimiser, or Retrain's budget-damped step (the
    # replay's one-window form: the hidden layers are too large for the replay's P x P matrices)
    params = dict(problem.model.named_parameters())
    kind, schedule, why = resolve_target(settings.target, problem.card, problem.weight_decay,
                                         sum(params[k].numel() for k in outside_names), replay_max_parameters=0)
    mu = budget_damping(schedule, problem.n - problem.m) if kind == "budget_damped" else 0.0
    step = gauss_newton_step(problem.model, problem.task, problem.train, problem.forget_positions,
                             problem.weight_decay, rows=settings.hidden_step_rows,
                             iterations=settings.hidden_step_iterations, damping=settings.hidden_step_damping + mu,
                             min_trace_share=settings.hidden_step_min_trace_share, prepared=prepared.head,
                             batch_size=problem.batch_size, minimiser=kind == "minimiser")
    outside = {k: step.delta[k] for k in outside_names if k in step.delta}
    moved = float(torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in outside.values()]))) if outside else 0.0
    record: dict[str, Any] = {**step.record, "parameters": outside_names, "step_norm_outside_block": moved,
                              "target": {"setting": settings.target, "how": kind, "why": why,
                                         "training_budget_damping": mu}}
    return GaussNewtonStep(outside, record)
