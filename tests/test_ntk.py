"""NTK scrubbing against two direct ridge solves in float64 (shared/REFERENCE.md sections 3, 5)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from pipeline.data import SampleSet
from pipeline.linearized import LinearizedModel
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.methods.ntk_scrub import RESIDUALS, build_system, trapezium_scale
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs
from tests.kit import digits64
from tests.scrub_helpers import one_thread, rel  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 1e-3


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def oracle_jacobian(model: nn.Module, x: torch.Tensor, w0: dict) -> torch.Tensor:
    """J0 of all outputs w.r.t. all parameters at w0, (N K) x p, independently of the library."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    w = torch.cat([w0[n].reshape(-1) for n in names])

    def f(flat):
        parts = dict(zip(names, (t.reshape(s) for t, s in zip(torch.split(flat, sizes), shapes))))
        return functional_call(model, parts, (x,)).reshape(-1)

    return jacrev(f)(w)


def ridge_displacement(jac: torch.Tensor, r0: torch.Tensor, c: float) -> torch.Tensor:
    """w_lin(S) - w0 = -(J^T J + c I)^{-1} J^T r0 (the primal form: a p x p solve)."""
    a = jac.T @ jac + c * torch.eye(jac.shape[1], dtype=jac.dtype)
    return -torch.linalg.solve(a, jac.T @ r0)


def rows(n_samples: int, k: int, positions: torch.Tensor) -> torch.Tensor:
    return (positions.unsqueeze(1) * k + torch.arange(k)).reshape(-1)


@pytest.fixture(scope="module")
def mlp_case():
    """An MLP with 2,203 parameters, 300 samples, 3 outputs (MSE), w0 = its initialisation."""
    torch.manual_seed(0)
    n, d, k = 300, 10, 3
    x = torch.randn(n, d, dtype=torch.float64)
    y = torch.stack([torch.sin(x[:, 0]) + x[:, 1] * x[:, 2], torch.tanh(x[:, 3:6].sum(1)), x[:, 6] ** 2], 1)
    y = y + 0.1 * torch.randn(n, k, dtype=torch.float64)
    data = SampleSet({"x": x, "y": y}, torch.arange(n))
    model = nn.Sequential(nn.Linear(d, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, k)).double()
    w0 = {name: p.detach().clone() for name, p in model.named_parameters()}
    task = DenseInputTask(loss="mse")
    trained = copy.deepcopy(model)
    fit_lbfgs(trained, task, data, LAMBDA, max_steps=15, tolerance=1e-8)
    forget = torch.arange(0, n, 10)  # m = 30
    return model, trained, task, data, w0, forget


