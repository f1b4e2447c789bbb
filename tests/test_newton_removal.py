"""L-FOCI Newton as a removal that stays right on real models (issue 11 items 1, 2, 7, 8, 9,
10; issue 12 section 2): the retained-gradient step from a model NOT at its optimum, the
default closing the distance to the retrained optimum, sequential removals, frozen
parameters, robust (damped) solves that refuse to publish an unsolved system, the typed
privacy release, and stage timings."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipeline.curvature import DenseOperator, solve_newton_system
from pipeline.errors import RemovalNotServed, UnsolvedSystemError
from pipeline.data import SampleSet
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.param_block import ParamBlock
from pipeline.privacy.noise import analytic_gaussian_sigma
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs, fit_newton
from tests.kit import digits64, flat, newton_fit, newton_retrained, softmax_task

LAMBDA = 0.01


def remove(model, task, train, positions, seed: int = 3, hook=None, **settings):
    work = copy.deepcopy(model)
    method = get_method("lfoci-newton")
    problem = RemovalProblem(work, task, train, torch.as_tensor(positions), LAMBDA, seed=seed, stage_hook=hook)
    outcome = method.run(problem, method.Settings(**settings))
    return work, outcome


def share_left(w0: torch.Tensor, w1: torch.Tensor, wr: torch.Tensor) -> float:
    """||w1 - w_retrained|| / ||w0 - w_retrained||: the share of the distance left."""
    return float(torch.linalg.vector_norm(w1 - wr) / torch.linalg.vector_norm(w0 - wr))


def retained_objective(model: nn.Module, task, data: SampleSet, lam: float):
    """w (flat, all parameters) -> mean loss on ``data`` + lam/2 ||w||^2, written out."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]

    def f(w: torch.Tensor) -> torch.Tensor:
        pieces = dict(zip(names, (t.reshape(s) for t, s in zip(torch.split(w, sizes), shapes))))
        out = functional_call(model, pieces, (data.columns["x"],))
        return task.per_sample_loss(out, data.columns).mean() + 0.5 * lam * (w * w).sum()

    return f


@pytest.fixture(scope="module")
def digits():
    return digits64()["train"]


@pytest.fixture(scope="module")
def softmax_digits(digits):
    model = newton_fit(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), softmax_task(), digits, LAMBDA)
    return model, digits


