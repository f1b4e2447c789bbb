"""L-FOCI Newton on a small non-convex MLP (digits 64-32-10, tanh, weight decay 0.01),
judged in function space against the retrain warm-started on the retained data."""
from __future__ import annotations

import copy

import pytest
import torch

from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.models import build
from pipeline.training import fit_lbfgs, fit_newton
from tests.kit import digits64

LAMBDA = 0.01


def probabilities(model, x):
    with torch.no_grad():
        return torch.softmax(model(x), dim=1)


def fit_tight(model, task, data, warm: bool = False, lbfgs_steps: int = 0):
    """L-BFGS into the basin (when warm-started: ``lbfgs_steps`` steps), then damped Newton to 1e-10.

    Each Newton step builds the dense 2410 x 2410 Hessian (about 5 s on 2 cores). From scratch,
    L-BFGS asked for ||grad|| <= 1e-9 (it stalls at 6.8e-9 after 36 steps, about 7 s) leaves Newton 2
    steps, against 8 after L-BFGS to 1e-6: the same optimum (objective 0.5828533005025363 both ways,
    ||grad|| ~1e-12). Warm-started from
    the original optimum, Newton alone built 3 (m = 1), 4 (m = 10) and 7 (m = 50) Hessians. For m = 50,
    5 L-BFGS steps (||grad|| 1e-7 to 1e-6) leave it 2 (15 s in all). For m = 1, 20 L-BFGS steps (2 s) leave
    it one: 9 s against 23 s for Newton alone. Same criterion either way, and the same point: for m = 50
    the optimum found differs from Newton-alone's by at most 2.3e-9 per weight (5e-9 of the distance the
    removal moves it), for m = 1 by 1.9e-10 in norm, far below the bounds checked."""
    if not warm:
        fit_lbfgs(model, task, data, LAMBDA, tolerance=1e-9, max_steps=1000)
    elif lbfgs_steps:
        fit_lbfgs(model, task, data, LAMBDA, tolerance=1e-10, max_steps=lbfgs_steps)
    report = fit_newton(model, task, data, LAMBDA, tolerance=1e-10, max_steps=30)
    assert report.gradient_norm <= 1e-9, report
    return model


def forget_draw(n: int, m: int, draw: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(31 * draw + m))[:m]


@pytest.fixture(scope="module")
def mlp_digits():
    data = digits64()["train"]
    torch.manual_seed(0)
    model, task = build("mlp", {"in_features": 64, "hidden": [32], "num_classes": 10, "activation": "tanh"})
    return fit_tight(model.double(), task, data), task, data


# Share of the way from the original model's predictions to the retrain's that the removal may
# leave. One Newton step (the old default) left up to 10.8% here (m = 50: the retained Hessian is
# close to singular, smallest eigenvalue 1.1e-4 against lambda = 0.01, so the third-order terms a
# single step ignores weigh more). The converged block Newton (fresh gradient and curvature each
# step, until the retained gradient is 1e-6 of its start) measured 1.8e-7 / 4.5e-7 (m = 1),
# 1.0e-7 / 4.1e-7 (m = 10) on the forget set / all samples: bound 1e-3 (a wrong sign gives ~200%).
# m = 50 keeps the one-step bound of 12% until measured with the converged steps (its slow
# retained-Hessian spectrum may need more than the default 3 steps).
# Tighter would test the oracle rather than the method: the warm-started retrain stops at
# ||grad|| <= 1e-10 and the removal at 1e-6 of its start gradient; bounding at ~1e-6 would need
# both tolerances tightened to ~1e-12 and float64 sums that agree across BLAS builds.
# (m = 10 was measured at the same bound as m = 1 and is no longer run: the two ends keep the claim.)
BOUNDS = {1: 1e-3, 50: 0.12}
GRADIENT_LEFT = {1: 1e-3, 50: 0.1}


