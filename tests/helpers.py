"""Small shared builders for the tests (trained oracle models on real digits)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline.data import SampleSet, load_source
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs, fit_newton


def digits64() -> dict[str, SampleSet]:
    return load_source("digits", {"dtype": "float64"})


def trained(model: nn.Module, task, data: SampleSet, weight_decay: float, tol: float = 1e-10, steps: int = 400) -> nn.Module:
    torch.manual_seed(0)
    model = model.double()
    report = fit_lbfgs(model, task, data, weight_decay, tolerance=tol, max_steps=steps)
    assert report.gradient_norm < 1e-6, report
    return model


def retrained(model: nn.Module, task, data: SampleSet, weight_decay: float, tol: float = 1e-10, steps: int = 400) -> nn.Module:
    """Warm-started tight full-batch retrain on ``data`` (L-BFGS)."""
    twin = copy.deepcopy(model)
    fit_lbfgs(twin, task, data, weight_decay, tolerance=tol, max_steps=steps)
    return twin


def newton_fit(model: nn.Module, task, data: SampleSet, weight_decay: float) -> nn.Module:
    """Tight full-batch optimum (damped Newton, exact Hessian) for small convex models; in place."""
    report = fit_newton(model.double(), task, data, weight_decay, tolerance=1e-12)
    assert report.gradient_norm <= 1e-11, report
    return model


def newton_retrained(model: nn.Module, task, data: SampleSet, weight_decay: float) -> nn.Module:
    return newton_fit(copy.deepcopy(model), task, data, weight_decay)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def softmax_task() -> DenseInputTask:
    return DenseInputTask(loss="cross_entropy")
