"""The decision layer (issue 12 section 2, issue 24): the closed-form Hessian of a Linear layer under
cross-entropy, the frozen-prefix cache and the targets of lfoci-newton's block Newton, and
the decision-layer-newton method (matrix-free Newton from the prepared state), each against an exact
reference."""
from __future__ import annotations

import copy
import math
import dataclasses

import pytest
import torch
from torch import nn

from pipeline.curvature import BlockHessian, block_gradient
from pipeline.curvature.linear_layer import LinearCrossEntropyHessian, closed_form_layer, native_bfloat16
from pipeline.curvature.softmax_layer import SoftmaxLayerObjective
from pipeline.data import SampleSet
from pipeline.errors import RemovalNotServed
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem, TrainedModel, prepare
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs, fit_newton
from tests.kit import digits64, flat, sgd_mlp_head, softmax_task

LAMBDA = 0.01
HEAD = ["3.weight", "3.bias"]
FORGET = list(range(0, 120, 3))  # 40 samples


@pytest.fixture(scope="module")
def digits():
    return digits64()["train"]


@pytest.fixture(scope="module")
def sgd_mlp(digits):
    """64-16-10 ReLU head after a few epochs of SGD: far from any stationary point."""
    return sgd_mlp_head(digits, seed=2, epochs=3, weight_decay=LAMBDA)


def sgd_card(data):
    """A model card whose recipe is SGD for a fixed budget (the sgd_mlp fixture's): the ``retrain``
    target then has a training budget tau to damp by."""
    from pipeline.models.card import DataRef, ModelCard, TrainingRecord

    return ModelCard(preset="mlp", options={"hidden": [16]}, data=DataRef(source="digits"),
                     training=TrainingRecord(weight_decay=LAMBDA, n=len(data), optimizer="sgd", epochs=3, lr=0.1,
                                             batch_size=64, seed=2))


def run(model, data, positions, card=None, **settings):
    """lfoci-newton's block Newton on the decision layer (named), on a copy of ``model``."""
    work = copy.deepcopy(model)
    method = get_method("lfoci-newton")
    problem = RemovalProblem(work, softmax_task(), data, torch.as_tensor(positions), LAMBDA, seed=1, card=card)
    outcome = method.run(problem, method.Settings(selection="parameters", parameters=HEAD, **settings))
    return work, outcome.record


def run_dl(model, data, positions, prepared=None, card=None, **settings):
    """decision-layer-newton on a copy of ``model``, from ``prepared`` when given (else prepared here)."""
    work = copy.deepcopy(model)
    method = get_method("decision-layer-newton")
    problem = RemovalProblem(work, softmax_task(), data, torch.as_tensor(positions), LAMBDA, seed=1, card=card)
    outcome = method.run(problem, method.Settings(**{"parameters": HEAD, **settings}), prepared)
    return work, outcome.record


def prepared_for(model, data, weight_decay=LAMBDA, task=None):
    """The decision layer's state, prepared by the method's own preparation."""
    method = get_method("decision-layer-newton")
    state, why = prepare(method, TrainedModel(model, task or softmax_task(), data, weight_decay),
                         method.Settings(parameters=HEAD))
    assert why == "no prepared state was given"
    return state


def head_gradient(model, data, positions=None):
    keep = data if positions is None else data.without(torch.as_tensor(positions))
    block = ParamBlock.from_rows(model, {name: None for name in HEAD})
    return block_gradient(model, softmax_task(), keep, block, LAMBDA, reduction="mean")


def anchored_minimiser(model, data, forget, r0, mu=0.0):
    """Oracle: the output layer minimising L_{D\\U}(w) - <r0, w_P> + (mu/2)||w_P - w_P0||^2 (convex in
    it), by a tight L-BFGS solve over the hidden features; flat (weight, bias), float64."""
    keep = data.without(torch.as_tensor(forget))
    h = model[:3](keep.columns["x"]).detach()
    y = keep.columns["y"]
    w = torch.cat([model[3].weight.detach().reshape(-1), model[3].bias.detach()]).clone().requires_grad_(True)
    w0 = w.detach().clone()
    k, d = model[3].weight.shape
    others = sum(float(p.detach().pow(2).sum()) for p in (model[1].weight, model[1].bias))

    def objective():
        wt, b = w[: k * d].reshape(k, d), w[k * d:]
        loss = nn.functional.cross_entropy(h @ wt.T + b, y)
        return loss + 0.5 * LAMBDA * (w.pow(2).sum() + others) - r0 @ w + 0.5 * mu * (w - w0).pow(2).sum()

    opt = torch.optim.LBFGS([w], lr=1, max_iter=2000, tolerance_grad=1e-13, tolerance_change=1e-18,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = objective()
        value.backward()
        return value

    opt.step(closure)
    return w.detach()


@pytest.mark.parametrize("smoothing,bias,reduction", [(0.0, True, "mean"), (0.1, True, "sum"), (0.0, False, "sum")])
def test_closed_form_hessian_is_the_hessian_vector_product_matrix(smoothing, bias, reduction):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(7, 4, bias=bias)).double()
    data = SampleSet({"x": torch.randn(50, 7, dtype=torch.float64), "y": torch.randint(0, 4, (50,))}, torch.arange(50))
    task = DenseInputTask(loss="cross_entropy", loss_options={"label_smoothing": smoothing})
    block = ParamBlock.all_parameters(layer)
    exact = BlockHessian(layer, task, data, block, 0.03, reduction=reduction).to_dense()
    closed = LinearCrossEntropyHessian(layer, task, data, block, 0.03, reduction=reduction).to_dense()
    assert float((exact - closed).abs().max()) <= 1e-10 * float(exact.abs().max())