@pytest.mark.parametrize("m", sorted(BOUNDS))
def test_mlp_newton_step_moves_predictions_to_retrain(mlp_digits, m):
    model, task, data = mlp_digits
    positions = forget_draw(len(data), m, draw=0)
    work = copy.deepcopy(model)
    method = get_method("lfoci-newton")
    out = method.run(RemovalProblem(work, task, data, positions, LAMBDA, seed=1), method.Settings(selection="all"))
    # The retained Hessian H' of these draws is positive definite (checked, not assumed), and the
    # converged block Newton reached its tolerance.
    assert out.record["curvature"]["solvers"][0]["positive_definite"], out.record["curvature"]
    norms = out.record["gradient_norms"]
    # m = 50 (near-singular H'): 3 steps left 3.5% of the retained gradient (measured 3.8e-4 / 1.1e-2)
    assert norms["retain_mean_block_after"] <= GRADIENT_LEFT[m] * norms["retain_mean_block_before"], out.record["newton"]
    oracle = fit_tight(copy.deepcopy(model), task, data.without(positions), warm=True,
                       lbfgs_steps=5 if m >= 50 else 20)
    x_all, x_forget = data.columns["x"], data.columns["x"][positions]
    for x in (x_forget, x_all):
        p0, p1, pr = probabilities(model, x), probabilities(work, x), probabilities(oracle, x)
        moved = float(torch.linalg.vector_norm(pr - p0))
        residual = float(torch.linalg.vector_norm(p1 - pr))
        assert moved > 0
        assert residual <= BOUNDS[m] * moved, (m, residual / moved)


def test_mlp_indefinite_retained_hessian_is_damped_and_recorded(mlp_digits):
    """Non-convex: removing 50 samples can leave H' = (n H - sum_U H_z)/(n - m) with a
    slightly negative eigenvalue (here about -6e-5 against lambda = 0.01). The solve adds
    Levenberg-Marquardt damping (recorded: never a silent fix), solves the damped system to
    its tolerance, and the converged steps still drive the retained gradient to ~0."""
    model, task, data = mlp_digits
    work = copy.deepcopy(model)
    method = get_method("lfoci-newton")
    out = method.run(RemovalProblem(work, task, data, forget_draw(len(data), 50, draw=1), LAMBDA, seed=1),
                     method.Settings(selection="all", small_block_solver="dense"))
    rec = out.record
    first = rec["curvature"]["solvers"][0]
    assert first["positive_definite"] is False and first["min_eigenvalue"] < 0
    assert first["solver"] == "cholesky" and first["damping"] > -first["min_eigenvalue"]
    assert first["relative_residual"] <= method.Settings().dense_rtol
    assert any("Levenberg-Marquardt" in note for note in first["notes"])
    assert rec["curvature"]["damping_used"] >= first["damping"] > 0
    norms = rec["gradient_norms"]
    # damped steps on an indefinite block converge slower: measured 0.109 of the start after the
    # default 3 steps; 0.25 keeps a 2x margin (the method itself refuses anything above 0.5)
    assert norms["retain_mean_block_after"] <= 0.25 * norms["retain_mean_block_before"]
    # small_block_solver auto tries CG first. On this system CG needs 611 products with its damping
    # restarts (measured; the default cap is a quarter of the 2,410 columns, 602: too close to assert
    # on), so it is held to 50 here: the system goes to the dense solve, which says why, and the
    # removal's later systems go dense at once (two Newton steps show it: 14 s against 23 s for the default
    # three; they left 0.023 of the retained gradient, the three 0.109)
    work = copy.deepcopy(model)
    out = method.run(RemovalProblem(work, task, data, forget_draw(len(data), 50, draw=1), LAMBDA, seed=1),
                     method.Settings(selection="all", cg_max_iter=50, newton_max_steps=2))
    first, *later = out.record["curvature"]["solvers"]
    assert first["solver"] == "cholesky" and first["relative_residual"] <= method.Settings().dense_rtol
    assert any("CG did not reach cg_rtol 1.0e-10 within 50 products" in note and "solved densely" in note
               for note in first["notes"])
    assert later and all(s["solver"] == "cholesky" and not any("CG" in note for note in s["notes"]) for s in later)
    norms = out.record["gradient_norms"]
    assert norms["retain_mean_block_after"] <= 0.25 * norms["retain_mean_block_before"]


def test_cg_first_products_are_capped_across_every_damping_restart():
    """One product budget for the whole CG-first solve: the wrapper that counts them is handed to
    the damped CG once, so its restarts draw on the same count; the (cap + 1)-th product raises."""
    from pipeline.curvature import CappedProducts, DenseOperator, ProductsSpent

    capped = CappedProducts(DenseOperator(torch.eye(4, dtype=torch.float64)), cap=3)
    v = torch.ones(4, dtype=torch.float64)
    for _ in range(3):
        assert torch.equal(capped.matvec(v), v)
    with pytest.raises(ProductsSpent):
        capped.matvec(v)
    assert capped.products == 4


def _retained_objective_and_gradient(model, task, data, rows):
    """L_{D\\U}(w) and the norm of its gradient restricted to ``rows`` ({parameter: rows}), by
    plain autograd (independent of pipeline.curvature)."""
    x = data.columns["x"]
    params = [p for p in model.parameters()]
    loss = task.per_sample_loss(model(x), data.columns).mean() + 0.5 * LAMBDA * sum((p * p).sum() for p in params)
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, params)))
    sq = 0.0
    for name, r in rows.items():
        g = grads[name]
        sq += float(g.pow(2).sum() if r is None else g[torch.as_tensor(r)].pow(2).sum())
    return float(loss.detach()), sq ** 0.5


