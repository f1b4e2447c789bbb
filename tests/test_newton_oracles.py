"""L-FOCI Newton removal against exact oracles (shared/REFERENCE.md sections 1 and 5)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.tasks import DenseInputTask
from tests.kit import digits64, flat, newton_fit, newton_retrained, softmax_task

LAMBDA = 0.01


def remove(model, task, train, positions, **settings):
    work = copy.deepcopy(model)
    method = get_method("lfoci-newton")
    problem = RemovalProblem(work, task, train, torch.as_tensor(positions), LAMBDA, seed=3)
    outcome = method.run(problem, method.Settings(**settings))
    return work, outcome


@pytest.fixture(scope="module")
def softmax_digits():
    data = digits64()["train"]
    model = newton_fit(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), softmax_task(), data, LAMBDA)
    return model, data


@pytest.mark.parametrize("m", [1, 10, 50])
def test_convex_softmax_removal_lands_near_retrain(softmax_digits, m):
    model, data = softmax_digits
    task = softmax_task()
    gen = torch.Generator().manual_seed(100 + m)
    positions = torch.randperm(len(data), generator=gen)[:m]
    removed, outcome = remove(model, task, data, positions, selection="all")
    oracle = newton_retrained(model, task, data.without(positions), LAMBDA)
    w0, w1, wr = flat(model), flat(removed), flat(oracle)
    moved = float(torch.linalg.vector_norm(wr - w0))
    error = float(torch.linalg.vector_norm(w1 - wr))
    assert moved > 1e-4  # the removal matters
    assert error <= 0.01 * moved, (m, error / moved)
    # The retained-objective gradient shrinks by orders of magnitude.
    norms = outcome.record["gradient_norms"]
    assert norms["retain_mean_block_after"] < 0.05 * norms["retain_mean_block_before"]


def test_convex_wrong_sign_or_factor_would_fail(softmax_digits):
    """The oracle is sharp: flipping the sign, or dividing by n instead of n - m, misses."""
    model, data = softmax_digits
    task = softmax_task()
    positions = torch.arange(0, 500, 10)  # m = 50
    removed, _ = remove(model, task, data, positions, selection="all")
    oracle = newton_retrained(model, task, data.without(positions), LAMBDA)
    w0, w1, wr = flat(model), flat(removed), flat(oracle)
    step = w1 - w0
    moved = float(torch.linalg.vector_norm(wr - w0))
    assert float(torch.linalg.vector_norm(w0 - step - wr)) > 1.5 * moved
    n, m = len(data), 50
    assert float(torch.linalg.vector_norm(w0 + step * (n - m) / n - wr)) > 0.02 * moved


def test_quadratic_ridge_removal_is_exact():
    torch.manual_seed(1)
    n, d, k = 300, 12, 3
    x = torch.randn(n, d, dtype=torch.float64)
    y = x @ torch.randn(d, k, dtype=torch.float64) + 0.3 * torch.randn(n, k, dtype=torch.float64)
    from pipeline.data import SampleSet

    data = SampleSet({"x": x, "y": y}, torch.arange(n))
    task = DenseInputTask(loss="mse")

    def ridge(xs, ys):
        xa = torch.cat([xs, torch.ones(len(xs), 1, dtype=xs.dtype)], 1)
        a = 2.0 / (len(xs) * k) * xa.T @ xa + LAMBDA * torch.eye(d + 1, dtype=xs.dtype)
        theta = torch.linalg.solve(a, 2.0 / (len(xs) * k) * xa.T @ ys)
        return theta[:d].T, theta[d]

    model = nn.Linear(d, k).double()
    w, b = ridge(x, y)
    with torch.no_grad():
        model.weight.copy_(w)
        model.bias.copy_(b)
    positions = torch.tensor([3, 50, 77, 120, 299])
    removed, _ = remove(model, task, data, positions, selection="all")
    keep = torch.ones(n, dtype=torch.bool)
    keep[positions] = False
    wr, br = ridge(x[keep], y[keep])
    assert torch.allclose(removed.weight, wr, atol=1e-8, rtol=0)
    assert torch.allclose(removed.bias, br, atol=1e-8, rtol=0)
    # Matrix-free CG reaches the same point.
    removed_cg, out = remove(model, task, data, positions, selection="all", dense_max=1)
    assert out.record["curvature"]["solver"]["solver"] == "cg"
    assert torch.allclose(removed_cg.weight, wr, atol=1e-8, rtol=0)
