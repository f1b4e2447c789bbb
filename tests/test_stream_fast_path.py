"""The streaming decision-layer state (pipeline/streaming.py, issue 13 section 1) against exact
oracles: a from-scratch gradient and Hessian (autograd, float64), the exactly retrained optimum
(tight L-BFGS on the retained set), one step of lfoci-newton, and the drift bound against the
measured gradient error."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.curvature import block_gradient
from pipeline.data import SampleSet
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.param_block import ParamBlock
from pipeline.streaming import DecisionLayerStream, StreamSettings
from tests.kit import digits64, sgd_mlp_head, softmax_task

LAMBDA = 0.01
HEAD = ["3.weight", "3.bias"]


@pytest.fixture(scope="module")
def digits():
    return digits64()["train"]


@pytest.fixture(scope="module")
def sgd_mlp(digits):
    """64-16-10 ReLU head after two epochs of SGD: its decision layer is not at an optimum."""
    return sgd_mlp_head(digits, seed=3, epochs=2)


def build(model, data, **kw):
    """The state, built holding the model's weights (target term a = grad F_D(theta_0) until a removal sets one)."""
    settings = kw.pop("settings", StreamSettings(refresh_every=10_000, drift_threshold=float("inf")))
    state, prefix = DecisionLayerStream.from_model(model, softmax_task(), data, HEAD, LAMBDA, settings=settings, **kw)
    return state, prefix


def minimiser_term(state):
    """The target term of the minimiser of F_R: a = 0."""
    return torch.zeros(state.p, dtype=torch.float64)


def features(model, data, removed=()):
    keep = data.without(data.positions_of(list(removed))) if removed else data
    with torch.no_grad():
        return model[:3](keep.columns["x"]), keep.columns["y"]


def retrained_optimum(model, data, removed, anchor):
    """argmin over theta of mean CE + (lambda/2)||theta||^2 - <anchor, theta> on D minus removed: tight L-BFGS."""
    h, y = features(model, data, removed)
    k, d = model[3].weight.shape
    w = torch.cat([model[3].weight.detach().reshape(-1), model[3].bias.detach()]).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=500, history_size=50, tolerance_grad=1e-13, tolerance_change=0.0,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        f = nn.functional.cross_entropy(h @ w[: k * d].reshape(k, d).T + w[k * d:], y) \
            + 0.5 * LAMBDA * w.pow(2).sum() - anchor @ w
        f.backward()
        return f

    for _ in range(20):
        opt.step(closure)
    closure()
    assert float(w.grad.norm()) < 1e-8
    return w.detach()


# the L-BFGS oracle stops at ||grad|| < 1e-8: it lies within 1e-8 / lambda of the optimum
ORACLE_TOL = 1e-8 / LAMBDA


def exact_objective_parts(state, model, data):
    """From scratch at the state's weights on its retained set: grad F_R (autograd via the
    project's block_gradient) and the Hessian (torch.autograd.functional.hessian)."""
    net = copy.deepcopy(model)
    with torch.no_grad():
        net[3].weight.copy_(state.weight)
        net[3].bias.copy_(state.bias)
    keep = data.take(torch.nonzero(state.retained).squeeze(1))
    block = ParamBlock.from_rows(net, {n: None for n in HEAD})
    g = block_gradient(net, softmax_task(), keep, block, LAMBDA, reduction="mean")
    h_in, y = features(net, keep)
    k, d = net[3].weight.shape

    def f(theta):
        return nn.functional.cross_entropy(h_in @ theta[: k * d].reshape(k, d).T + theta[k * d:], y) \
            + 0.5 * LAMBDA * theta.pow(2).sum()

    hess = torch.autograd.functional.hessian(f, state.theta.clone())
    return g, hess


def test_refresh_gradient_and_curvature_equal_a_from_scratch_computation(sgd_mlp, digits):
    state, prefix = build(sgd_mlp, digits)
    assert prefix is not None and prefix.start == 3  # the frozen modules before the layer: Flatten, Linear, ReLU
    g, hess = exact_objective_parts(state, sgd_mlp, digits)
    assert float((state.anchor - g).abs().max()) <= 1e-10        # a = grad F_D(theta_0)
    ids = digits.sample_ids.tolist()
    for group in ([ids[5]], [ids[40], ids[41], ids[300]], [ids[7]]):
        state.remove(group)
    state.refresh(converge=False)
    g, hess = exact_objective_parts(state, sgd_mlp, digits)
    assert float((state.tracked_gradient() - g).abs().max()) <= 1e-8 * max(1.0, float(g.abs().max()))
    assert float((state.system() - hess).abs().max()) <= 1e-8 * float(hess.abs().max())
    assert state.n == len(digits) - 5 and state.retained.sum() == state.n