def test_mlp_lfoci_block_converges_on_its_rows_and_moves_nothing_else(mlp_digits):
    """L-FOCI picks + the output layer + forget-gradient additions form the block; the
    converged block Newton must (a) change only the block's rows, (b) reach a stationary point
    of the retained objective on the block (gradient measured here by plain autograd: a wrong
    sign or a missing 1/(n - m) leaves it large), (c) lower the retained objective and raise the
    forget loss."""
    model, task, data = mlp_digits
    positions = torch.arange(0, 400, 20)  # 20 samples
    work = copy.deepcopy(model)
    method = get_method("lfoci-newton")
    settings = method.Settings(selection="lfoci", perturbations=200, pass_size=50, perturb_sigma=0.1, max_slices=8)
    outcome = method.run(RemovalProblem(work, task, data, positions, LAMBDA, seed=5), settings)
    rec = outcome.record
    selection = rec["selection"]
    assert 1 <= len(selection["selected"]) <= 8
    assert selection["output_layer"] == "3"
    assert selection["forget_gradient_share"] >= 0.5
    rows = {part["parameter"]: part["rows"] for part in rec["block"]["parts"]}
    assert rows["3.weight"] is None and rows["3.bias"] is None  # the whole output layer
    for s in selection["selected"]:
        assert s["unit"] in (rows.get(s["weight"]) or [])
    before, after = dict(model.named_parameters()), dict(work.named_parameters())
    for name, p0 in before.items():
        changed = (after[name] != p0).reshape(p0.shape[0], -1).any(dim=1)
        changed_rows = set(torch.nonzero(changed).flatten().tolist())
        allowed = set(range(p0.shape[0])) if rows.get(name, []) is None else set(rows.get(name, []))
        assert changed_rows <= allowed, (name, changed_rows, allowed)
    retain, forget = data.without(positions), data.take(positions)
    f0, g0 = _retained_objective_and_gradient(model, task, retain, rows)
    f1, g1 = _retained_objective_and_gradient(work, task, retain, rows)
    assert g0 > 1e-4  # there was something to remove
    assert g1 <= 1e-5 * g0, (g0, g1)
    assert f1 < f0
    assert rec["gradient_norms"]["retain_mean_block_after"] == pytest.approx(g1, rel=1e-6, abs=1e-12)
    with torch.no_grad():
        loss0 = task.per_sample_loss(model(forget.columns["x"]), forget.columns).mean()
        loss1 = task.per_sample_loss(work(forget.columns["x"]), forget.columns).mean()
    assert loss1 > loss0


def test_small_autograd_block_is_solved_by_cg_when_that_is_cheaper_and_densely_when_not(mlp_digits):
    """small_block_solver auto: a 2,410-entry block whose curvature is Hessian-vector products
    through the MLP is solved by CG within a quarter of its columns where CG reaches cg_rtol
    (the same Newton step as the dense solve, far fewer products), and densely, with the reason
    recorded, where it does not."""
    model, task, data = mlp_digits
    method = get_method("lfoci-newton")
    forget = forget_draw(len(data), 10, draw=0)

    def removal(**settings):
        work = copy.deepcopy(model)
        out = method.run(RemovalProblem(work, task, data, forget, LAMBDA, seed=1),
                         method.Settings(selection="all", cg_rtol=1e-9, newton_max_steps=1, **settings))
        return work, out.record["curvature"]["solvers"]

    dense, dense_solvers = removal(small_block_solver="dense")
    by_cg, cg_solvers = removal()
    assert {s["solver"] for s in dense_solvers} == {"cholesky"}
    assert cg_solvers[0]["solver"] == "cg" and cg_solvers[0]["iterations"] <= 2410 // 4
    assert any("CG instead of materialising the 2410 x 2410 block" in note for note in cg_solvers[0]["notes"])
    x = data.columns["x"]
    moved = float(torch.linalg.vector_norm(probabilities(dense, x) - probabilities(model, x)))
    assert moved > 0
    assert float(torch.linalg.vector_norm(probabilities(by_cg, x) - probabilities(dense, x))) <= 1e-4 * moved
    _, capped = removal(cg_max_iter=2)
    assert capped[0]["solver"] == "cholesky"
    assert any("CG did not reach cg_rtol 1.0e-09 within 2 products" in note for note in capped[0]["notes"])
