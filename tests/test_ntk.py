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
from pipeline.methods.ntk_scrub import RESIDUALS, PretrainingWeights, build_primal_system, build_system, trapezium_scale
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs
from tests.kit import digits64
from tests.scrub_helpers import one_thread, rel  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 1e-3


def run_at(problem: RemovalProblem, w0: dict, **settings):
    """The NTK scrub linearised at ``w0``, handed to the method as its prepared state (the state its
    ``prepare`` makes from a w0_path or the model card's recipe)."""
    method = get_method("ntk")
    parsed = method.Settings(**settings)
    prepared = PretrainingWeights(method.binding(problem.trained, parsed), w0=w0)
    return method.run(problem, parsed, prepared)


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


def ridge_displacement(jac: torch.Tensor, r0: torch.Tensor, c: float, w0: torch.Tensor | None = None) -> torch.Tensor:
    """u = w_lin(S) - w0 = argmin_u ||r0 + J u||^2 + c ||w0 + u - a||^2 by the primal normal
    equations (a p x p solve): (J^T J + c I) u = -(J^T r0 + c (w0 - a)). ``w0`` given: decay
    towards a = 0; None: proximal, a = w0."""
    a = jac.T @ jac + c * torch.eye(jac.shape[1], dtype=jac.dtype)
    rhs = jac.T @ r0 + (c * w0 if w0 is not None else 0.0)
    return -torch.linalg.solve(a, rhs)


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