def test_incremental_updates_equal_the_sums_over_the_retained_set(sgd_mlp, digits):
    """Between refreshes G_R and S_R are the sums at theta_ref over R: subtracting each removed
    sample's own gradient and rank-K curvature (a missing sample or wrong sign shows here)."""
    state, _ = build(sgd_mlp, digits)
    removed = digits.sample_ids[[3, 9, 27, 81, 243]].tolist()
    state.remove(removed[:2])
    state.remove(removed[2:])
    keep = torch.nonzero(state.retained).squeeze(1)
    ref = state._ref.theta
    g_ref = state._gradient_sum(state.x[keep], state.y[keep], ref)
    s_ref = state._curvature_sum(state.x[keep], ref)
    assert float((state.G - g_ref).abs().max()) <= 1e-9 * float(g_ref.abs().max())
    assert float((state.S - s_ref).abs().max()) <= 1e-9 * float(s_ref.abs().max())


@pytest.mark.parametrize("term", ["minimiser", "kept"])
def test_fast_removals_then_a_refresh_land_on_the_target(sgd_mlp, digits, term):
    """Each removal lands near the stationary point of F_R - <a, theta> its target term sets (the
    minimiser's a = 0, or a kept from the build), a refresh on it."""
    state, _ = build(sgd_mlp, digits)
    if term == "minimiser":  # the state moved to the minimiser of F_D first: removals then move it a little
        state.anchor = minimiser_term(state)
        assert state.refresh(converge=True)["converged"]
    start = state.theta.clone()
    target = minimiser_term if term == "minimiser" else None
    target_anchor = torch.zeros(state.p, dtype=torch.float64) if term == "minimiser" else state.anchor.clone()
    ids = digits.sample_ids.tolist()
    removed = [ids[i] for i in range(11, 11 + 3 * 30, 3)]
    steps = [state.remove([i], target=target) for i in removed[:25]] + [state.remove(removed[25:], target=target)]
    assert all(s.path == "fast" for s in steps)
    oracle = retrained_optimum(sgd_mlp, digits, removed, target_anchor)
    span = float(torch.linalg.vector_norm(start - oracle))
    assert span > 1e-3
    fast_error = float(torch.linalg.vector_norm(state.theta - oracle))
    assert fast_error <= 0.05 * span                      # the fast path alone already closes most of it
    assert fast_error <= steps[-1].distance_bound + ORACLE_TOL   # and its recorded bound holds
    record = state.refresh(converge=True)
    assert record["converged"]
    assert float(torch.linalg.vector_norm(state.theta - oracle)) <= ORACLE_TOL
    if term == "kept":  # the target term matters: without it the optimum is elsewhere
        plain = retrained_optimum(sgd_mlp, digits, removed, torch.zeros_like(target_anchor))
        assert float(torch.linalg.vector_norm(plain - oracle)) > 1e3 * ORACLE_TOL


def test_first_fast_removal_after_a_refresh_is_one_lfoci_newton_step(sgd_mlp, digits):
    """Same conventions as lfoci-newton: mean loss + weight decay, n - m normalisation, the
    retained gradient, the sign of the step (both towards the minimiser)."""
    state, _ = build(sgd_mlp, digits)
    positions = [4, 8, 15, 16, 23, 42]
    state.remove(digits.sample_ids[positions].tolist(), target=minimiser_term)
    work = copy.deepcopy(sgd_mlp)
    method = get_method("lfoci-newton")
    problem = RemovalProblem(work, softmax_task(), digits, torch.as_tensor(positions), LAMBDA, seed=1)
    outcome = method.run(problem, method.Settings(selection="parameters", parameters=HEAD, target="minimiser",
                                                  newton_max_steps=1, max_backtracks=0, min_gradient_reduction=0.0))
    theirs = torch.cat([outcome.new_parameters["3.weight"].reshape(-1), outcome.new_parameters["3.bias"]])
    moved = float(torch.linalg.vector_norm(theirs - torch.cat([sgd_mlp[3].weight.reshape(-1), sgd_mlp[3].bias]).detach()))
    assert moved > 1e-4
    assert float(torch.linalg.vector_norm(state.theta - theirs)) <= 1e-8 * moved


def test_drift_bound_bounds_the_measured_gradient_error(sgd_mlp, digits):
    state, _ = build(sgd_mlp, digits)
    ids = digits.sample_ids.tolist()
    ratios = []
    for j in range(40):
        group = [ids[100 + 5 * j]] if j % 4 else [ids[100 + 5 * j], ids[101 + 5 * j], ids[102 + 5 * j]]
        step = state.remove(group)
        assert step.path == "fast"
        measured = float(torch.linalg.vector_norm(state.exact_gradient() - state.anchor))
        assert measured <= step.gradient_error_bound
        ratios.append(measured / step.gradient_error_bound)
        # distance to the stationary point of F_R - <a, .> on this retained set: within the recorded bound
        if j in (9, 39):
            removed = state.sample_ids[~state.retained].tolist()
            oracle = retrained_optimum(sgd_mlp, digits, removed, state.anchor)
            assert float(torch.linalg.vector_norm(state.theta - oracle)) <= step.distance_bound + ORACLE_TOL
    assert max(ratios) > 1e-4  # the bound is not vacuous here


