"""The damped Newton fit (the retraining oracles' solver) reaches its tolerance even where L_D's
rounding hides the last steps' decrease from the Armijo test; the L-BFGS fit stops where a step
moves nothing."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pipeline.training as training
from pipeline.training import fit_newton, gradient_norm
from tests.kit import digits64, softmax_task

LAMBDA = 0.01


@pytest.fixture(scope="module")
def digits():
    return digits64()["train"]


def softmax_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double()


def test_newton_reaches_the_tolerance_where_the_objective_rounds_coarsely(digits, monkeypatch):
    """L_D read on a grid of 1e-8 (far coarser than any machine's rounding, so that every decrease
    below it reads as none): the Armijo test then refuses every length of the last steps, and the
    fit must still reach ||grad|| <= 1e-11 through the residual merit."""
    exact = training.objective
    calls = {"coarse": 0}

    def coarse(*args, **kwargs):
        calls["coarse"] += 1
        value = exact(*args, **kwargs)
        return value.new_tensor(math.ceil(float(value) / 1e-8) * 1e-8)

    monkeypatch.setattr(training, "objective", coarse)
    model = softmax_model(0)
    report = fit_newton(model, softmax_task(), digits, LAMBDA, tolerance=1e-12)
    assert calls["coarse"] > 0
    assert report.gradient_norm <= 1e-11, report
    assert gradient_norm(model, softmax_task(), digits, LAMBDA) == pytest.approx(report.gradient_norm, rel=1e-3, abs=1e-13)
    assert report.steps < 30, report


def test_newton_with_exact_rounding_is_unchanged_and_reports_where_it_ends(digits):
    model = softmax_model(1)
    report = fit_newton(model, softmax_task(), digits, LAMBDA, tolerance=1e-12)
    assert report.gradient_norm <= 1e-11 and report.steps < 30, report
    again = fit_newton(model, softmax_task(), digits, LAMBDA, tolerance=1e-12)
    assert again.steps == 1 and again.gradient_norm == pytest.approx(report.gradient_norm, rel=1e-6, abs=1e-15)


def test_lbfgs_stops_at_the_first_step_that_leaves_the_weights_as_they_were(digits):
    """fit_lbfgs asked for a gradient norm it cannot reach (0): it stops at the first step whose line search
    moved nothing (at float precision no decrease is left; every later step would repeat it), far before
    max_steps, and every step before that one moved the weights."""
    model = softmax_model(2)
    seen: list[torch.Tensor] = []

    def record(step: int, loss: float) -> None:
        seen.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())

    report = training.fit_lbfgs(model, softmax_task(), digits, LAMBDA, tolerance=0.0, max_steps=1000, callback=record)
    assert report.steps == len(seen) < 1000, report
    assert torch.equal(seen[-1], seen[-2])
    assert all(not torch.equal(a, b) for a, b in zip(seen[:-2], seen[1:-1]))
    assert report.gradient_norm <= 1e-8, report  # where it stalls the fit is tight (measured: 3.2e-9, step 3)