def test_closed_form_applies_only_to_a_whole_linear_layer_under_cross_entropy():
    head = nn.Sequential(nn.Linear(5, 3))
    whole = ParamBlock.all_parameters(head)
    assert closed_form_layer(head, softmax_task(), whole) is head[0]
    assert closed_form_layer(head, DenseInputTask(loss="mse"), whole) is None
    assert closed_form_layer(head, softmax_task(), ParamBlock.from_rows(head, {"0.weight": [0, 1]})) is None
    assert closed_form_layer(nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)), softmax_task(),
                             ParamBlock.all_parameters(nn.Sequential(nn.Linear(5, 3)))) is None


def test_cached_prefix_and_closed_form_give_the_same_removal_as_the_full_model(sgd_mlp, digits):
    fast, rec_fast = run(sgd_mlp, digits, FORGET, newton_max_steps=4)
    slow, rec_slow = run(sgd_mlp, digits, FORGET, newton_max_steps=4, cache_frozen_prefix=False,
                         closed_form_curvature=False)
    assert rec_fast["frozen_prefix"]["suffix_start_module"] == 3
    assert rec_fast["curvature"]["operator"] == "LinearCrossEntropyHessian"
    assert rec_slow["frozen_prefix"] is None and rec_slow["curvature"]["operator"] == "BlockHessian"
    moved = float(torch.linalg.vector_norm(flat(fast) - flat(sgd_mlp)))
    assert moved > 1e-2
    assert float(torch.linalg.vector_norm(flat(fast) - flat(slow))) <= 1e-8 * max(1.0, moved)
    # the hidden layer never moves
    assert torch.equal(fast[1].weight, sgd_mlp[1].weight) and torch.equal(fast[1].bias, sgd_mlp[1].bias)


def test_budget_damped_target_is_the_stationary_point_of_the_damped_objective_on_both_paths(sgd_mlp, digits):
    """target: retrain on an SGD card with a layer above replay_max_parameters: the replay's one-window
    form, grad_P L_{D\\U}(w') - r0 + mu (w' - w0) = 0 with r0 = grad_P L_D(w0) and mu = 1/tau, tau the
    recipe's heavy-ball sum of rates on D \\ U; checked directly, against a tight L-BFGS minimisation of
    the damped objective, and as the same point on the block-Newton and decision-layer paths."""
    from pipeline.target import ReplaySchedule

    r0 = head_gradient(sgd_mlp, digits)
    assert float(torch.linalg.vector_norm(r0)) > 1e-3  # the SGD model is not at a stationary point
    card = sgd_card(digits)
    tau = ReplaySchedule(3, 0.1, 0.9, 64, LAMBDA).training_time(len(digits) - len(FORGET))
    tight = dict(newton_max_steps=20, newton_rtol=1e-10, newton_atol=1e-12, replay_max_parameters=1)
    damped, record = run(sgd_mlp, digits, FORGET, card=card, **tight)
    assert record["target"]["how"] == "budget_damped" and record["newton"]["converged"]
    assert record["target"]["mu"] == pytest.approx(1.0 / tau, rel=1e-12)
    w0, w1 = flat(sgd_mlp)[-170:], flat(damped)[-170:]  # the output layer: 10 x 16 weight + 10 bias
    left = head_gradient(damped, digits, FORGET) - r0 + (w1 - w0) / tau
    assert float(torch.linalg.vector_norm(left)) <= 1e-9
    w = anchored_minimiser(sgd_mlp, digits, FORGET, r0, mu=1.0 / tau)
    assert float(torch.linalg.vector_norm(w1 - w)) <= 1e-6 * float(torch.linalg.vector_norm(w))
    layer, rec_dl = run_dl(sgd_mlp, digits, FORGET, card=card, **{**tight, "newton_max_steps": 40})
    assert rec_dl["target"]["how"] == "budget_damped"
    assert float(torch.linalg.vector_norm(flat(layer) - flat(damped))) <= 1e-6 * float(torch.linalg.vector_norm(w))
    # the minimiser is another point: the retrained optimum of the layer
    plain, rec = run(sgd_mlp, digits, FORGET, target="minimiser", newton_max_steps=20, newton_rtol=1e-10,
                     newton_atol=1e-12)
    assert rec["target"]["how"] == "minimiser"
    assert float(torch.linalg.vector_norm(head_gradient(plain, digits, FORGET))) <= 1e-9
    assert float(torch.linalg.vector_norm(flat(plain) - flat(damped))) > 1e-2


def test_retrain_is_the_minimiser_without_an_sgd_recipe(sgd_mlp, digits):
    """No card (Retrain's recipe unknown) or a converging recipe: target retrain is the minimiser."""
    from pipeline.models.card import DataRef, ModelCard, TrainingRecord

    lbfgs = ModelCard(preset="mlp", options={"hidden": [16]}, data=DataRef(source="digits"),
                      training=TrainingRecord(weight_decay=LAMBDA, n=len(digits), optimizer="lbfgs"))
    plain, _ = run(sgd_mlp, digits, FORGET, target="minimiser", newton_max_steps=10)
    for card in (None, lbfgs):
        same, rec = run(sgd_mlp, digits, FORGET, card=card, newton_max_steps=10)
        assert rec["target"]["how"] == "minimiser" and rec["target"]["setting"] == "retrain"
        assert torch.equal(flat(same), flat(plain))