def test_tracked_gradient_is_a_first_order_model_error_quadratic_in_the_distance(sgd_mlp, digits):
    """||grad F_R(theta_ref + t v) - g^_R(theta_ref + t v)|| = O(t^2) with the constant of the
    bound: halving t divides it by 4 (a wrong sign or factor on S_R (theta - theta_ref) would
    leave a term linear in t)."""
    state, _ = build(sgd_mlp, digits)
    state.remove(digits.sample_ids[[1, 2, 3]].tolist())
    state.refresh(converge=False)
    torch.manual_seed(0)
    v = torch.randn(state.p, dtype=torch.float64)
    v /= v.norm()
    base = state.theta.clone()
    errors = []
    for t in (0.2, 0.1, 0.05):
        state.theta = base + t * v
        err = float(torch.linalg.vector_norm(state.exact_gradient() - state.tracked_gradient()))
        assert err <= state.drift_constant() * t * t
        errors.append(err)
    state.theta = base
    assert 3.5 <= errors[0] / errors[1] <= 4.5 and 3.5 <= errors[1] / errors[2] <= 4.5


def test_softmax_curvature_lipschitz_constant_holds():
    torch.manual_seed(1)
    for _ in range(200):
        z, u = torch.randn(6, dtype=torch.float64) * 3, torch.randn(6, dtype=torch.float64)
        m = [torch.diag(torch.softmax(a, 0)) - torch.outer(torch.softmax(a, 0), torch.softmax(a, 0)) for a in (z, z + u)]
        assert float(torch.linalg.matrix_norm(m[1] - m[0], ord=2)) <= 3.0 * float(u.norm())


def test_refresh_every_k_and_on_drift_and_records_the_path(sgd_mlp, digits):
    state, _ = build(sgd_mlp, digits, settings=StreamSettings(refresh_every=3, drift_threshold=float("inf")))
    ids = digits.sample_ids.tolist()
    paths = [state.remove([ids[j]]).path for j in range(7)]
    assert paths == ["fast", "fast", "refresh", "fast", "fast", "refresh", "fast"]
    tight, _ = build(sgd_mlp, digits, settings=StreamSettings(refresh_every=1000, drift_threshold=1e-12))
    step = tight.remove([ids[0]])
    assert step.path == "refresh" and step.reason == "drift" and step.refresh["converged"]
    assert step.gradient_error_bound > 1e-12 and step.drift == step.gradient_error_bound


def test_gradient_drift_measure_is_the_exact_residual_and_below_the_a_priori_bound(sgd_mlp, digits):
    state, _ = build(sgd_mlp, digits, settings=StreamSettings(refresh_every=1000, drift_threshold=1e-6,
                                                              drift_measure="gradient"))
    ids = digits.sample_ids.tolist()
    steps = [state.remove([ids[j]]) for j in range(0, 60, 6)]
    for step in steps:
        assert step.drift_measure == "gradient" and step.drift == step.residual_measured
        assert step.residual_measured <= step.gradient_error_bound
    assert {s.path for s in steps} == {"fast", "refresh"}  # the threshold was passed at some point
    fast = [s for s in steps if s.path == "fast"]
    assert all(s.residual_measured <= 1e-6 for s in fast)
    # a fast step leaves exactly the recorded residual
    last = state.remove([ids[70]])
    if last.path == "fast":
        exact = float(torch.linalg.vector_norm(state.exact_gradient() - state.anchor))
        assert abs(exact - last.residual_measured) <= 1e-12 + 1e-9 * exact


def test_bad_requests_name_the_field(sgd_mlp, digits):
    state, _ = build(sgd_mlp, digits)
    with pytest.raises(ValueError, match="sample_ids: sample id 999999 is not in the training set"):
        state.remove([999999])
    first = int(digits.sample_ids[0])
    state.remove([first])
    with pytest.raises(ValueError, match="already removed"):
        state.remove([first])
    with pytest.raises(ValueError, match="last Linear layer"):
        DecisionLayerStream.from_model(sgd_mlp, softmax_task(), digits, ["1.weight", "1.bias"], LAMBDA)
    with pytest.raises(ValueError, match="refresh_every must be >= 1"):
        StreamSettings(refresh_every=0)
