"""Fisher / Newton scrubbing against exact float64 oracles (shared/REFERENCE.md sections 2, 5)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from pipeline.curvature import BlockHessian, block_gradient
from pipeline.data import SampleSet
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.methods.fisher_scrub import (
    DenseCurvature, DiagonalCurvature, dense_curvature, fisher_diagonal, noise_scale,
)
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from tests.kit import digits64
from tests.scrub_helpers import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 0.05


def ridge(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin (1/(N K)) sum ||W x + b - y||^2 + (lambda/2)(||W||^2 + ||b||^2), closed form."""
    n, k = y.shape
    xa = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)
    a = 2.0 / (n * k) * xa.T @ xa + LAMBDA * torch.eye(xa.shape[1], dtype=x.dtype)
    theta = torch.linalg.solve(a, 2.0 / (n * k) * xa.T @ y)
    return theta[:-1].T, theta[-1]


@pytest.fixture(scope="module")
def ridge_problem():
    torch.manual_seed(1)
    n, d, k = 240, 5, 2
    x = torch.randn(n, d, dtype=torch.float64) * torch.linspace(0.3, 3.0, d, dtype=torch.float64)
    y = x @ torch.randn(d, k, dtype=torch.float64) + 0.5 * torch.randn(n, k, dtype=torch.float64)
    data = SampleSet({"x": x, "y": y}, torch.arange(n))
    model = nn.Linear(d, k).double()
    w, b = ridge(x, y)
    with torch.no_grad():
        model.weight.copy_(w)
        model.bias.copy_(b)
    return model, DenseInputTask(loss="mse"), data


def scrub(model, task, data, positions, **settings):
    work = copy.deepcopy(model)
    method = get_method("fisher")
    problem = RemovalProblem(work, task, data, torch.as_tensor(positions), LAMBDA, seed=11)
    return work, method.run(problem, method.Settings(**settings)), problem


def test_newton_part_lands_on_the_retrained_optimum(ridge_problem):
    model, task, data = ridge_problem
    positions = torch.arange(0, 240, 6)  # m = 40
    work, outcome, problem = scrub(model, task, data, positions, tradeoff=0.0, curvature="dense")
    x, y = problem.retain.columns["x"], problem.retain.columns["y"]
    wr, br = ridge(x, y)
    assert torch.allclose(work.weight, wr, atol=1e-8, rtol=0)
    assert torch.allclose(work.bias, br, atol=1e-8, rtol=0)
    assert float(torch.linalg.vector_norm(work.weight.detach() - model.weight.detach())) > 1e-3  # the removal mattered
    rec = outcome.record
    assert rec["block"]["numel"] == 12 and rec["curvature"]["kind"] == "dense"
    assert rec["gradient_norms"]["retain_mean_block_after_newton"] < 1e-10
    assert rec["noise"]["norm"] == 0.0


def _dense_b(model, task, retain) -> DenseCurvature:
    h = BlockHessian(model, task, retain, ParamBlock.all_parameters(model), LAMBDA, reduction="mean")
    return dense_curvature(h.to_dense(), LAMBDA)


def test_noise_covariance_is_sqrt_lambda_sigma2_b_inverse_sqrt(ridge_problem):
    """Empirical covariance of many seeded draws vs sqrt(lambda_f sigma_h^2) B^{-1/2}; the same
    check against B^{-1}, or with lambda_f dropped, fails."""
    model, task, data = ridge_problem
    positions = torch.arange(0, 240, 6)
    tradeoff, sigma_h = 0.2, 0.3
    _, outcome, problem = scrub(model, task, data, positions, tradeoff=tradeoff, sigma_h=sigma_h, curvature="dense")
    curv = _dense_b(model, task, problem.retain)
    evals = curv.eigenvalues
    assert float(evals.max() / evals.min()) > 20  # B is far from a multiple of I
    s = noise_scale(tradeoff, sigma_h)
    draws = curv.noise(s, torch.Generator().manual_seed(5), draws=40_000)
    empirical = draws.T @ draws / draws.shape[0]
    u = curv.eigenvectors
    target = (tradeoff * sigma_h**2) ** 0.5 * (u * evals.pow(-0.5)) @ u.T
    err = lambda ref: float(torch.linalg.matrix_norm(empirical - ref) / torch.linalg.matrix_norm(ref))  # noqa: E731
    assert err(target) <= 0.05
    assert torch.allclose(curv.noise_covariance(s), target, rtol=1e-12, atol=0)
    wrong_power = (tradeoff * sigma_h**2) ** 0.5 * (u * evals.pow(-1.0)) @ u.T
    lambda_dropped = (sigma_h**2) ** 0.5 * (u * evals.pow(-0.5)) @ u.T
    assert err(wrong_power) > 0.05 and err(lambda_dropped) > 0.05
    # The method's noise is this sampler's draw on its own stream.
    clean, _, _ = scrub(model, task, data, positions, tradeoff=0.0, curvature="dense")
    noisy, _, _ = scrub(model, task, data, positions, tradeoff=tradeoff, sigma_h=sigma_h, curvature="dense")
    block = ParamBlock.all_parameters(model)
    realised = block.gather(dict(noisy.named_parameters())) - block.gather(dict(clean.named_parameters()))
    expected = curv.noise(s, problem.generator(stream=4))
    assert torch.allclose(realised.detach(), expected, atol=1e-12, rtol=1e-9)
    assert outcome.record["noise"]["scale"] == pytest.approx(s)