def test_prepared_state_is_used_only_where_it_holds_and_changes_no_result(sgd_mlp, digits):
    """The decision layer's state holds H_P(D) exactly (the Hessian-vector products' matrix); a
    removal from it equals one that prepares its own; handed to a removal on other weights (a model
    after an earlier removal), other data, another weight decay or other loss options, it is not
    used: the removal prepares anew and its record says why."""
    state = prepared_for(sgd_mlp, digits)
    block = ParamBlock.from_rows(sgd_mlp, {name: None for name in HEAD})
    exact = BlockHessian(sgd_mlp, softmax_task(), digits, block, LAMBDA, reduction="mean").to_dense()
    assert float((state.matrix - exact).abs().max()) <= 1e-10 * float(exact.abs().max())
    common = dict(newton_max_steps=40, newton_rtol=1e-9)
    cold, rec_cold = run_dl(sgd_mlp, digits, FORGET, **common)
    hot, rec_hot = run_dl(sgd_mlp, digits, FORGET, prepared=state, **common)
    assert rec_cold["preparation"]["built_for_this_request"] and not rec_hot["preparation"]["built_for_this_request"]
    assert torch.equal(flat(hot), flat(cold))
    _, rec_other = run_dl(cold, digits, [1, 2, 4], prepared=state, newton_max_steps=40)
    assert rec_other["preparation"]["built_for_this_request"]
    assert "other weights or buffers" in rec_other["preparation"]["why"]
    method = get_method("decision-layer-newton")
    settings = method.Settings(parameters=HEAD)
    for trained, what in ((TrainedModel(sgd_mlp, softmax_task(), digits.take(torch.arange(900)), LAMBDA), "training set"),
                          (TrainedModel(sgd_mlp, softmax_task(), digits, 2 * LAMBDA), "weight decay"),
                          (TrainedModel(sgd_mlp, DenseInputTask(loss="cross_entropy",
                                                                loss_options={"label_smoothing": 0.1}),
                                        digits, LAMBDA), "loss or its options")):
        again, why = prepare(method, trained, settings, state)
        assert again is not state and what in why


def test_a_prepared_removal_moves_only_its_own_copy(sgd_mlp, digits):
    before = flat(sgd_mlp).clone()
    state = prepared_for(sgd_mlp, digits)
    removed, record = run_dl(sgd_mlp, digits, FORGET, prepared=state, newton_max_steps=40)
    assert not record["preparation"]["built_for_this_request"] and "prefix_cache" not in record["timings"]
    assert torch.equal(flat(sgd_mlp), before)  # the prepared model is untouched
    assert float(torch.linalg.vector_norm(flat(removed) - before)) > 1e-3


