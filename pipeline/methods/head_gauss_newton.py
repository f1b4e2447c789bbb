"""The decision-layer Newton removal plus one Gauss-Newton step on the hidden layers of the head:
``head-gauss-newton``.

The model is a classifier head: an nn.Sequential of Linear layers and parameter-free modules under
cross-entropy (usually the trainable head over cached features). Its decision layer is solved as
``decision-layer-newton`` solves it; the parameters outside it move by their part of one anchored,
truncated Gauss-Newton step on the whole head, taken at the start weights
(``pipeline.curvature.gauss_newton``), and the decision layer is then solved over the hidden layers'
new features (its anchor the start's), so the record and the checks describe the published weights:

    w' = w + (G_{D\\U} + (lambda + mu) I)^{-1} (sum_U grad loss(w, z) - m mean_D grad loss(w, z)) / (n - m)

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
        if settings.anchor != "training_residual":
            raise ValueError("the head Gauss-Newton step takes the anchored step (grad L_{D\\U}(w') = grad L_D(w)); "
                             "set anchor: training_residual so that the decision layer aims at the same target, or use "
                             "method decision-layer-newton")
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
    step = gauss_newton_step(problem.model, problem.task, problem.train, problem.forget_positions,
                             problem.weight_decay, rows=settings.hidden_step_rows,
                             iterations=settings.hidden_step_iterations, damping=settings.hidden_step_damping,
                             min_trace_share=settings.hidden_step_min_trace_share, prepared=prepared.head,
                             batch_size=problem.batch_size)
    outside = {k: step.delta[k] for k in outside_names if k in step.delta}
    moved = float(torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in outside.values()]))) if outside else 0.0
    record: dict[str, Any] = {**step.record, "parameters": outside_names, "step_norm_outside_block": moved}
    return GaussNewtonStep(outside, record)