def test_diagonal_noise_std_is_fisher_to_the_minus_quarter():
    f = torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0], dtype=torch.float64)
    curv = DiagonalCurvature(f)
    draws = curv.noise(0.5, torch.Generator().manual_seed(0), draws=40_000)
    std = draws.std(dim=0)
    assert torch.allclose(std, 0.5 * f.pow(-0.25), rtol=0.03)
    assert not torch.allclose(std, 0.5 * f.pow(-0.5), rtol=0.3)


def test_fisher_diagonal_is_mean_squared_per_sample_gradient():
    data = digits64()["train"].take(torch.arange(40))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).double()
    task = DenseInputTask(loss="cross_entropy")
    block = ParamBlock.from_rows(model, {"3.weight": None, "1.bias": [0, 3]})
    got = fisher_diagonal(model, task, data, block, 0.01, batch_size=16)
    params = {n: p.detach() for n, p in model.named_parameters()}
    total = torch.zeros(block.numel, dtype=torch.float64)
    for i in range(len(data)):
        sample = {k: v[i : i + 1] for k, v in data.columns.items()}

        def loss(delta):
            out = functional_call(model, block.insert(params, delta), (sample["x"],))
            return task.per_sample_loss(out, sample).sum()

        total += grad(loss)(torch.zeros(block.numel, dtype=torch.float64)) ** 2
    assert torch.allclose(got, total / len(data) + 0.01, rtol=1e-10, atol=1e-14)


def test_diagonal_scrub_on_a_parameter_subset():
    data = digits64()["train"].take(torch.arange(300))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).double()
    from pipeline.training import fit_lbfgs

    task = DenseInputTask(loss="cross_entropy")
    fit_lbfgs(model, task, data, LAMBDA, max_steps=50, tolerance=1e-9)
    work, outcome, _ = scrub(model, task, data, torch.arange(0, 30), parameters=["3.weight", "3.bias"],
                             curvature="diagonal", tradeoff=1e-6, sigma_h=1e-2)
    assert torch.equal(work[1].weight, model[1].weight)  # outside the block: untouched
    assert not torch.equal(work[3].weight, model[3].weight)
    rec = outcome.record
    assert rec["curvature"]["kind"] == "diagonal" and rec["block"]["numel"] == 90
    # new w_P = w_P - g / F + s F^{-1/4} z on the block
    block = ParamBlock.from_rows(model, {"3.weight": None, "3.bias": None})
    retain = data.without(torch.arange(0, 30))
    g = block_gradient(model, task, retain, block, LAMBDA, reduction="mean")
    f = fisher_diagonal(model, task, retain, block, LAMBDA)
    z = torch.randn(block.numel, generator=RemovalProblem(model, task, data, torch.arange(1), LAMBDA,
                                                          seed=11).generator(stream=4), dtype=torch.float64)
    expected = -g / f + noise_scale(1e-6, 1e-2) * f.pow(-0.25) * z
    moved = block.gather(dict(work.named_parameters())) - block.gather(dict(model.named_parameters()))
    assert torch.allclose(moved.detach(), expected, rtol=1e-8, atol=1e-12)


def test_dense_curvature_floors_negative_eigenvalues():
    b = torch.diag(torch.tensor([-1.0, 1e-9, 2.0], dtype=torch.float64))
    curv = dense_curvature(b, 0.1)
    assert torch.allclose(curv.eigenvalues, torch.tensor([0.1, 0.1, 2.0], dtype=torch.float64))
    assert "2 of 3 eigenvalues" in curv.notes[0]


def test_yaml_mirrors_settings_and_record_is_json(ridge_problem):
    import json

    from tests.scrub_helpers import assert_yaml_mirrors_settings

    assert_yaml_mirrors_settings("fisher")
    model, task, data = ridge_problem
    _, outcome, _ = scrub(model, task, data, torch.arange(3), curvature="diagonal")
    json.dumps(outcome.record)