def oracle_delta(model, data, w0, forget, c, residual, decay: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_lin(Dr) - w_lin(D), w_lin(Dr) - w0) by two direct ridge solves (``decay``: ridge
    towards 0, else towards w0)."""
    x = data.columns["x"]
    with torch.no_grad():
        f0 = functional_call(model, w0, (x,))
    r0 = residual(f0, data.columns["y"]).reshape(-1)
    jac = oracle_jacobian(model, x, w0)
    k = f0.shape[1]
    keep = torch.ones(len(data), dtype=torch.bool)
    keep[forget] = False
    retain_rows = rows(len(data), k, torch.nonzero(keep).flatten())
    w0_flat = torch.cat([w0[n].reshape(-1) for n, _ in model.named_parameters()]) if decay else None
    d_all = ridge_displacement(jac, r0, c, w0_flat)
    d_retain = ridge_displacement(jac[retain_rows], r0[retain_rows], c, w0_flat)
    return d_retain - d_all, d_retain


@pytest.fixture(scope="module")
def mlp_oracle(mlp_case):
    """oracle_delta on mlp_case with the MSE residual, ``decay`` -> (delta, d_retain); each
    computed once per module (the three kernel cases share the proximal one)."""
    model, _, _, data, w0, forget = mlp_case
    c = len(data) * 3 * LAMBDA / 2
    solved: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(decay: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if decay not in solved:
            solved[decay] = oracle_delta(model, data, w0, forget, c, RESIDUALS["mse"], decay=decay)
        return solved[decay]

    return get


@pytest.mark.parametrize("kernel,decay", [("jacobian", False), ("jvp", False), ("jacobian", True)])
def test_delta_equals_difference_of_two_ridge_solves(mlp_case, mlp_oracle, kernel, decay):
    model, _, task, data, w0, forget = mlp_case
    assert sum(p.numel() for p in model.parameters()) == 2203
    c = len(data) * 3 * LAMBDA / 2
    block = ParamBlock.all_parameters(model)
    lin = LinearizedModel(model, task, block, base=w0)
    offset = -block.gather(w0) if decay else None
    system, used = build_system(lin, data.without(forget), data.take(forget), ridge=c,
                               residual=RESIDUALS["mse"], kernel=kernel, chunk=50, offset=offset)
    assert used == kernel
    expected, d_retain = mlp_oracle(decay)
    if decay:  # the centre matters: the proximal solve's answer is far from the decay one
        assert rel(mlp_oracle(False)[0], expected) > 0.05
    delta = system.delta()
    assert rel(delta, expected) <= 1e-8
    assert rel(system.retain_displacement(), d_retain) <= 1e-8
    # The opposite sign convention for V, (f0(Df) - Yf) + Theta_rf^T Theta_rr^-1 (f0(Dr) - Yr), fails.
    flipped = system.r_forget + system.theta_rf.T @ system.solve_rr(system.r_retain)
    assert rel(system.delta(flipped), expected) > 0.1
    assert rel(system.delta(-system.v()), expected) > 1.0


def _closed_form_ridge(x: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """[W, b] flat minimising (1/(N K)) sum ||W x + b - y||^2 + (lambda/2)(||W||^2 + ||b||^2),
    from its normal equations (independent of the library)."""
    n, k = y.shape
    xa = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)
    a = 2.0 / (n * k) * xa.T @ xa + lam * torch.eye(xa.shape[1], dtype=x.dtype)
    theta = torch.linalg.solve(a, 2.0 / (n * k) * xa.T @ y)  # (d + 1) x k
    return torch.cat([theta[:-1].T.reshape(-1), theta[-1]])


@pytest.mark.parametrize("form", ["kernel", "primal"])
def test_linear_model_default_scrub_is_the_retrained_optimum(form):
    """A model linear in w (MSE), trained to the exact optimum of its weight-decayed objective:
    the linearisation is exact, w(D) = w_lin(D), the trapezium leg e = w(D) - w_lin(D) is 0 and
    the factor is 1; the default scrub (decay regulariser, trapezium) lands on the optimum
    retrained on Dr (same ridge c, i.e. decay lambda n / (n - m) in the mean convention). The
    old leg w(D) - w_lin(Dr) gave factor 3, the proximal ridge another answer: both fail here."""
    data = digits64()["train"].take(torch.arange(400))
    onehot = nn.functional.one_hot(data.columns["y"], 10).double()
    x = data.columns["x"].reshape(400, -1).double()
    data = SampleSet({"x": x, "y": onehot}, data.sample_ids)
    torch.manual_seed(3)
    model = nn.Linear(64, 10).double()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}  # the "pre-training" point
    lam, n, m = 0.01, 400, 44
    forget = torch.arange(5, 400, 9)
    assert forget.numel() == m
    w_d = _closed_form_ridge(x, onehot, lam)
    block = ParamBlock.all_parameters(model)
    block.add_to_model(model, w_d - block.gather(w0))  # the trained model w(D)
    keep = torch.ones(n, dtype=torch.bool)
    keep[forget] = False
    w_retrained = _closed_form_ridge(x[keep], onehot[keep], lam * n / (n - m))

    problem = RemovalProblem(model, DenseInputTask(loss="mse"), data, forget, lam)
    outcome = run_at(problem, w0, form=form)
    rec = outcome.record
    assert rec["form"] == form
    assert rec["ridge"]["c"] == pytest.approx(n * 10 * lam / 2) and rec["ridge"]["regulariser"] == "decay"
    assert rec["norms"]["e"] <= 1e-6 * rec["norms"]["delta_w"]
    assert rec["scale"] == pytest.approx(1.0, abs=1e-6)
    scrubbed = block.gather(dict(model.named_parameters())).detach()
    assert rel(scrubbed - w_d, w_retrained - w_d) <= 1e-6  # the step itself is right, to 1e-6 of its size
    assert rel(w_retrained, w_d) > 1e-3  # the removal mattered
    assert rec["release"]["guarantee"] == "none" and outcome.release.guarantee.value == "none"


def test_trapezium_scale_hand_values():
    """1 + 2 |<delta, e>| / ||delta||^2 on hand-computed cases."""
    d = torch.tensor([2.0, 0.0], dtype=torch.float64)
    assert trapezium_scale(d, torch.tensor([1.0, 5.0], dtype=torch.float64)) == pytest.approx(1 + 2 * 2 / 4)
    assert trapezium_scale(d, torch.tensor([-3.0, 1.0], dtype=torch.float64)) == pytest.approx(1 + 2 * 6 / 4)
    assert trapezium_scale(d, torch.tensor([0.0, 7.0], dtype=torch.float64)) == 1.0
    assert trapezium_scale(d, -d) == pytest.approx(3.0)  # the old leg on a linear model


@pytest.mark.parametrize("variant,regulariser,form", [("softmax", "proximal", "kernel"), ("logits", "proximal", "kernel"),
                                                      ("softmax", "decay", "kernel"), ("softmax", "decay", "primal")])
def test_cross_entropy_variant(variant, regulariser, form):
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
    expected, _ = oracle_delta(model, data, w0, forget, 150 * LAMBDA, RESIDUALS[f"cross_entropy/{variant}"],
                               decay=regulariser == "decay")
    method = get_method("ntk")
    problem = RemovalProblem(trained, task, data, forget, LAMBDA)
    before = flat_params(trained)
    outcome = run_at(problem, w0, ce_residual=variant, rescale="none", regulariser=regulariser, form=form)
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
    problem = RemovalProblem(copy.deepcopy(trained), task, data, forget[:3], LAMBDA)
    json.dumps(run_at(problem, w0).record)


@pytest.mark.parametrize("form", ["kernel", "primal"])
def test_parameter_subset_linearises_the_block_at_w0(mlp_case, form):
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
    problem = RemovalProblem(work, task, data, forget, LAMBDA)
    outcome = run_at(problem, w0, parameters=names, rescale="none", form=form, regulariser="proximal")
    assert outcome.record["block"]["numel"] == 123
    assert torch.equal(work[0].weight, trained[0].weight)
    moved = torch.cat([(work[4].weight - trained[4].weight).reshape(-1), work[4].bias - trained[4].bias]).detach()
    assert rel(moved, expected) <= 1e-8


@pytest.mark.parametrize("decay", [False, True])
def test_primal_form_equals_the_two_ridge_solves(mlp_case, mlp_oracle, decay):
    """The weight-space system (J0^T J0 + cI) of all 2,203 parameters (Jacobian chunks) gives the
    same w_lin(Dr) - w0 and delta_w as the oracle's two direct solves; dropping the ridge's centre
    (decay) or the forgotten part of G_D does not."""
    model, _, task, data, w0, forget = mlp_case
    c = len(data) * 3 * LAMBDA / 2
    block = ParamBlock.all_parameters(model)
    lin = LinearizedModel(model, task, block, base=w0)
    offset = -block.gather(w0) if decay else None
    system = build_primal_system(lin, data.without(forget), data.take(forget), ridge=c, residual=RESIDUALS["mse"],
                                 chunk=50, offset=offset)
    assert system.form == "primal-jacobian" and system.size == 2203
    expected, d_retain = mlp_oracle(decay)
    d_all = system.data_displacement()
    assert rel(system.retain_displacement(), d_retain) <= 1e-8
    assert rel(system.retain_displacement() - d_all, expected) <= 1e-8
    system.gram_forget = torch.zeros_like(system.gram_forget)  # G_D taken as G_Dr: a wrong system
    assert rel(system.retain_displacement() - system.data_displacement(), expected) > 0.01


@pytest.mark.parametrize("decay", [False, True])
def test_primal_kronecker_form_of_the_output_layer(mlp_case, decay):
    """Block = the output Linear (40 x 3 + 3): J0 = I_K (x) x~^T, so the system is 41 x 41 over
    the hidden features; it equals the direct ridge solves on the oracle Jacobian's last 123
    columns, in the block's flat order (weight rows, then the bias)."""
    model, trained, task, data, w0, forget = mlp_case
    names = ["4.weight", "4.bias"]
    point = {n: (w0[n] if n in names else p.detach()) for n, p in trained.named_parameters()}
    c = len(data) * 3 * LAMBDA / 2
    x = data.columns["x"]
    jac = oracle_jacobian(trained, x, point)[:, -123:]
    with torch.no_grad():
        r0 = (functional_call(trained, point, (x,)) - data.columns["y"]).reshape(-1)
    keep = torch.ones(len(data), dtype=torch.bool)
    keep[forget] = False
    rr = rows(len(data), 3, torch.nonzero(keep).flatten())
    w0_flat = torch.cat([w0["4.weight"].reshape(-1), w0["4.bias"]]) if decay else None
    d_all = ridge_displacement(jac, r0, c, w0_flat)
    d_retain = ridge_displacement(jac[rr], r0[rr], c, w0_flat)
    block = ParamBlock.from_rows(trained, {name: None for name in names})
    lin = LinearizedModel(trained, task, block, base={n: w0[n] for n in names})
    system = build_primal_system(lin, data.without(forget), data.take(forget), ridge=c, residual=RESIDUALS["mse"],
                                 offset=-block.gather(w0) if decay else None)
    assert system.form == "primal-kronecker" and system.size == 41
    assert rel(system.retain_displacement(), d_retain) <= 1e-9
    assert rel(system.data_displacement(), d_all) <= 1e-9
    assert rel(system.retain_displacement() - system.data_displacement(), d_retain - d_all) <= 1e-8


