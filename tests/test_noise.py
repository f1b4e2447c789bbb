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
    assert out.record["noise"]["sigma"] == 0.0 and "noise_norm" not in out.record
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


def _mp_delta(eps: float, sigma: float, sens: float):
    """delta(eps) of the Gaussian mechanism, written out at 50 digits with mpmath (independent of
    scipy): Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D)."""
    import mpmath

    mpmath.mp.dps = 50
    phi = lambda x: mpmath.ncdf(x)  # noqa: E731
    a, b = mpmath.mpf(sens) / (2 * mpmath.mpf(sigma)), mpmath.mpf(eps) * mpmath.mpf(sigma) / mpmath.mpf(sens)
    return phi(a - b) - mpmath.e ** mpmath.mpf(eps) * phi(-a - b)


@pytest.mark.parametrize("eps,delta,sens", [(1.0, 1e-5, 1.0), (2.0, 1e-5, 0.3), (8.0, 1e-6, 1.0), (0.5, 1e-5, 2.0),
                                            (30.0, 1e-5, 1.0)])
def test_analytic_gaussian_sigma_is_the_smallest_noise_reaching_delta(eps, delta, sens):
    from pipeline.privacy.noise import analytic_gaussian_sigma

    sigma = analytic_gaussian_sigma(eps, delta, sens)
    assert float(_mp_delta(eps, sigma, sens)) <= delta * (1 + 1e-9)
    assert float(_mp_delta(eps, sigma * (1 - 1e-6), sens)) > delta  # and no smaller sigma does
    # sigma scales linearly with the sensitivity
    assert analytic_gaussian_sigma(eps, delta, 10 * sens) == pytest.approx(10 * sigma, rel=1e-9)


def test_analytic_gaussian_known_value_and_tighter_than_classical():
    """Balle & Wang 2018 (Fig. 1 setting): eps = 1, delta = 1e-5, D = 1 gives sigma = 3.7306
    (computed independently by the mpmath bisection above); the classical formula at eps -> 1
    gives 4.84: the analytic mechanism is tighter, and valid for eps >= 1 where the classical is not."""
    from pipeline.privacy.noise import analytic_gaussian_sigma, classical_gaussian_sigma

    assert analytic_gaussian_sigma(1.0, 1e-5, 1.0) == pytest.approx(3.7306, abs=5e-4)
    for eps in (0.1, 0.5, 0.9):
        assert analytic_gaussian_sigma(eps, 1e-5, 1.0) < classical_gaussian_sigma(eps, 1e-5, 1.0)
    with pytest.raises(ValueError, match="epsilon < 1"):
        classical_gaussian_sigma(1.0, 1e-5, 1.0)


def test_calibrate_uses_classical_below_one_and_analytic_from_one():
    from pipeline.privacy.noise import analytic_gaussian_sigma

    low = calibrate(epsilon=0.5, delta=1e-5, m=3, n=1000, strong_convexity=0.1)
    assert low.calibration == "classical"
    high = calibrate(epsilon=2.0, delta=1e-5, m=3, n=1000, strong_convexity=0.1)
    assert high.calibration == "analytic"
    assert high.sigma == pytest.approx(analytic_gaussian_sigma(2.0, 1e-5, high.gamma), rel=1e-12)
    huge = calibrate(epsilon=10000.0, delta=1e-5, m=3, n=1000, strong_convexity=0.1)  # fast, tiny
    assert 0 < huge.sigma < 1e-2 * high.sigma
    assert calibrate(epsilon=math.inf, delta=1e-5, m=3, n=1000, strong_convexity=0.1).as_record()["calibration"] == "none"
