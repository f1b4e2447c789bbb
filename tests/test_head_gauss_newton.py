"""The head's Gauss-Newton step (pipeline.curvature.gauss_newton) against dense oracles: the GGN
products against J^T M J from explicit Jacobians, the EK-FAC diagonal against per-sample
projections, the step against a dense solve and, on a single Linear layer (where the GGN is the
Hessian), against the retrained optimum; then the step inside the head-gauss-newton method."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from pipeline.curvature.gauss_newton import HeadCurvature, HeadGaussNewton, gauss_newton_step, head_layout
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem, TrainedModel, prepare
from pipeline.tasks import DenseInputTask
from tests.kit import digits64, newton_fit, newton_retrained, sgd_mlp_head

LAMBDA = 0.01


@pytest.fixture(scope="module")
def head():
    data = digits64()["train"]
    return sgd_mlp_head(data, seed=0, epochs=3, weight_decay=LAMBDA), DenseInputTask(), data


def dense_ggn(model: nn.Module, task, data, layout) -> torch.Tensor:
    """sum_z J_z^T (diag p - p p^T) J_z on the layout, from explicit Jacobians (float64)."""
    names = layout.parameter_names()
    base = {k: v.detach() for k, v in model.named_parameters()}
    x = data.columns["x"]

    def logits(flat):
        return functional_call(model, {**base, **layout.to_parameters(flat, torch.float64)}, (x,))

    w = layout.flatten(base)
    jac = jacrev(logits)(w)                        # (n, K, P)
    p = torch.softmax(logits(w).detach(), 1)
    m = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    assert set(names) == set(base)
    return torch.einsum("nkp,nkl,nlq->pq", jac, m, jac)


def test_ggn_products_equal_dense_jacobian_form(head):
    model, task, data = head
    layout = head_layout(model, task)
    rows = data.take(torch.arange(200))
    dense = dense_ggn(model, task, rows, layout)
    op = HeadGaussNewton(model, task, rows, layout, divisor=150.0, ridge=0.3, batch_size=64)  # 4 chunks
    v = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expect = dense @ v / 150.0 + 0.3 * v
    assert torch.allclose(op.matvec(v), expect, rtol=1e-10, atol=1e-12)
    # positive semi-definite (the Hessian of this ReLU head is not needed to be)
    assert float(torch.linalg.eigvalsh(dense).min()) > -1e-9 * float(dense.diagonal().max())


def test_float32_head_products_match_the_float64_oracle(head):
    """The benchmark's heads are float32: the products run in float32 (tangents, chain, pullback)
    and must still be J^T M J to float32 accuracy."""
    model, task, data = head
    rows = data.take(torch.arange(150))
    layout = head_layout(model, task)
    dense = dense_ggn(model, task, rows, layout)
    single = copy.deepcopy(model).float()
    op = HeadGaussNewton(single, task, rows.astype(torch.float32), head_layout(single, task), divisor=150.0,
                         ridge=0.0, batch_size=64)
    v = torch.randn(layout.numel, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expect = dense @ v / 150.0
    assert float((op.matvec(v) - expect).norm()) <= 1e-5 * float(expect.norm())


def test_ekfac_diagonal_and_preconditioner_match_per_sample_projections(head):
    model, task, data = head
    small = data.take(torch.arange(120))
    prepared = HeadCurvature.prepare(model, task, small, batch_size=50)
    layout = head_layout(model, task)
    n = len(small)
    # oracle: per sample and class, the layer gradient of sqrt(p_c) (e_c - p)^T logits, i.e. a row of
    # sqrt(M) J, projected on Q_G (x) Q_A
    base = {k: v.detach() for k, v in model.named_parameters()}
    w = layout.flatten(base)
    x = small.columns["x"]
    jac = jacrev(lambda f: functional_call(model, {**base, **layout.to_parameters(f, torch.float64)}, (x,)))(w)
    p = torch.softmax(model(x).detach(), 1)
    eye = torch.eye(p.shape[1], dtype=torch.float64)
    start = 0
    # oracle A = E[a~ a~^T] of each layer's input (with the ones column) and G_out = E[sum_c d_c d_c^T]
    hidden = torch.relu(model[1](x)).detach()
    a_oracle = [torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1), torch.cat([hidden, torch.ones(n, 1, dtype=x.dtype)], 1)]
    coeff_all = torch.stack([(eye[c] - p) * p[:, c:c + 1].sqrt() for c in range(p.shape[1])])   # (K, n, K)
    w2 = model[3].weight.detach()
    mask = (model[1](x) > 0).to(x.dtype)
    g_oracle = [sum((coeff_all[c] @ w2 * mask).T @ (coeff_all[c] @ w2 * mask) for c in range(p.shape[1])) / n,
                sum(coeff_all[c].T @ coeff_all[c] for c in range(p.shape[1])) / n]
    for f, a_mat, g_mat in zip(prepared.factors, a_oracle, g_oracle):
        rot_a = f.q_in.T @ (a_mat.T @ a_mat / n) @ f.q_in
        rot_g = f.q_out.T @ g_mat @ f.q_out
        for rot in (rot_a, rot_g):   # Q_A, Q_G are the eigenbases of exactly these matrices
            off = rot - torch.diag(rot.diagonal())
            assert float(off.abs().max()) <= 1e-9 * float(rot.diagonal().abs().max())
    for f, (name, layer) in zip(prepared.factors, layout.layers):
        rows, cols = layout.shape(layer)
        size = rows * cols
        scale = torch.zeros(rows, cols, dtype=torch.float64)
        gram = torch.zeros(size, size, dtype=torch.float64)
        for i in range(n):
            for c in range(p.shape[1]):
                coeff = (eye[c] - p[i]) * p[i, c].sqrt()          # sqrt(M) row c
                g = (coeff @ jac[i, :, start:start + size]).view(rows, cols)
                scale += (f.q_out.T @ g @ f.q_in) ** 2
                gram += torch.outer(g.reshape(-1), g.reshape(-1))
        assert torch.allclose(f.scale, scale / n, rtol=1e-9, atol=1e-14), name
        # the EK-FAC diagonal is diag(Q^T G Q) of the layer's exact GGN block on these samples
        q = torch.kron(f.q_out, f.q_in)
        assert torch.allclose((q.T @ (gram / n) @ q).diagonal().view(rows, cols), f.scale, rtol=1e-8, atol=1e-13)
        v = torch.randn(rows, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        oracle = q @ ((q.T @ v.reshape(-1)) / (f.scale.reshape(-1) + 0.05))
        assert torch.allclose(f.solve(v, 0.05).reshape(-1), oracle, rtol=1e-9, atol=1e-12)
        start += size
    # the mean gradient is mean_D grad loss (no weight decay)
    loss = nn.functional.cross_entropy(model(x), small.columns["y"])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expect = layout.flatten(dict(zip([k for k, _ in model.named_parameters()], grads)))
    assert torch.allclose(prepared.mean_gradient, expect, rtol=1e-10, atol=1e-13)
    assert torch.allclose(prepared.curvature_trace, 1 - (p * p).sum(1), atol=1e-12)


def test_step_converged_on_every_row_is_the_dense_gauss_newton_solve(head):
    """On 480 of the head's training rows (the dense oracle's explicit Jacobians cost the square of
    the rows), the step converged on every row is the dense damped Gauss-Newton solve."""
    model, task, data = head
    data = data.take(torch.arange(480))
    layout = head_layout(model, task)
    n = len(data)
    forget = torch.arange(0, n, 37)[:12]
    m = len(forget)
    step = gauss_newton_step(model, task, data, forget, LAMBDA, rows=n, iterations=400, damping=0.02)
    keep = torch.ones(n, dtype=torch.bool)
    keep[forget] = False
    ggn = dense_ggn(model, task, data.take(keep.nonzero().flatten()), layout) / (n - m)
    x, y = data.columns["x"], data.columns["y"]
    names = [k for k, _ in model.named_parameters()]

    def grad_sum(rows):
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum")
        return layout.flatten(dict(zip(names, torch.autograd.grad(loss, list(model.parameters())))))

    g_u = (grad_sum(forget) - m * grad_sum(torch.arange(n)) / n) / (n - m)
    oracle = torch.linalg.solve(ggn + (LAMBDA + 0.02) * torch.eye(layout.numel, dtype=torch.float64), g_u)
    got = layout.flatten(step.delta)
    assert float((got - oracle).norm()) <= 1e-6 * float(oracle.norm())
    assert step.record["relative_residual"] < 1e-8
    assert step.record["rows"] == n - m


def test_truncated_step_is_most_of_the_exact_one_at_a_fraction_of_the_products(head):
    """Two PCG iterations from the EK-FAC start, on the 512 rows of largest curvature, already point
    where the exact Gauss-Newton step does (cosine > 0.9): the preconditioner is not the identity
    and the row ranking keeps the curvature (share recorded)."""
    model, task, data = head
    forget = torch.arange(0, len(data), 41)[:25]
    exact = gauss_newton_step(model, task, data, forget, LAMBDA, rows=len(data), iterations=400)
    cheap = gauss_newton_step(model, task, data, forget, LAMBDA, rows=512, iterations=2, min_trace_share=0.0)
    a, b = torch.cat([v.reshape(-1) for v in exact.delta.values()]), torch.cat([v.reshape(-1) for v in cheap.delta.values()])
    cosine = float(a @ b / (a.norm() * b.norm()))
    assert cosine > 0.9, cosine   # measured 0.96; 0.87 with no CG iteration (the EK-FAC solution alone)
    assert 0.7 < float(b.norm() / a.norm()) < 1.3
    assert cheap.record["products"] == 3 and cheap.record["rows"] == 512   # x0's residual + 2 iterations
    assert 0.45 < cheap.record["rows_trace_share"] <= 1.0   # measured 0.57: 512 of 1,409 rows


def test_single_linear_layer_step_lands_on_the_retrained_optimum():
    """One Linear layer under cross-entropy: the GGN is the Hessian, so from the exact optimum of
    L_D the step is the Newton step of the retained objective (REFERENCE section 1) and lands
    within second order of the retrained optimum: a wrong sign or a missing 1/(n-m) moves away.
    600 of the digits (the two fits to a 1e-11 gradient are the cost; 20 removed, 3.3%)."""
    data = digits64()["train"].take(torch.arange(600))
    task = DenseInputTask()
    torch.manual_seed(0)
    model = newton_fit(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double(), task, data, 0.05)
    n = len(data)
    forget = torch.arange(0, n, 31)[:20]
    keep = torch.ones(n, dtype=torch.bool)
    keep[forget] = False
    target = newton_retrained(model, task, data.take(keep.nonzero().flatten()), 0.05)
    step = gauss_newton_step(model, task, data, forget, 0.05, rows=n, iterations=300)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in moved.named_parameters():
            p.add_(step.delta[k])
    flat = lambda net: torch.cat([p.detach().reshape(-1) for p in net.parameters()])  # noqa: E731
    before, after = float((flat(model) - flat(target)).norm()), float((flat(moved) - flat(target)).norm())
    assert after <= 0.02 * before, (before, after)   # measured 3.1e-3 of it; the step reversed: 2.0x


def test_prepared_state_is_used_only_at_its_weights(head):
    model, task, data = head
    prepared = HeadCurvature.prepare(model, task, data)
    forget = torch.arange(5, 400, 23)
    with_prep = gauss_newton_step(model, task, data, forget, LAMBDA, rows=256, iterations=2, prepared=prepared,
                                  min_trace_share=0.0)
    without = gauss_newton_step(model, task, data, forget, LAMBDA, rows=256, iterations=2, min_trace_share=0.0)
    assert with_prep.record["prepared"] == "prepared for these weights and data"
    assert without.record["prepared"] == "computed in this removal"
    assert set(with_prep.delta) == set(without.delta) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    for k in with_prep.delta:
        assert torch.allclose(with_prep.delta[k], without.delta[k], rtol=1e-10, atol=1e-14)
    # the method's prepared state is bound to these weights: handed over for other ones, it is rebuilt
    method = get_method("head-gauss-newton")
    settings = method.Settings(parameters=["3.weight", "3.bias"])
    state, _ = prepare(method, TrainedModel(model, task, data, LAMBDA), settings)
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    again, why = prepare(method, TrainedModel(other, task, data, LAMBDA), settings, state)
    assert again is not state and "other weights" in why
    assert prepare(method, TrainedModel(model, task, data, LAMBDA), settings, state) == (state, None)


def test_heads_it_cannot_cover_are_refused_by_name():
    task = DenseInputTask()
    shared = nn.ReLU()
    twice = nn.Sequential(nn.Linear(4, 4), shared, nn.Linear(4, 4), shared, nn.Linear(4, 2))
    with pytest.raises(ValueError, match="Gauss-Newton step.*module instance twice"):
        head_layout(twice, task)
    frozen = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    frozen[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"Gauss-Newton step.*\['0.weight'\] are frozen"):
        head_layout(frozen, task)
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 10))
    with pytest.raises(ValueError, match="Gauss-Newton step.*Conv2d"):
        head_layout(conv, task)
    with pytest.raises(ValueError, match="Gauss-Newton step.*cross-entropy"):
        head_layout(nn.Sequential(nn.Linear(4, 2)), DenseInputTask(loss="mse"))


@pytest.mark.parametrize("recipe", ["none", "sgd"])
def test_head_method_moves_the_hidden_layer_by_the_step(head, recipe):
    """head-gauss-newton moves the hidden layer by the Gauss-Newton step's hidden part towards the
    method's target (the step itself is checked against the dense solve above; what it does for
    forgetting is measured in bench/forgetting.py): without a card (Retrain's recipe unknown) the
    step towards the minimiser; on an SGD card Retrain's budget-damped step (mu = 1/tau added to the
    ridge). The decision layer is then solved over the new features to the same kind of target."""
    from pipeline.models.card import DataRef, ModelCard, TrainingRecord
    from pipeline.target import ReplaySchedule

    model, task, data = head
    n = len(data)
    forget = torch.arange(3, n, 53)[:30]
    card = None if recipe == "none" else ModelCard(
        preset="mlp", data=DataRef(source="digits"),
        training=TrainingRecord(weight_decay=LAMBDA, n=n, optimizer="sgd", epochs=2, lr=0.05, batch_size=128))
    mu = 0.0 if card is None else 1.0 / ReplaySchedule(2, 0.05, 0.9, 128, LAMBDA).training_time(n - len(forget))
    base = {"parameters": ["3.weight", "3.bias"], "newton_max_steps": 40, "newton_rtol": 1e-6,
            "replay_max_parameters": 1}

    def run(name, settings, prepared=None):
        twin = copy.deepcopy(model)
        method = get_method(name)
        problem = RemovalProblem(twin, task, data, forget, LAMBDA, seed=0, batch_size=512, card=card)
        return method.run(problem, method.Settings.model_validate(settings), prepared)

    plain = run("decision-layer-newton", base)
    moved = run("head-gauss-newton", {**base, "hidden_step_rows": n, "hidden_step_iterations": 50})
    assert set(plain.new_parameters) == {"3.weight", "3.bias"}
    assert set(moved.new_parameters) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    how = "minimiser" if card is None else "budget_damped"
    assert plain.record["target"]["how"] == moved.record["target"]["how"] == how
    assert moved.record["hidden_step"]["target"]["how"] == how
    assert moved.record["hidden_step"]["target"]["training_budget_damping"] == pytest.approx(mu, rel=1e-12)
    assert moved.record["gradient_norms"]["residual_after"] <= 1e-5 * moved.record["gradient_norms"]["residual_before"]
    step = gauss_newton_step(model, task, data, forget, LAMBDA, rows=n, iterations=50, batch_size=512, damping=mu,
                             minimiser=card is None)
    params = dict(model.named_parameters())
    for k in ("1.weight", "1.bias"):
        moved_by = moved.new_parameters[k] - params[k].detach()
        assert float((moved_by - step.delta[k]).norm()) <= 1e-9 * float(step.delta[k].norm()), k
    record = moved.record["hidden_step"]
    assert record["parameters"] == ["1.weight", "1.bias"] and record["prepared"] == "prepared for these weights and data"

    # noise covers the decision layer only: a release with epsilon says heuristic and names the hidden step
    noisy = run("head-gauss-newton", {**base, "epsilon": 5.0})
    assert noisy.release.guarantee == "heuristic"
    assert any(r.startswith("hidden layers moved") for r in noisy.release.reasons)
    # rows that hold too little of the curvature: no hidden step, recorded, the layer as without it
    skipped = run("head-gauss-newton", {**base, "hidden_step_rows": 64, "hidden_step_min_trace_share": 0.9},
                  moved.prepared)
    assert not skipped.record["preparation"]["built_for_this_request"]
    assert set(skipped.new_parameters) == {"3.weight", "3.bias"}
    hidden = skipped.record["hidden_step"]
    assert hidden["rows_trace_share"] < 0.9 and "no hidden step was taken" in hidden["skipped"]
    assert hidden["step_norm_outside_block"] == 0.0
    for k in ("3.weight", "3.bias"):
        assert torch.allclose(skipped.new_parameters[k], plain.new_parameters[k], rtol=0, atol=1e-12)
    # a head whose decision layer is the whole model has nothing else to move
    alone = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double()
    problem = RemovalProblem(alone, task, data, forget, LAMBDA, seed=0)
    with pytest.raises(ValueError, match="nothing to move"):
        get_method("head-gauss-newton").run(problem, get_method("head-gauss-newton").Settings())


def test_passes_are_sized_from_the_memory_budget(head):
    """A budget that holds the factors and about 320 samples' pass gives passes of at most that many
    samples (preparation, forget gradient) and the same step; the Gauss-Newton rows, all held at
    once, must fit whole (else refused naming hidden_step_rows); a budget that cannot hold one
    sample is refused up front, by name."""
    from pipeline import memory
    from pipeline.curvature.gauss_newton import rows_per_pass

    model, task, data = head
    layout = head_layout(model, task)
    fixed = 8 * sum(3 * i * i + 3 * o * o + 3 * o * i for o, i in (layout.shape(m) for _, m in layout.layers))
    per_row = 8 * sum(12 * o + 3 * i for o, i in (layout.shape(m) for _, m in layout.layers))
    forget = torch.arange(7, 600, 29)
    free = gauss_newton_step(model, task, data, forget, LAMBDA, rows=300, iterations=2, batch_size=4096,
                             min_trace_share=0.0)
    with memory.use_budget(fixed + 320 * per_row):
        assert rows_per_pass(layout, 10, 4096) == 320
        tight = gauss_newton_step(model, task, data, forget, LAMBDA, rows=300, iterations=2, batch_size=4096,
                                  min_trace_share=0.0)
    assert set(free.delta) == set(tight.delta) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    for k in free.delta:
        assert torch.allclose(tight.delta[k], free.delta[k], rtol=1e-4, atol=1e-8)   # chunked sums only
    with memory.use_budget(fixed + 100 * per_row), pytest.raises(memory.MemoryBudgetError, match="hidden_step_rows"):
        gauss_newton_step(model, task, data, forget, LAMBDA, rows=300, iterations=2, min_trace_share=0.0)
    with memory.use_budget(fixed + per_row // 2), pytest.raises(memory.MemoryBudgetError, match="memory_budget.*hidden step"):
        gauss_newton_step(model, task, data, forget, LAMBDA, rows=300, iterations=2)


def test_model_directory_removal_with_hidden_step(trained_model_dir):
    """Through pipeline.removal.remove (what every caller uses) on an mlp model directory: the hidden
    layer and the output layer both change, the new state loads into the preset, and the record
    carries the step."""
    from pipeline.models.card import load_model_dir, read_card
    from pipeline.removal import remove, training_set

    model_dir = trained_model_dir("mlp", {"in_features": 64, "hidden": [16], "num_classes": 10}, steps=60)
    ids = training_set(read_card(model_dir)).sample_ids[:5].tolist()
    run = remove(model_dir, ids, method="newton-head-gn", seed=0, batch_size=256,
                 settings={"newton_max_steps": 20, "newton_rtol": 1e-4, "hidden_step_rows": 2048})
    model, _, _ = load_model_dir(model_dir)
    before = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], run.new_state[k])}
    assert changed == {"1.weight", "1.bias", "3.weight", "3.bias"}, run.record["hidden_step"]
    model.load_state_dict(run.new_state, strict=True)
    hidden = run.record["hidden_step"]
    assert hidden["parameters"] == ["1.weight", "1.bias"] and hidden["step_norm_outside_block"] > 0
    assert hidden["prepared"] == "prepared for these weights and data" and "skipped" not in hidden
    assert run.record["newton"]["converged"] and run.record["variant"] == "newton-head-gn"
    assert run.record["method"] == "head-gauss-newton" and run.record["preparation"]["built_for_this_request"]


def test_no_ridge_and_unknown_settings_are_refused_and_the_mode_is_restored(head):
    model, task, data = head
    with pytest.raises(ValueError, match="hidden_step_damping"):
        gauss_newton_step(model, task, data, torch.arange(5), 0.0, rows=256, iterations=2)
    # an error inside a pass leaves the model as it was (mode and hooks)
    broken = copy.deepcopy(model).train()
    bad = data.take(torch.arange(20))
    bad = type(bad)({**bad.columns, "x": bad.columns["x"][:, :60]}, bad.sample_ids)   # 60 features, not 64
    with pytest.raises(RuntimeError):
        gauss_newton_step(broken, task, bad, torch.arange(3), LAMBDA, rows=16, iterations=1, min_trace_share=0.0)
    assert broken.training and all(m.training for m in broken.modules())
    assert all(not m._forward_hooks for m in broken.modules())
    method = get_method("head-gauss-newton")
    problem = RemovalProblem(copy.deepcopy(model), task, data, torch.arange(5), LAMBDA, seed=0, batch_size=512)
    with pytest.raises(ValueError, match="target"):  # the anchored target is gone: a clear error names the field
        method.run(problem, method.Settings.model_validate({"anchor": "training_residual"}))
