"""Gaussian noise of the certified-removal step (REFERENCE section 1, step 6)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from pipeline.data import SampleSet
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.privacy import calibrate
from pipeline.tasks import DenseInputTask


def test_sigma_follows_the_formula():
    cal = calibrate(epsilon=0.5, delta=1e-5, m=3, n=1000, strong_convexity=0.1,
                    lipschitz_loss=2.0, hessian_lipschitz=0.5)
    gamma = 2 * 0.5 * 2.0**2 * 3**2 / (0.1**3 * 1000**2)
    assert cal.gamma == pytest.approx(gamma, rel=1e-12)
    assert cal.sigma == pytest.approx(gamma / 0.5 * math.sqrt(2 * math.log(1.25 / 1e-5)), rel=1e-12)
    # m enters squared, lambda cubed: a missing factor would show here.
    assert calibrate(epsilon=0.5, delta=1e-5, m=6, n=1000, strong_convexity=0.1,
                     lipschitz_loss=2.0, hessian_lipschitz=0.5).sigma == pytest.approx(4 * cal.sigma)
    assert calibrate(epsilon=0.5, delta=1e-5, m=3, n=1000, strong_convexity=0.2,
                     lipschitz_loss=2.0, hessian_lipschitz=0.5).sigma == pytest.approx(cal.sigma / 8)
    assert calibrate(epsilon=math.inf, delta=1e-5, m=3, n=1000, strong_convexity=0.1).sigma == 0.0


@pytest.mark.parametrize("bad", [dict(epsilon=0.0), dict(epsilon=-1.0), dict(epsilon=float("nan")),
                                 dict(delta=0.0), dict(delta=1.0), dict(delta=1.5)])
def test_bad_budget_is_refused(bad):
    args = dict(epsilon=1.0, delta=1e-5, m=1, n=10, strong_convexity=0.1) | bad
    with pytest.raises(ValueError, match="epsilon|delta"):
        calibrate(**args)


def _ridge_problem(seed: int, epsilon: float):
    torch.manual_seed(0)
    n, d = 200, 10
    x = torch.randn(n, d, dtype=torch.float64)
    y = (x @ torch.randn(d, 2, dtype=torch.float64)).contiguous()
    model = nn.Linear(d, 2).double()
    return model, RemovalProblem(model, DenseInputTask(loss="mse"), SampleSet({"x": x, "y": y}, torch.arange(n)),
                                 torch.tensor([4, 9]), 0.5, seed=seed)


def test_empirical_noise_std_matches_sigma():
    method = get_method("lfoci-newton")
    base_model, base_problem = _ridge_problem(0, math.inf)
    clean = copy.deepcopy(base_model)
    method.run(RemovalProblem(clean, base_problem.task, base_problem.train, base_problem.forget_positions, 0.5),
               method.Settings(selection="all"))
    clean_w = torch.cat([p.detach().reshape(-1) for p in clean.parameters()])
    settings = method.Settings(selection="all", epsilon=2.0, delta=1e-5, lipschitz_loss=3.0)
    diffs, sigma = [], None
    for seed in range(150):
        model = copy.deepcopy(base_model)
        problem = RemovalProblem(model, base_problem.task, base_problem.train, base_problem.forget_positions, 0.5, seed=seed)
        out = method.run(problem, settings)
        sigma = out.record["noise"]["sigma"]
        diffs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - clean_w)
    noise = torch.stack(diffs)
    assert sigma > 0
    assert float(noise.std()) == pytest.approx(sigma, rel=0.05)
    assert abs(float(noise.mean())) < 0.05 * sigma
    # The noise is secret: the same seed gives different noise (nothing in the seed or the
    # record regenerates it), while the deterministic part of the update is the same.
    assert not torch.equal(noise[0], noise[1])
    model = copy.deepcopy(base_model)
    method.run(RemovalProblem(model, base_problem.task, base_problem.train, base_problem.forget_positions, 0.5, seed=0), settings)
    again = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - clean_w
    assert not any(torch.equal(again, row) for row in noise)


def test_infinite_epsilon_adds_no_noise():
    method = get_method("lfoci-newton")
    model_a, problem_a = _ridge_problem(0, math.inf)
    model_b = copy.deepcopy(model_a)
    out = method.run(problem_a, method.Settings(selection="all"))
    problem_b = RemovalProblem(model_b, problem_a.task, problem_a.train, problem_a.forget_positions, 0.5, seed=99)
    method.run(problem_b, method.Settings(selection="all", epsilon=math.inf))
    assert out.record["noise"]["sigma"] == 0.0 and out.record["noise_norm"] == 0.0
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