def oracle_delta(model, data, w0, forget, c, residual) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_lin(Dr) - w_lin(D), w_lin(Dr) - w0) by two direct ridge solves."""
    x = data.columns["x"]
    with torch.no_grad():
        f0 = functional_call(model, w0, (x,))
    r0 = residual(f0, data.columns["y"]).reshape(-1)
    jac = oracle_jacobian(model, x, w0)
    k = f0.shape[1]
    keep = torch.ones(len(data), dtype=torch.bool)
    keep[forget] = False
    retain_rows = rows(len(data), k, torch.nonzero(keep).flatten())
    d_all = ridge_displacement(jac, r0, c)
    d_retain = ridge_displacement(jac[retain_rows], r0[retain_rows], c)
    return d_retain - d_all, d_retain


@pytest.mark.parametrize("kernel", ["jacobian", "jvp"])
def test_delta_equals_difference_of_two_ridge_solves(mlp_case, kernel):
    model, _, task, data, w0, forget = mlp_case
    assert sum(p.numel() for p in model.parameters()) == 2203
    c = len(data) * 3 * LAMBDA / 2
    lin = LinearizedModel(model, task, ParamBlock.all_parameters(model), base=w0)
    system, used = build_system(lin, data.without(forget), data.take(forget), ridge=c,
                               residual=RESIDUALS["mse"], kernel=kernel, chunk=50)
    assert used == kernel
    expected, d_retain = oracle_delta(model, data, w0, forget, c, RESIDUALS["mse"])
    delta = system.delta()
    assert rel(delta, expected) <= 1e-8
    assert rel(system.retain_displacement(), d_retain) <= 1e-8
    # The opposite sign convention for V, (f0(Df) - Yf) + Theta_rf^T Theta_rr^-1 (f0(Dr) - Yr), fails.
    flipped = system.r_forget + system.theta_rf.T @ system.solve_rr(system.r_retain)
    assert rel(system.delta(flipped), expected) > 0.1
    assert rel(system.delta(-system.v()), expected) > 1.0


def test_linear_model_scrub_equals_retraining():
    """A model linear in its parameters, trained to w_lin(D): w(D) + delta_w is the model
    retrained on Dr (same ridge c = n K lambda / 2, regularised towards w0)."""
    data = digits64()["train"].take(torch.arange(400))
    onehot = nn.functional.one_hot(data.columns["y"], 10).double()
    data = SampleSet({"x": data.columns["x"], "y": onehot}, data.sample_ids)
    torch.manual_seed(3)
    model = nn.Linear(64, 10).double()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    task = DenseInputTask(loss="mse")
    forget = torch.arange(5, 400, 9)
    c = 400 * 10 * LAMBDA / 2
    jac = oracle_jacobian(model, data.columns["x"], w0)
    with torch.no_grad():
        f0 = model(data.columns["x"])
    block = ParamBlock.all_parameters(model)
    w0_flat = block.gather(w0)
    w_d = w0_flat + ridge_displacement(jac, (f0 - onehot).reshape(-1), c)
    block.add_to_model(model, w_d - w0_flat)  # the trained model w(D) = w_lin(D)
    _, d_retain = oracle_delta(model, data, w0, forget, c, RESIDUALS["mse"])

    method = get_method("ntk")
    problem = RemovalProblem(model, task, data, forget, LAMBDA, extras={"w0": w0})
    outcome = method.run(problem, method.Settings(rescale="none"))
    assert outcome.record["ridge"]["c"] == pytest.approx(c)
    assert rel(block.gather(dict(model.named_parameters())).detach(), w0_flat + d_retain) <= 1e-8


def test_trapezium_scale_is_the_formula(mlp_case):
    model, trained, task, data, w0, forget = mlp_case
    c = len(data) * 3 * LAMBDA / 2
    delta, d_retain = oracle_delta(model, data, w0, forget, c, RESIDUALS["mse"])
    work = copy.deepcopy(trained)
    method = get_method("ntk")
    problem = RemovalProblem(work, task, data, forget, LAMBDA, extras={"w0": w0})
    outcome = method.run(problem, method.Settings())
    w_d = flat_params(trained)
    e = w_d - (flat_params(model) + d_retain)  # w(D) - w_lin(Dr); model holds w0
    cos = float(delta @ e) / float(torch.linalg.vector_norm(delta) * torch.linalg.vector_norm(e))
    formula = 1 + 2 * float(torch.linalg.vector_norm(e)) * abs(cos) / float(torch.linalg.vector_norm(delta))
    assert outcome.record["scale"] == pytest.approx(formula, rel=1e-8)
    assert trapezium_scale(delta, e) == pytest.approx(formula, rel=1e-12)
    assert outcome.record["scale"] > 1.0
    assert rel(flat_params(work) - w_d, formula * delta) <= 1e-8


@pytest.mark.parametrize("variant", ["softmax", "logits"])
def test_cross_entropy_variant(variant):
    """Identity output Hessian (c = n lambda), one-hot targets; residual softmax(f0) - onehot
    or f0 - onehot. The scrub equals the difference of the two ridge solves of that problem."""
    data = digits64()["train"].take(torch.arange(150))
    torch.manual_seed(2)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    task = DenseInputTask(loss="cross_entropy")
    trained = copy.deepcopy(model)
    fit_lbfgs(trained, task, data, LAMBDA, max_steps=10, tolerance=1e-8)
    forget = torch.arange(0, 150, 15)
    expected, _ = oracle_delta(model, data, w0, forget, 150 * LAMBDA, RESIDUALS[f"cross_entropy/{variant}"])
    method = get_method("ntk")
    problem = RemovalProblem(trained, task, data, forget, LAMBDA, extras={"w0": w0})
    before = flat_params(trained)
    outcome = method.run(problem, method.Settings(ce_residual=variant, rescale="none"))
    assert outcome.record["ridge"]["c"] == pytest.approx(150 * LAMBDA)
    assert rel(flat_params(trained) - before, expected) <= 1e-8


def test_missing_pretraining_weights_is_a_clear_error(mlp_case):
    _, trained, task, data, _, forget = mlp_case
    method = get_method("ntk")
    with pytest.raises(ValueError, match="pre-training weights w0"):
        method.run(RemovalProblem(copy.deepcopy(trained), task, data, forget, LAMBDA), method.Settings())


def test_yaml_mirrors_settings_and_record_is_json(mlp_case):
    import json

    from tests.scrub_helpers import assert_yaml_mirrors_settings

    assert_yaml_mirrors_settings("ntk")
    model, trained, task, data, w0, forget = mlp_case
    problem = RemovalProblem(copy.deepcopy(trained), task, data, forget[:3], LAMBDA, extras={"w0": w0})
    json.dumps(get_method("ntk").run(problem, get_method("ntk").Settings()).record)


def test_parameter_subset_linearises_the_block_at_w0(mlp_case):
    """parameters=[last layer]: J0 w.r.t. the block at (w0 on the block, w(D) elsewhere)."""
    model, trained, task, data, w0, forget = mlp_case
    names = ["4.weight", "4.bias"]
    point = {n: (w0[n] if n in names else p.detach()) for n, p in trained.named_parameters()}
    c = len(data) * 3 * LAMBDA / 2
    x = data.columns["x"]
    jac = oracle_jacobian(trained, x, point)[:, -123:]  # the last layer's 40*3 + 3 columns
    with torch.no_grad():
        r0 = (functional_call(trained, point, (x,)) - data.columns["y"]).reshape(-1)
    keep = torch.ones(len(data), dtype=torch.bool)
    keep[forget] = False
    rr = rows(len(data), 3, torch.nonzero(keep).flatten())
    expected = ridge_displacement(jac[rr], r0[rr], c) - ridge_displacement(jac, r0, c)
    work = copy.deepcopy(trained)
    problem = RemovalProblem(work, task, data, forget, LAMBDA, extras={"w0": w0})
    outcome = get_method("ntk").run(problem, get_method("ntk").Settings(parameters=names, rescale="none"))
    assert outcome.record["block"]["numel"] == 123
    assert torch.equal(work[0].weight, trained[0].weight)
    moved = torch.cat([(work[4].weight - trained[4].weight).reshape(-1), work[4].bias - trained[4].bias]).detach()
    assert rel(moved, expected) <= 1e-8