def test_matrix_free_closed_form_products_equal_the_hessian_vector_products(sgd_mlp, digits):
    block = ParamBlock.from_rows(sgd_mlp, {name: None for name in HEAD})
    suffix = sgd_mlp[3:]
    hidden = SampleSet({**digits.columns, "x": sgd_mlp[:3](digits.columns["x"]).detach()}, digits.sample_ids)
    v = torch.randn(block.numel, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for reduction in ("sum", "mean"):
        exact = BlockHessian(suffix, softmax_task(), hidden, block, LAMBDA, reduction=reduction).matvec(v)
        free = LinearCrossEntropyHessian(suffix, softmax_task(), hidden, block, LAMBDA, reduction=reduction).matvec(v)
        assert float(torch.linalg.vector_norm(free - exact)) <= 1e-11 * float(torch.linalg.vector_norm(exact))


@pytest.mark.parametrize("target", ["minimiser", "retrain"])
def test_fisher_dense_step_on_the_decision_layer_is_the_exact_newton_step(sgd_mlp, digits, target):
    """Noise off: w' = w - (B + mu I)^{-1} (grad L_Dr(w) - a), B the exact Hessian of L_Dr on the output
    layer (Hessian-vector products); minimiser a = 0, mu = 0; retrain on an SGD card the budget-damped
    step, a = grad L_D(w), mu = 1/tau."""
    from pipeline.target import ReplaySchedule

    forget = torch.as_tensor(FORGET)
    work = copy.deepcopy(sgd_mlp)
    method = get_method("fisher")
    problem = RemovalProblem(work, softmax_task(), digits, forget, LAMBDA, seed=1, card=sgd_card(digits))
    outcome = method.run(problem, method.Settings(parameters=HEAD, curvature="dense", tradeoff=0.0, target=target))
    mu = 0.0 if target == "minimiser" else 1.0 / ReplaySchedule(3, 0.1, 0.9, 64, LAMBDA).training_time(
        len(digits) - len(FORGET))
    block = ParamBlock.from_rows(sgd_mlp, {name: None for name in HEAD})
    retain = digits.without(forget)
    b = BlockHessian(sgd_mlp, softmax_task(), retain, block, LAMBDA, reduction="mean").to_dense()
    g = head_gradient(sgd_mlp, digits, FORGET)
    a = head_gradient(sgd_mlp, digits) if target == "retrain" else torch.zeros_like(g)
    b = b + mu * torch.eye(len(g), dtype=b.dtype)
    expected = block.gather(dict(sgd_mlp.named_parameters())).detach().double() - torch.linalg.solve(b, g - a)
    got = block.gather(dict(work.named_parameters())).detach().double()
    assert float(torch.linalg.vector_norm(got - expected)) <= 1e-8 * float(torch.linalg.vector_norm(expected))
    assert outcome.record["target"]["how"] == ("budget_damped" if target == "retrain" else "minimiser")


# ---- decision-layer-newton (Newton with the current curvature, never built) -------------------
def class_positions(data, label=3):
    return torch.nonzero(data.columns["y"] == label).squeeze(1).tolist()


def test_matrix_free_objective_matches_autograd():
    """grad F and H V of pipeline.curvature.softmax_layer against autograd on the same objective
    (label smoothing, target term, proximal term): a wrong sign or a missing 1/n, lambda or mu fails."""
    gen = torch.Generator().manual_seed(3)
    n, d, k, s = 40, 5, 4, 0.1
    x = torch.cat([torch.randn(n, d, generator=gen), torch.ones(n, 1)], 1).double()  # exact in float32, as a
    y = torch.randint(0, k, (n,), generator=gen)                                      # float32 model's features
    targets = (1 - s) * nn.functional.one_hot(y, k).double() + s / k
    anchor, ref = torch.randn(k, d + 1, generator=gen, dtype=torch.float64), torch.randn(k, d + 1, generator=gen,
                                                                                         dtype=torch.float64)
    obj = SoftmaxLayerObjective(x, targets, 0.07, anchor, ref, proximal=0.3)
    theta = torch.randn(k, d + 1, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(t):
        z = x @ t.T
        return (nn.functional.cross_entropy(z, y, label_smoothing=s) + 0.035 * (t * t).sum()
                - (anchor * (t - ref)).sum() + 0.15 * ((t - ref) ** 2).sum())

    z = obj.logits(theta.detach())
    assert z.shape == (k, n)  # class-major
    p = torch.softmax(z, dim=0)
    assert abs(obj.value(theta.detach(), z) - float(f(theta).detach())) <= 1e-12
    grad = torch.autograd.grad(f(theta), theta)[0]
    assert float((obj.gradient(theta.detach(), p) - grad).abs().max()) <= 1e-12
    assert obj.gradient_floor(p) == 0.0
    v = torch.randn(k, d + 1, generator=gen, dtype=torch.float64)
    hv = torch.autograd.functional.hvp(f, theta.detach(), v)[1]
    got = obj.hessian_product(p, v)
    assert float((got - hv).abs().max()) <= 1e-11 * float(hv.abs().max())

    # float32 inputs: float32 passes, their gradient within its stated rounding floor of the exact one
    # (and that floor far below the gradient), the same after the switch to float64 passes
    obj32 = SoftmaxLayerObjective(x.float(), targets, 0.07, anchor, ref, proximal=0.3)
    z32 = obj32.logits(theta.detach())
    p32 = torch.softmax(z32, dim=0)
    floor = obj32.gradient_floor(p32)
    err = float(torch.linalg.vector_norm(obj32.gradient(theta.detach(), p32) - grad))
    assert 0 < err <= floor <= 1e-5 * float(torch.linalg.vector_norm(grad)), (err, floor)
    obj32.PRECISE_CHUNK = 16  # float64 passes over float32 X~ cast 16 rows at a time: three chunks here
    obj32.to_float64()
    assert obj32.pass_dtype == torch.float64 and obj32.gradient_floor(p) == 0.0 and obj32.x.dtype == torch.float32
    assert float((obj32.logits(theta.detach()) - z).abs().max()) <= 1e-12
    assert float((obj32.gradient(theta.detach(), torch.softmax(obj32.logits(theta.detach()), 0)) - grad).abs().max()) \
        <= 1e-12


def test_decision_layer_newton_lands_on_the_minimiser_of_a_class_removal(sgd_mlp, digits):
    """Class forgetting on the softmax head: the decision-layer Newton lands on the retrained optimum
    of the layer (tight L-BFGS oracle), far from the start."""
    forget = class_positions(digits)
    r0 = torch.zeros(170, dtype=torch.float64)
    oracle = anchored_minimiser(sgd_mlp, digits, forget, r0)
    start = torch.cat([sgd_mlp[3].weight.detach().reshape(-1), sgd_mlp[3].bias.detach()])
    span = float(torch.linalg.vector_norm(oracle - start))
    assert span > 1.0  # forgetting a class moves the head far

    def head(model):
        return torch.cat([model[3].weight.detach().reshape(-1), model[3].bias.detach()])

    exact, rec = run_dl(sgd_mlp, digits, forget, target="minimiser", newton_max_steps=60, newton_rtol=1e-11,
                        newton_atol=1e-13)
    assert rec["newton"]["converged"] and rec["curvature"]["solvers"][0]["solver"] == "pcg-matrix-free"
    assert float(torch.linalg.vector_norm(head(exact) - oracle)) <= 1e-6 * span
    assert float(torch.linalg.vector_norm(head_gradient(exact, digits, forget) - r0)) <= 1e-9
    assert torch.equal(exact[1].weight, sgd_mlp[1].weight)  # the hidden layer never moves


@pytest.mark.parametrize("preconditioner", ["auto", "kronecker", "none"])
def test_decision_layer_newton_equals_converged_block_newton_where_that_converges(sgd_mlp, digits, preconditioner):
    newton, rec_n = run(sgd_mlp, digits, FORGET, target="minimiser", newton_max_steps=20,
                        newton_rtol=1e-10, newton_atol=1e-12)
    free, rec_f = run_dl(sgd_mlp, digits, FORGET, target="minimiser", newton_max_steps=40,
                         newton_rtol=1e-10, newton_atol=1e-12, newton_preconditioner=preconditioner)
    assert rec_n["newton"]["converged"] and rec_f["newton"]["converged"]
    expected = {"auto": "prepared H_P(D)^-1", "kronecker": "kronecker", "none": "none"}[preconditioner]
    assert rec_f["curvature"]["solvers"][0]["preconditioner"] == \
        f"{expected}, updated by the last 40 CG pairs (L-BFGS)"
    moved = float(torch.linalg.vector_norm(flat(newton) - flat(sgd_mlp)))
    assert float(torch.linalg.vector_norm(flat(newton) - flat(free))) <= 1e-7 * max(1.0, moved)


def test_decision_layer_newton_refuses_what_it_does_not_converge_and_rejects_other_blocks(sgd_mlp, digits):
    work = copy.deepcopy(sgd_mlp)
    method = get_method("decision-layer-newton")
    problem = RemovalProblem(work, softmax_task(), digits, torch.as_tensor(class_positions(digits)), LAMBDA, seed=1)
    with pytest.raises(RemovalNotServed, match="matrix-free Newton did not reach"):
        method.run(problem, method.Settings(parameters=HEAD, newton_max_steps=1, newton_rtol=1e-12, newton_atol=1e-14))
    assert torch.equal(flat(work), flat(sgd_mlp))  # nothing published
    with pytest.raises(ValueError, match="the decision-layer methods need a block that is the whole weight and bias"):
        method.run(problem, method.Settings(parameters=["1.weight", *HEAD]))
    # an output layer without a bias: refused by name, never solved with an undefined bias column
    no_bias = nn.Sequential(nn.Flatten(), nn.Linear(64, 10, bias=False)).double()
    problem = RemovalProblem(no_bias, softmax_task(), digits, torch.as_tensor(class_positions(digits)), LAMBDA, seed=1)
    with pytest.raises(ValueError, match="need an output layer with a bias"):
        method.run(problem, method.Settings(parameters=["1.weight"]))
    # no parameters named: the model's last module, when it is a Linear layer
    _, record = run_dl(sgd_mlp, digits, FORGET, parameters=[])
    assert [p["parameter"] for p in record["block"]["parts"]] == HEAD


def test_subsampled_and_float32_products_reach_the_same_minimiser(sgd_mlp, digits):
    """Hessian products on a subsample (curvature_samples) or in float32 (a float32 model) change
    the path, not the point: the gradient is exact, so the class-forgetting minimiser is the same."""
    forget = class_positions(digits)
    settings = dict(target="minimiser", newton_max_steps=80)
    full, _ = run_dl(sgd_mlp, digits, forget, newton_rtol=1e-11, newton_atol=1e-13, curvature_samples=None, **settings)
    # a subsampled Hessian converges linearly: a looser stop, ||w - w*|| <= ||grad|| / lambda
    sub, rec = run_dl(sgd_mlp, digits, forget, curvature_samples=300, newton_rtol=1e-9, newton_atol=1e-13,
                      **{**settings, "newton_max_steps": 200})
    assert rec["curvature"]["solvers"][0]["curvature_rows"] == 300 and rec["newton"]["converged"]
    moved = float(torch.linalg.vector_norm(flat(full) - flat(sgd_mlp)))
    assert moved > 1.0
    assert float(torch.linalg.vector_norm(flat(sub) - flat(full))) <= 1e-6 * moved

    single = copy.deepcopy(sgd_mlp).float()
    data32 = SampleSet({**digits.columns, "x": digits.columns["x"].float()}, digits.sample_ids)
    auto = "bfloat16" if native_bfloat16() else "float32"
    for products, dtype in (("layer", "float32"), ("bfloat16", "bfloat16"), ("auto", auto)):
        low, rec32 = run_dl(single, data32, forget, newton_rtol=1e-5, newton_atol=1e-9, curvature_products=products,
                            **settings)
        assert rec32["curvature"]["solvers"][0]["product_dtype"] == dtype and rec32["newton"]["converged"]
        assert float(torch.linalg.vector_norm(flat(low).double() - flat(full))) <= 1e-4 * moved


def test_bfloat16_curvature_products_are_within_their_stated_accuracy(sgd_mlp, digits):
    """bfloat16 curvature rows (float32 between the two products) give H V within the 2 eps_bf16
    relative accuracy CG is then held to (a few times better in fact), on the trained head at
    its own weights; the float32 products are within 100 eps_32."""
    model = copy.deepcopy(sgd_mlp).float()
    with torch.no_grad():
        feats = model[:-1](digits.columns["x"].float())
    x = torch.cat([feats, torch.ones(len(feats), 1)], 1)
    layer = model[-1]
    theta = torch.cat([layer.weight, layer.bias[:, None]], 1).detach().double()
    targets = torch.nn.functional.one_hot(digits.columns["y"].long(), 10).double()
    objectives = {dtype: SoftmaxLayerObjective(x, targets, 1e-3, torch.zeros_like(theta), theta, None, dtype)
                  for dtype in (torch.float32, torch.bfloat16)}
    exact = SoftmaxLayerObjective(x.double(), targets, 1e-3, torch.zeros_like(theta), theta, None, torch.float64)
    p = exact.probabilities(exact.logits(theta))
    v = torch.randn(theta.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = exact.hessian_product(p, v) - 1e-3 * v  # the data part, where the precision acts
    for dtype, objective in objectives.items():
        got = objective.hessian_product(p.to(objective.x.dtype), v) - 1e-3 * v
        error = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
        assert error <= objective.product_rtol, (dtype, error)
    assert objectives[torch.bfloat16].product_rtol == 2 * torch.finfo(torch.bfloat16).eps
    assert float(torch.linalg.vector_norm(objectives[torch.bfloat16].hessian_product(p.float(), v) - 1e-3 * v - want)) \
        > 10 * float(torch.linalg.vector_norm(objectives[torch.float32].hessian_product(p.float(), v) - 1e-3 * v - want))


@pytest.mark.parametrize("preconditioner", ["auto", "kronecker"])
def test_the_prepared_inputs_give_the_path_of_a_copy_of_the_retained_set(sgd_mlp, digits, preconditioner):
    """The prepared X~ of D with the forgotten rows masked (no copy of D_r per removal) takes the
    same path as a copy of D_r: same subsampled curvature rows, same CG iterations and residuals per
    step, same end point; a class (its rows all masked) included."""
    state = prepared_for(sgd_mlp, digits)
    assert state.inputs is not None and state.inputs.shape == (len(digits), sgd_mlp[3].in_features + 1)
    assert torch.equal(state.inputs_t, state.inputs.T)
    copied = dataclasses.replace(state, inputs=None, inputs_t=None)
    for forget in (FORGET, class_positions(digits)):
        common = dict(target="minimiser", newton_max_steps=40, newton_rtol=1e-7, newton_atol=1e-12,
                      curvature_samples=300, newton_preconditioner=preconditioner)
        masked, rec_m = run_dl(sgd_mlp, digits, forget, prepared=state, **common)
        copy_, rec_c = run_dl(sgd_mlp, digits, forget, prepared=copied, **common)
        s_m, s_c = rec_m["curvature"]["solvers"][0], rec_c["curvature"]["solvers"][0]
        assert s_m["inputs"] == "prepared X~ of D, forgotten rows masked" and s_c["inputs"].startswith("copy of D_r")
        # the first steps, before summation-order rounding can tip a CG stopping test (another
        # subsample would differ from the first step on)
        h_m, h_c = rec_m["newton"]["history"][:4], rec_c["newton"]["history"][:4]
        assert [h["iterations"] for h in h_m] == [h["iterations"] for h in h_c]
        for a, b in zip(h_m, h_c):
            assert abs(a["residual_norm_after"] - b["residual_norm_after"]) <= 1e-8 * b["residual_norm_after"]
        moved = float(torch.linalg.vector_norm(flat(copy_) - flat(sgd_mlp)))
        assert moved > 1e-3
        assert float(torch.linalg.vector_norm(flat(masked) - flat(copy_))) <= 1e-6 * moved  # both within rtol 1e-7


def test_prepared_training_gradient_gives_the_retained_gradient(sgd_mlp, digits):
    """The state holds grad_P L_D at its weights; a removal takes grad L_{D\\U} = (n grad L_D - g_U) /
    (n - m) from it (a pass over U only): the identity holds against a pass over D \\ U (a wrong n or
    a missing lambda term would not), and the removal starts from exactly that residual."""
    state = prepared_for(sgd_mlp, digits)
    block = ParamBlock.from_rows(sgd_mlp, {name: None for name in HEAD})
    expected = block_gradient(sgd_mlp, softmax_task(), digits, block, LAMBDA, reduction="mean")
    assert float(torch.linalg.vector_norm(state.training_gradient - expected)) <= 1e-12 * float(
        torch.linalg.vector_norm(expected))
    n, m = len(digits), len(FORGET)
    g_u = block_gradient(sgd_mlp, softmax_task(), digits.take(torch.as_tensor(FORGET)), block, LAMBDA, reduction="sum")
    retained = head_gradient(sgd_mlp, digits, FORGET)
    assert float(torch.linalg.vector_norm((n * state.training_gradient - g_u) / (n - m) - retained)) <= 1e-12
    _, record = run_dl(sgd_mlp, digits, FORGET, prepared=state, target="minimiser", newton_max_steps=40)
    assert record["gradient_norms"]["residual_before"] == pytest.approx(float(torch.linalg.vector_norm(retained)),
                                                                      rel=1e-10)


def test_layer_ordered_prepared_inverse_is_the_block_inverse_in_the_layer_layout(sgd_mlp, digits):
    """The prepared H_P(D)^{-1} the decision-layer Newton preconditions with is permuted once into the
    layer's (class, input-with-bias) layout and kept in the products' precision: applied to V it
    gives the block-ordered inverse's product (float64 exactly, float32 to its rounding), is
    symmetric, and is made once per layout and precision."""
    from pipeline.curvature.linear_layer import products_dtype
    from pipeline.curvature.softmax_layer import dense_preconditioner

    layer = sgd_mlp[3]
    k, d = layer.out_features, layer.in_features
    state = prepared_for(sgd_mlp, digits)
    # block order: the weight (k x d, row-major), then the bias (k); layer order: class * (d + 1) + input
    order = torch.cat([(torch.arange(k)[:, None] * (d + 1) + torch.arange(d)[None, :]).reshape(-1),
                       torch.arange(k) * (d + 1) + d])
    # made by the preparation (its seconds), in the products' precision: the first removal finds it
    made = state.layer_inverse_cache
    assert made is not None and made[1] == products_dtype(layer) and torch.equal(made[0], order)
    assert state.layer_inverse(order, products_dtype(layer)) is made[2]
    v = torch.randn(k, d + 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = (state.inverse @ v.reshape(-1)[order])                   # in block order
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        inverse = state.layer_inverse(order, dtype)
        assert inverse.dtype == dtype and torch.equal(inverse, inverse.T)
        got = dense_preconditioner(inverse, (k, d + 1))(v).reshape(-1)[order]
        assert float(torch.linalg.vector_norm(got - expected)) <= rtol * float(torch.linalg.vector_norm(expected))
        assert state.layer_inverse(order, dtype) is inverse               # kept, not rebuilt
    # a wrong layout (the block order taken as the layer's) is a different operator
    wrong = dense_preconditioner(state.inverse, (k, d + 1))(v).reshape(-1)[order]
    assert float(torch.linalg.vector_norm(wrong - expected)) > 0.1 * float(torch.linalg.vector_norm(expected))


def test_gradient_share_diagnostic_can_be_left_out_without_changing_the_removal(sgd_mlp, digits):
    """record_gradient_share: false skips the whole-model forget gradient (a diagnostic only): the
    record says None, and the weights are the same as with it."""
    common = dict(target="minimiser", newton_max_steps=20, newton_rtol=1e-7, newton_atol=1e-12)
    with_share, rec_a = run(sgd_mlp, digits, FORGET, **common)
    without, rec_b = run(sgd_mlp, digits, FORGET, record_gradient_share=False, **common)
    assert 0.0 < rec_a["gradient_share"]["forget_in_block"] < 1.0
    assert rec_b["gradient_share"]["forget_in_block"] is None
    assert torch.equal(flat(with_share), flat(without))


def test_recycled_preconditioner_is_the_lbfgs_update_of_its_base():
    """The CG pairs (s, H s) of one solve update a base inverse by L-BFGS: SPD, the secant equation
    P(H s) = s holds for the newest pair, and a full set of H-conjugate pairs reproduces H^-1
    whatever the base (a wrong sign or a missing rho in the two loops breaks all three)."""
    from pipeline.curvature.pcg import pcg
    from pipeline.curvature.softmax_layer import recycled_preconditioner

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    h = a @ a.T + 0.5 * torch.eye(12, dtype=torch.float64)
    b = torch.randn(12, generator=gen, dtype=torch.float64)

    def base(v):
        return 0.3 * v

    pairs = []
    pcg(lambda v: h @ v, b, precondition=base, rtol=1e-14, max_iter=12, pairs=pairs)
    assert len(pairs) == 12 and all(sy > 0 for _, _, sy in pairs)
    full = recycled_preconditioner(base, pairs)
    p_full = torch.stack([full(e) for e in torch.eye(12, dtype=torch.float64)], 1)
    assert float(torch.linalg.matrix_norm(p_full - torch.linalg.inv(h))) <= 1e-8 * float(torch.linalg.matrix_norm(
        torch.linalg.inv(h)))
    few = recycled_preconditioner(base, pairs[:4])
    s, y, _ = pairs[3]
    assert float(torch.linalg.vector_norm(few(y) - s)) <= 1e-10 * float(torch.linalg.vector_norm(s))
    p_few = torch.stack([few(e) for e in torch.eye(12, dtype=torch.float64)], 1)
    assert float(torch.linalg.matrix_norm(p_few - p_few.T)) <= 1e-10 and float(torch.linalg.eigvalsh(p_few).min()) > 0
    assert recycled_preconditioner(base, []) is base


def test_recycled_newton_reaches_the_same_class_forgetting_minimiser(sgd_mlp, digits):
    """newton_recycle changes the preconditioner of the later Newton systems, not the point: with
    and without it the decision-layer Newton ends at the same minimiser (a class forgotten)."""
    state = prepared_for(sgd_mlp, digits)
    common = dict(target="minimiser", newton_max_steps=60, newton_rtol=1e-9, newton_atol=1e-13)
    plain, rec_p = run_dl(sgd_mlp, digits, class_positions(digits), prepared=state, newton_recycle=0, **common)
    recycled, rec_r = run_dl(sgd_mlp, digits, class_positions(digits), prepared=state, **common)
    assert rec_p["newton"]["converged"] and rec_r["newton"]["converged"]
    assert "L-BFGS" in rec_r["curvature"]["solvers"][0]["preconditioner"]
    assert "L-BFGS" not in rec_p["curvature"]["solvers"][0]["preconditioner"]
    moved = float(torch.linalg.vector_norm(flat(plain) - flat(sgd_mlp)))
    assert moved > 1.0
    assert float(torch.linalg.vector_norm(flat(recycled) - flat(plain))) <= 1e-6 * moved


def test_float32_passes_reach_the_float64_minimiser_and_hand_over_where_they_cannot_resolve_the_tolerance():
    """Float32 inputs run the passes in float32 while their gradient can resolve the tolerance
    (the same minimiser as float64 passes, to that tolerance); where the rounding floor is above a
    quarter of the tolerance float64 passes certify the float32 end point, and where it is above
    the tolerance they finish the iteration (then the float64 point, to 1e-11 / lambda)."""
    from pipeline.curvature.newton import newton_minimise

    gen = torch.Generator().manual_seed(5)
    n, d, k, lam = 3000, 20, 5, 1e-3
    x = torch.cat([torch.relu(torch.randn(n, d, generator=gen)), torch.ones(n, 1)], 1)  # exact in float32
    y = torch.randint(0, k, (n,), generator=gen)
    y[: n // 2] = (x[: n // 2, :k]).argmax(1)  # half of the labels learnable, half noise: a real fit
    targets = nn.functional.one_hot(y, k).double()
    zero = torch.zeros(k, d + 1, dtype=torch.float64)
    keep = torch.ones(n, dtype=torch.bool)
    keep[::7] = False  # forgotten rows masked out

    def solve(inputs, tol):
        objective = SoftmaxLayerObjective(inputs, targets, lam, zero, zero, keep=keep)
        return newton_minimise(objective, zero, tol=tol, max_steps=60, preconditioner="kronecker"), objective

    exact, _ = solve(x.double(), 1e-13)
    assert exact.converged and exact.float64_from == 0 and exact.pass_dtype == "float64"
    loose, obj = solve(x, 1e-5)
    assert loose.converged and loose.pass_dtype == "float32" and loose.float64_from is None
    assert 0 < loose.gradient_floor <= 1e-6  # the floor it was trusted to, far below the tolerance
    h_min = lam  # F is lambda-strongly convex: ||theta - theta*|| <= ||grad F|| / lambda
    gap = float(torch.linalg.vector_norm(loose.theta - exact.theta))
    assert gap <= (1e-5 + loose.gradient_floor) / h_min, gap
    assert gap >= 1e-9  # float32 passes did not land on the float64 point by accident (not float64 in disguise)
    floor = loose.gradient_floor
    certified, obj = solve(x, 2 * floor)  # float32 can reach it, but not certify it alone
    assert certified.converged and certified.float64_from is not None and certified.pass_dtype == "float64"
    assert certified.gradient_norm <= 2 * floor and certified.gradient_floor == 0.0
    tight, obj = solve(x, 1e-11)
    assert tight.converged and tight.float64_from is not None and tight.float64_from >= 1
    assert tight.pass_dtype == "float64" and obj.pass_dtype == torch.float64 and obj.x.dtype == torch.float32
    assert float(torch.linalg.vector_norm(tight.theta - exact.theta)) <= 1e-11 / h_min


def test_objective_value_from_the_probabilities_equals_the_logsumexp_form():
    """F from (z, softmax z) (logsumexp = max z - log max p) is F from z alone, in float64 and
    float32 passes, with and without masked rows, also for logits far apart (no underflow)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(200, 6, generator=gen, dtype=torch.float64), torch.ones(200, 1, dtype=torch.float64)], 1)
    targets = torch.nn.functional.one_hot(torch.randint(0, 4, (200,), generator=gen), 4).double() * 0.9 + 0.025
    theta = 30 * torch.randn(4, 7, generator=gen, dtype=torch.float64)  # logits hundreds apart
    keep = torch.rand(200, generator=gen) > 0.2
    for dtype, rel in ((torch.float64, 1e-13), (torch.float32, 1e-6)):
        for mask in (None, keep):
            obj = SoftmaxLayerObjective(x.to(dtype), targets, 0.1, torch.zeros_like(theta), theta, keep=mask)
            z = obj.logits(theta)
            plain, fused = obj.value(theta, z), obj.value(theta, z, obj.probabilities(z))
            assert math.isfinite(fused) and abs(fused - plain) <= rel * abs(plain), (dtype, mask is None, plain, fused)


def test_native_bfloat16_needs_the_hardware_flags(monkeypatch):
    """``curvature_products: auto`` picks bfloat16 only on a CPU that lists AVX512-BF16 or AMX-BF16
    (oneDNN alone, or AVX-512 without them, would emulate it)."""
    import pipeline.curvature.linear_layer as lc

    monkeypatch.setattr(lc, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw"}))
    assert not lc.native_bfloat16("cpu")
    for flag in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(lc, "cpu_flags", lambda flag=flag: frozenset({"avx512f", flag}))
        assert lc.native_bfloat16("cpu") == bool(torch.backends.mkldnn.is_available())


def test_cg_never_steps_along_a_direction_of_non_positive_curvature():
    """Rounded products could report d^T H d <= 0: PCG then stops at once, stepping nowhere along it
    and reporting the Rayleigh quotient (the Newton iteration then takes the preconditioned
    gradient, a descent direction); on an SPD operator it converges."""
    from pipeline.curvature.pcg import pcg

    b = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    result = pcg(lambda v: -v, b, precondition=lambda v: 2 * v, rtol=1e-8, max_iter=50)
    assert result.iterations == 0 and result.rayleigh is not None and result.rayleigh < 0
    assert torch.equal(result.x, torch.zeros_like(b)) and not result.converged
    spd = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    result = pcg(lambda v: v @ spd, b, precondition=lambda v: v, rtol=1e-12, max_iter=50)
    assert result.converged and result.relative_residual <= 1e-12 and torch.allclose(result.x @ spd, b)


def test_cg_stops_on_a_vanished_residual_without_dividing_by_it():
    """A residual that becomes exactly zero (an exactly solvable system) ends PCG as converged, also
    from a start x0 and with no tolerance asked (rtol 0): no 0/0 in the next direction."""
    from pipeline.curvature.pcg import pcg

    a = torch.diag(torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64))
    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    result = pcg(lambda v: a @ v, b, precondition=lambda v: v / 2, x0=b / 2, rtol=0.0, max_iter=5)
    assert result.converged and result.relative_residual == 0.0 and torch.equal(result.x, b / 2)
    result = pcg(lambda v: a @ v, b, rtol=0.0, max_iter=5)
    assert result.converged and result.iterations == 1 and torch.equal(result.x, b / 2)


def test_matrix_free_curvature_rows_are_cut_to_the_memory_budget(sgd_mlp, digits):
    """The matrix-free iteration's arrays are sized from the memory budget: 1,250 curvature rows
    asked under a budget that holds its fixed arrays and 1,100 copied rows get 1,100 (a
    subsampled Hessian: the same minimiser, the cut recorded); one that cannot hold
    MIN_CURVATURE_ROWS is refused before anything is allocated, naming memory_budget."""
    from pipeline import memory
    from pipeline.curvature.softmax_layer import working_bytes
    from pipeline.methods.decision_layer_newton import MIN_CURVATURE_ROWS

    forget = class_positions(digits)
    n_retain = len(digits) - len(forget)
    assert n_retain > 1100 > MIN_CURVATURE_ROWS
    # the state prepared outside the budget, without its X~ (the removal then copies R) and with its
    # preconditioner already in the layer's layout (no bytes of its own)
    state = dataclasses.replace(prepared_for(sgd_mlp, digits), inputs=None, inputs_t=None)
    settings = dict(target="minimiser", newton_max_steps=200, newton_rtol=1e-9, newton_atol=1e-13,
                    prepared=state)
    full, rec_full = run_dl(sgd_mlp, digits, forget, curvature_samples=None, **settings)
    assert rec_full["curvature"]["solvers"][0]["curvature_rows"] == n_retain
    assert "curvature_rows_cut" not in rec_full["curvature"]["solvers"][0]
    k, d = sgd_mlp[3].weight.shape
    # float64 layer, no prepared X~ (R copied), the preconditioner already made, 40 recycled pairs, CG capped at 200
    fixed, per_row = working_bytes(n_retain, d, k, input_itemsize=8, curvature_itemsize=8, work_itemsize=8,
                                   copies_inputs=True, recycle=40, max_cg=200)
    # 1,250 rows asked (a subsample: copied rows), room for 1,100
    with memory.use_budget(memory.MemoryBudget(int(fixed + 1100.5 * per_row))):
        cut, rec = run_dl(sgd_mlp, digits, forget, curvature_samples=1250, **settings)
    solver = rec["curvature"]["solvers"][0]
    assert solver["curvature_rows"] == 1100 and "1250 curvature rows asked, 1100 fit" in solver["curvature_rows_cut"]
    moved = float(torch.linalg.vector_norm(flat(full) - flat(sgd_mlp)))
    assert rec["newton"]["converged"] and float(torch.linalg.vector_norm(flat(cut) - flat(full))) <= 1e-6 * moved
    with memory.use_budget(memory.MemoryBudget(int(fixed + (MIN_CURVATURE_ROWS - 1) * per_row))), \
            pytest.raises(memory.MemoryBudgetError, match=r"memory_budget .* cannot hold the matrix-free Newton iteration"
                                                          r" .* with 1024 curvature rows .* raise memory_budget"):
        run_dl(sgd_mlp, digits, forget, curvature_samples=1250, **settings)