def test_a_system_above_max_system_is_refused_with_the_fix(mlp_case):
    model, trained, task, data, w0, forget = mlp_case
    method = get_method("ntk")
    problem = RemovalProblem(copy.deepcopy(trained), task, data, forget, LAMBDA)
    with pytest.raises(ValueError, match=r"kernel form\) would factor a 900 x 900 system.*max_system"):
        run_at(problem, w0, max_system=500)
    assert torch.equal(flat_params(problem.model), flat_params(trained))  # nothing changed


def test_auto_form_picks_the_smaller_system():
    """auto: primal when its system ((d+1) for an output Linear block, |P| otherwise) is smaller
    than the kernel form's N K, else kernel."""
    from pipeline.methods.ntk_scrub import choose_form
    from pipeline.methods.mixed_linear import user_block

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    task = DenseInputTask(loss="cross_entropy")
    head = LinearizedModel(model, task, user_block(model, last_modules=1))  # d + 1 = 17
    assert choose_form(head, 100, 10, "auto") == "primal"  # 17 < 1,000
    assert choose_form(head, 1, 10, "auto") == "kernel"  # 10 < 17
    both = LinearizedModel(model, task, user_block(model, last_modules=2))  # |P| = 1,210
    assert choose_form(both, 100, 10, "auto") == "kernel"  # 1,000 < 1,210
    assert choose_form(both, 200, 10, "auto") == "primal"
    assert choose_form(both, 200, 10, "kernel") == "kernel"