@pytest.fixture(scope="module")
def small_mlp(digits):
    """64-6-10 tanh network fitted to a tight optimum (non-convex)."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    fit_lbfgs(net, softmax_task(), digits, LAMBDA, tolerance=1e-6, max_steps=60)
    report = fit_newton(net, softmax_task(), digits, LAMBDA, tolerance=1e-9, max_steps=40)
    assert report.gradient_norm <= 1e-8, report
    return net


@pytest.fixture(scope="module")
def softmax_off_optimum(softmax_digits):
    """The tight optimum moved by a fixed perturbation: grad L_D is far from 0."""
    model, data = softmax_digits
    off = copy.deepcopy(model)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in off.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return off, data


# ---------------------------------------------------------------------------------------
# 11.1 the step uses the retained gradient: exact from any start
# ---------------------------------------------------------------------------------------
def test_quadratic_ridge_off_optimum_one_step_is_the_retrained_optimum():
    torch.manual_seed(1)
    n, d, k = 300, 12, 3
    x = torch.randn(n, d, dtype=torch.float64)
    y = x @ torch.randn(d, k, dtype=torch.float64) + 0.3 * torch.randn(n, k, dtype=torch.float64)
    data = SampleSet({"x": x, "y": y}, torch.arange(n))
    model = nn.Linear(d, k).double()  # random init: far from the ridge optimum of D
    positions = torch.tensor([3, 50, 77, 120, 299])
    keep = torch.ones(n, dtype=torch.bool)
    keep[positions] = False
    xa = torch.cat([x[keep], torch.ones(int(keep.sum()), 1, dtype=x.dtype)], 1)
    a = 2.0 / (len(xa) * k) * xa.T @ xa + LAMBDA * torch.eye(d + 1, dtype=x.dtype)
    theta = torch.linalg.solve(a, 2.0 / (len(xa) * k) * xa.T @ y[keep])
    for solver in ({}, {"dense_max": 1}):  # dense Cholesky and matrix-free CG
        removed, out = remove(model, DenseInputTask(loss="mse"), data, positions, selection="all",
                              newton_max_steps=1, **solver)
        assert out.record["newton"]["steps"] == 1
        assert torch.allclose(removed.weight, theta[:d].T, atol=1e-8, rtol=0)
        assert torch.allclose(removed.bias, theta[d], atol=1e-8, rtol=0)


def test_softmax_off_optimum_one_step_equals_the_exact_newton_step(softmax_off_optimum):
    """w' = w - H_r^{-1} grad L_r(w), with H_r and grad L_r from torch.autograd on the written-out
    retained objective (independent of pipeline.curvature)."""
    model, data = softmax_off_optimum
    task = softmax_task()
    positions = torch.arange(0, 1000, 20)  # m = 50
    removed, out = remove(model, task, data, positions, selection="all", newton_max_steps=1)
    f = retained_objective(model, task, data.without(positions), LAMBDA)
    w0 = flat(model)
    g = torch.autograd.functional.jacobian(f, w0)
    h = torch.autograd.functional.hessian(f, w0)
    want = w0 - torch.linalg.solve(h, g)
    assert float(torch.linalg.vector_norm(g)) > 1e-2  # really off the optimum
    assert float(torch.linalg.vector_norm(flat(removed) - want)) <= 1e-8 * float(torch.linalg.vector_norm(want - w0))
    # the forget-gradient form (1/(n-m)) H'^-1 sum_U grad f is a different point here
    assert out.record["gradient_norms"]["data_mean_block_start"] > 1e-2


def test_ten_sequential_noiseless_removals_end_at_the_retrained_optimum(softmax_digits):
    model, data = softmax_digits
    task = softmax_task()
    work, train = copy.deepcopy(model), data
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        positions = torch.randperm(len(train), generator=g)[:5]
        work, out = remove(work, task, train, positions, newton_max_steps=1)
        train = train.without(positions)
    oracle = newton_retrained(model, task, train, LAMBDA)
    left = share_left(flat(model), flat(work), flat(oracle))
    assert left <= 0.01, left


# ---------------------------------------------------------------------------------------
# 11.2 the default forgets: share of the distance left on the convex digits oracle
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 10, 50])
def test_default_closes_the_distance_on_convex_digits(softmax_digits, m):
    model, data = softmax_digits
    task = softmax_task()
    positions = torch.randperm(len(data), generator=torch.Generator().manual_seed(100 + m))[:m]
    removed, out = remove(model, task, data, positions)  # default settings
    oracle = newton_retrained(model, task, data.without(positions), LAMBDA)
    left = share_left(flat(model), flat(removed), flat(oracle))
    assert left <= 0.05, (m, left)
    assert left <= 1e-4, (m, left)  # converged block Newton on the whole (convex) model
    rec = out.record
    assert rec["selection"]["strategy_used"] == "all" and rec["block"]["full_model"]
    assert rec["gradient_share"]["retained_removed"] >= 0.999999
    assert rec["gradient_share"]["forget_in_block"] == 1.0
    assert rec["newton"]["converged"]


# ---------------------------------------------------------------------------------------
# 11.7 frozen parameters never enter a block
# ---------------------------------------------------------------------------------------
def test_frozen_parameters_never_enter_a_block(small_mlp, digits):
    data = digits
    net = copy.deepcopy(small_mlp)
    net[1].weight.requires_grad_(False)  # frozen at its trained value: the rest is still at its optimum
    with pytest.raises(ValueError, match=r"frozen.*1\.weight|1\.weight.*frozen"):
        ParamBlock.from_rows(net, {"1.weight": None, "3.weight": None})
    with pytest.raises(ValueError, match="frozen"):
        remove(net, softmax_task(), data, [0, 1], selection="parameters", parameters=["1.weight"])
    assert all(p.name != "1.weight" for p in ParamBlock.all_parameters(net).parts)
    # the default block on a model with a frozen layer leaves that layer exactly as it was
    removed, out = remove(net, softmax_task(), data, [0, 1])
    assert torch.equal(removed[1].weight, net[1].weight)
    assert not torch.equal(removed[3].weight, net[3].weight)
    assert all(part["parameter"] != "1.weight" for part in out.record["block"]["parts"])


# ---------------------------------------------------------------------------------------
# 11.8 robust solves: damped when indefinite, refused when unsolved
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dense", [True, False])
def test_indefinite_system_gets_damped_and_solved(dense):
    g = torch.Generator().manual_seed(2)
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))
    eig = torch.linspace(-0.5, 4.0, 30, dtype=torch.float64)
    a = q @ torch.diag(eig) @ q.T
    b = torch.randn(30, generator=g, dtype=torch.float64)
    x, info = solve_newton_system(DenseOperator(a), b, dense=dense, damping=0.01, rtol=1e-10)
    assert info.positive_definite is False
    assert info.damping > 0.5  # lambda_min(A) = -0.5: the solved system is positive definite
    assert info.damping_added == pytest.approx(info.damping - 0.01)
    damped = a + info.damping * torch.eye(30, dtype=torch.float64)
    assert float(torch.linalg.eigvalsh(damped)[0]) > 0
    assert float(torch.linalg.vector_norm(damped @ x - b) / torch.linalg.vector_norm(b)) <= 1e-9
    assert info.relative_residual <= 1e-10


def test_capped_cg_that_cannot_reach_the_tolerance_is_not_a_removal(softmax_digits):
    model, data = softmax_digits
    with pytest.raises(UnsolvedSystemError, match="not solved to the stated tolerance") as err:
        remove(model, softmax_task(), data, torch.arange(10), dense_max=1, cg_max_iter=2)
    assert isinstance(err.value, RemovalNotServed) and isinstance(err.value, ValueError)
    assert err.value.diagnostics["solver"]["relative_residual"] > 1e-10
    json.dumps(err.value.diagnostics, allow_nan=False)


def test_a_step_that_cannot_serve_is_refused_and_the_model_left_as_it_was(softmax_digits):
    model, data = softmax_digits
    work = copy.deepcopy(model)
    method = get_method("lfoci-newton")
    problem = RemovalProblem(work, softmax_task(), data, torch.arange(10), LAMBDA)
    # a block of one bias row cannot remove the retained gradient of ten samples
    settings = method.Settings(selection="parameters", parameters=["1.bias"], newton_max_steps=1,
                               min_gradient_reduction=0.999)
    with pytest.raises(RemovalNotServed, match="cannot serve"):
        method.run(problem, settings)
    assert torch.equal(flat(work), flat(model))


# ---------------------------------------------------------------------------------------
# 11.9 / 11.10 release and secret noise
# ---------------------------------------------------------------------------------------
def test_release_is_certified_only_where_the_theorem_holds(softmax_digits):
    model, data = softmax_digits
    task = softmax_task()
    pos = torch.arange(3)
    _, out = remove(model, task, data, pos, epsilon=0.5, newton_max_steps=1)
    rel = out.release
    assert rel.guarantee.value == "certified" and rel.calibration == "classical" and not rel.reasons
    assert out.record["release"] == rel.model_dump(mode="json")
    # epsilon >= 1: analytic Gaussian mechanism (Balle & Wang)
    _, out = remove(model, task, data, pos, epsilon=2.0, newton_max_steps=1)
    assert out.release.calibration == "analytic"
    assert out.release.sigma == pytest.approx(analytic_gaussian_sigma(2.0, 1e-5, out.release.sensitivity), rel=1e-9)
    # a blockwise step is heuristic, and says why
    _, out = remove(model, task, data, pos, epsilon=0.5, selection="parameters", parameters=["1.weight"],
                    min_gradient_reduction=0.0)
    assert out.release.guarantee.value == "heuristic"
    assert any("blockwise" in r for r in out.release.reasons)
    # a damped step from a start that is not the minimiser, with a bound too tight to cover it
    _, out = remove(model, task, data, pos, epsilon=0.5, newton_max_steps=1, damping=0.5, lipschitz_loss=1e-3,
                    min_gradient_reduction=0.0)
    reasons = " ".join(out.release.reasons)
    assert out.release.guarantee.value == "heuristic"
    assert "damped" in reasons and "gamma" in reasons


def test_release_is_heuristic_on_a_non_convex_model(small_mlp, digits):
    _, out = remove(small_mlp, softmax_task(), digits, [0, 1], epsilon=0.5)
    assert out.release.guarantee.value == "heuristic"
    assert any("not one affine map" in r for r in out.release.reasons)


def test_same_seed_gives_different_noise_and_identical_everything_else(softmax_digits):
    model, data = softmax_digits
    task = softmax_task()
    a, out_a = remove(model, task, data, torch.arange(4), seed=9, epsilon=0.5)
    b, out_b = remove(model, task, data, torch.arange(4), seed=9, epsilon=0.5)
    ra, rb = out_a.record, out_b.record
    assert not torch.equal(flat(a), flat(b))  # secret noise differs
    sigma = ra["noise"]["sigma"]
    assert sigma > 0 and float((flat(a) - flat(b)).std()) == pytest.approx(math.sqrt(2) * sigma, rel=0.25)
    assert "noise_norm" not in ra
    # only the published weights' own figures differ (anyone recomputes them from those weights)
    published = {"gradient_norms": {"retain_mean_block_after", "residual_after"},
                 "gradient_share": {"retained_removed"}, "step_norm": None}
    for key in set(ra) - {"timings", "removal_seconds", "preparation"}:
        if key in published and published[key] is not None:
            for sub in set(ra[key]) - published[key]:
                assert ra[key][sub] == rb[key][sub], (key, sub)
        elif key not in published:
            assert ra[key] == rb[key], key
    text = json.dumps(ra, allow_nan=False)  # strict JSON
    assert "seed" not in text.lower()  # nothing that regenerates the noise

    def keys(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield k
                yield from keys(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from keys(v)

    assert not any("seed" in k for k in keys(ra))


# ---------------------------------------------------------------------------------------
# stage timing
# ---------------------------------------------------------------------------------------
def test_stages_are_reported_to_the_hook(small_mlp, digits):
    seen: list[tuple[str, str]] = []

    class Hook:
        def started(self, stage: str) -> None:
            seen.append(("start", stage))

        def finished(self, stage: str, seconds: float) -> None:
            assert seconds >= 0
            seen.append(("end", stage))

    _, out = remove(small_mlp, softmax_task(), digits, [0, 1], hook=Hook(), selection="lfoci", perturbations=40,
                    pass_size=20)
    names = {s for _, s in seen}
    assert {"probe", "selection", "gradients", "curvature_and_solve", "verify"} <= names
    assert [s for kind, s in seen if kind == "start"].count("probe") == 1
    assert set(out.record["timings"]) == names
