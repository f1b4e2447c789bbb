"""NegGrad+, SCRUB and l1-sparse against hand-computed oracles (float64, tiny models).

Each oracle is written independently of the method's code (explicit softmax, explicit sign(w),
explicit update loops); beside each, a variant with a flipped sign, a missing T factor, a missing
term or an undecayed schedule is shown to land far outside the tolerance, so the tests have the
power to catch exactly those mistakes. Limiting cases reproduce fine-tuning bit for bit (same
seeded batches), and parameters outside ``settings.parameters`` never change."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.data.sampleset import SampleSet
from pipeline.methods import RemovalProblem, get_method
from pipeline.methods.base import stream_seed
from pipeline.methods.finetune import FINETUNE_STREAM, FORGET_ORDER_STREAM, RetainEpochs
from pipeline.methods.l1_sparse import l1_weight
from pipeline.methods.scrub import bernoulli_kl, gaussian_kl, softmax_kl
from pipeline.tasks import DenseInputTask
from tests.scrub_helpers import assert_yaml_mirrors_settings, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

N, D, H, K = 60, 5, 6, 3
M = 12
LAMBDA = 0.01
TOL = 1e-10


def _problem(seed: int = 0, *, hidden: bool = True, task: DenseInputTask | None = None) -> RemovalProblem:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen, dtype=torch.float64)
    w_true = torch.randn(D, K, generator=gen, dtype=torch.float64)
    task = task or DenseInputTask()
    if task.loss == "cross_entropy":
        y = (x @ w_true).argmax(1)
    elif task.loss == "bce_multilabel":
        y = (x @ w_true > 0).double()
    else:
        y = x @ w_true
    torch.manual_seed(seed)
    layers = [nn.Linear(D, H), nn.Tanh(), nn.Linear(H, K)] if hidden else [nn.Linear(D, K)]
    model = nn.Sequential(*layers).double()
    data = SampleSet({"x": x, "y": y}, torch.arange(N) + 1000)
    return RemovalProblem(model, task, data, torch.arange(M), LAMBDA, seed=seed, batch_size=N)


def _run(name: str, problem: RemovalProblem, **settings):
    method = get_method(name)
    return method.run(problem, method.Settings(**settings))


def _ce(model: nn.Module, data: SampleSet) -> torch.Tensor:
    return nn.functional.cross_entropy(model(data.columns["x"]), data.columns["y"])


def _l2(model: nn.Module) -> torch.Tensor:
    return 0.5 * LAMBDA * sum(p.pow(2).sum() for p in model.parameters())


def _sgd_step(model: nn.Module, objective: torch.Tensor, lr: float) -> None:
    grads = torch.autograd.grad(objective, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(lr * g)


def _max_diff(a: dict[str, torch.Tensor], b: nn.Module) -> float:
    return max(float((a[k] - p.detach()).abs().max()) for k, p in b.named_parameters())


@pytest.mark.parametrize("name", ["neggrad-plus", "scrub", "l1-sparse"])
def test_configs_mirror_settings(name: str) -> None:
    assert_yaml_mirrors_settings(name)


# -- NegGrad+ ------------------------------------------------------------------------------------

def test_neggrad_plus_with_alpha_one_is_finetune_weight_for_weight() -> None:
    common = dict(epochs=2, lr=0.2, momentum=0.9, batch_size=16, retain_samples=30)
    ft = _run("finetune", _problem(), **common)
    ng = _run("neggrad-plus", _problem(), alpha=1.0, forget_batch_size=5, **common)
    assert ng.record["steps"] == ft.record["steps"] == 2 * 2  # ceil(30 / 16) steps per epoch
    for k, v in ft.new_parameters.items():
        assert torch.equal(ng.new_parameters[k], v), k
    assert ng.record["retain_loss"]["samples"] <= 2 * 30


def test_neggrad_plus_one_full_batch_step_is_the_balanced_objective() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    alpha, lr = 0.3, 0.5
    out = _run("neggrad-plus", problem, alpha=alpha, epochs=1, lr=lr, momentum=0.0, batch_size=N, forget_batch_size=N)
    expected, flipped = copy.deepcopy(before), copy.deepcopy(before)
    _sgd_step(expected, alpha * _ce(expected, problem.retain) - (1 - alpha) * _ce(expected, problem.forget)
              + _l2(expected), lr)
    _sgd_step(flipped, alpha * _ce(flipped, problem.retain) + (1 - alpha) * _ce(flipped, problem.forget)
              + _l2(flipped), lr)
    assert _max_diff(out.new_parameters, expected) < TOL
    assert _max_diff(out.new_parameters, flipped) > 1e-3  # a wrong sign on the forget term is far off


def test_neggrad_plus_pairs_each_retain_batch_with_the_cycled_forget_batches() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    lr, alpha, rb, fb = 0.2, 0.6, 8, 5
    out = _run("neggrad-plus", problem, alpha=alpha, epochs=1, lr=lr, momentum=0.0, batch_size=rb, forget_batch_size=fb)
    # the same seeded orders, paired by hand: retain batch i with forget chunk i mod 3 (sizes 5, 5, 2)
    retain_gen = torch.Generator().manual_seed(stream_seed(0, FINETUNE_STREAM))
    retain_epochs = RetainEpochs(problem.retain, None, 1, rb, retain_gen)
    order = torch.randperm(M, generator=torch.Generator().manual_seed(stream_seed(0, FORGET_ORDER_STREAM)))
    chunks = [order[0:5], order[5:10], order[10:12]]
    model = copy.deepcopy(before)
    forget = problem.forget
    steps = 0
    for i, batch in enumerate(retain_epochs(0)):
        fx = forget.take(chunks[i % 3])
        obj = (alpha * nn.functional.cross_entropy(model(batch["x"]), batch["y"])
               - (1 - alpha) * _ce(model, fx) + _l2(model))
        _sgd_step(model, obj, lr)
        steps += 1
    assert steps == out.record["steps"] == 6  # 48 retained samples in batches of 8: the forget set cycles twice
    assert _max_diff(out.new_parameters, model) < TOL


def test_neggrad_plus_with_alpha_zero_raises_the_forget_loss() -> None:
    problem = _problem(hidden=False)
    for _ in range(200):  # fit D (full-batch gradient descent): the forget loss starts low
        _sgd_step(problem.model, _ce(problem.model, problem.train) + _l2(problem.model), 1.0)
    out = _run("neggrad-plus", problem, alpha=0.0, epochs=5, lr=2.0, momentum=0.0, batch_size=N)
    assert out.record["forget_loss"]["before"] < 0.3
    assert out.record["forget_loss"]["after"] > out.record["forget_loss"]["before"] + 1.0
    assert float(_ce(problem.model, problem.forget).detach()) == pytest.approx(out.record["forget_loss"]["after"])
    assert out.record["retain_loss"]["samples"] == N - M


# -- SCRUB -----------------------------------------------------------------------------------------

def _softmax_kl_by_hand(student: torch.Tensor, teacher: torch.Tensor, T: float, power: int = 2) -> torch.Tensor:
    p_s = torch.exp(student / T) / torch.exp(student / T).sum(1, keepdim=True)
    p_t = torch.exp(teacher / T) / torch.exp(teacher / T).sum(1, keepdim=True)
    return T ** power * (p_t * (p_t.log() - p_s.log())).sum(1).mean()


def test_softmax_kl_value_and_gradient_carry_the_temperature() -> None:
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(7, K, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randn(7, K, generator=gen, dtype=torch.float64)
    T = 4.0
    value = softmax_kl(s, t, T)
    assert float(value.detach()) == pytest.approx(float(_softmax_kl_by_hand(s, t, T).detach()), rel=1e-12)
    (g,) = torch.autograd.grad(value, s)
    # d/ds of T^2 (1/B) sum KL(p_t || softmax(s / T)) = (T / B) (softmax(s / T) - p_t)
    analytic = (T / 7) * (torch.softmax(s / T, 1) - torch.softmax(t / T, 1))
    assert torch.allclose(g, analytic, atol=1e-14)
    assert float(softmax_kl(t, t, T)) == pytest.approx(0.0, abs=1e-14)


def test_bernoulli_and_gaussian_divergences_by_hand() -> None:
    gen = torch.Generator().manual_seed(4)
    s, t = torch.randn(5, 4, generator=gen, dtype=torch.float64), torch.randn(5, 4, generator=gen, dtype=torch.float64)
    T = 2.0
    ps, pt = torch.sigmoid(s / T), torch.sigmoid(t / T)
    hand = T ** 2 * (pt * (pt / ps).log() + (1 - pt) * ((1 - pt) / (1 - ps)).log()).mean(1).mean()
    assert float(bernoulli_kl(s, t, T)) == pytest.approx(float(hand), rel=1e-12)
    assert float(gaussian_kl(s, t, T)) == pytest.approx(float(((s - t) ** 2).mean()), rel=1e-12)
    assert float(gaussian_kl(s, t, T)) == pytest.approx(float(gaussian_kl(s, t, 1.0)), rel=1e-15)


def _scrub_by_hand(problem: RemovalProblem, model0: nn.Module, *, lr: float, alpha: float, gamma: float, T: float,
                   epochs: int, max_steps: int, max_sign: float = -1.0, power: int = 2,
                   min_divergence: bool = True) -> nn.Module:
    """Algorithm 1 with full batches and plain SGD: max_sign = -1 ascends d on D_f (the right sign)."""
    teacher, student = copy.deepcopy(model0), copy.deepcopy(model0)
    xf, xr, yr = problem.forget.columns["x"], problem.retain.columns["x"], problem.retain.columns["y"]
    with torch.no_grad():
        tf, tr = teacher(xf), teacher(xr)
    for epoch in range(epochs):
        if epoch < max_steps:
            _sgd_step(student, max_sign * _softmax_kl_by_hand(student(xf), tf, T, power), lr)
        out = student(xr)
        obj = gamma * nn.functional.cross_entropy(out, yr) + _l2(student)
        if min_divergence:
            obj = obj + alpha * _softmax_kl_by_hand(out, tr, T, power)
        _sgd_step(student, obj, lr)
    return student


def test_scrub_max_and_min_steps_are_the_published_objectives() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    kw = dict(lr=0.8, alpha=0.7, gamma=0.9, T=3.0, epochs=3, max_steps=2)
    out = _run("scrub", problem, epochs=3, max_steps=2, lr=kw["lr"], momentum=0.0, batch_size=N, forget_batch_size=N,
               alpha=kw["alpha"], gamma=kw["gamma"], temperature=kw["T"])
    assert out.record["steps"] == {"max": 2, "min": 3}
    expected = _scrub_by_hand(problem, before, **kw)
    assert _max_diff(out.new_parameters, expected) < TOL
    # the oracle has the power to see each mistake: max-step sign, the T^2 factor, the min-step divergence
    for wrong in (dict(max_sign=1.0), dict(power=0), dict(power=1), dict(min_divergence=False)):
        gap = _max_diff(out.new_parameters, _scrub_by_hand(problem, before, **kw, **wrong))
        assert gap > 1e-6, (wrong, gap)
    # and the run ends away from the teacher on D_f
    assert out.record["forget_divergence"]["after"] > 0


def test_scrub_first_max_pass_starts_at_the_teacher_and_moves_nothing() -> None:
    """Eval mode: the student starts at the teacher, where d and its gradient vanish (up to rounding)."""
    problem = _problem()
    problem.weight_decay = 0.0
    before = copy.deepcopy(problem.model)
    out = _run("scrub", problem, epochs=1, max_steps=1, lr=1.0, momentum=0.0, batch_size=N, forget_batch_size=4,
               alpha=0.0, gamma=0.0)
    assert out.record["steps"] == {"max": 3, "min": 1}
    assert _max_diff(out.new_parameters, before) < 1e-14


def test_scrub_one_max_step_gradient_is_minus_the_kl_gradient() -> None:
    """One SGD step on -d from a student away from the teacher: w + lr grad d, d by hand."""
    from pipeline.methods.scrub import divergence_for, teacher_forward

    problem = _problem()
    teacher = {k: p.detach().clone() for k, p in problem.model.named_parameters()}
    with torch.no_grad():  # move the student off the teacher
        for p in problem.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7), dtype=p.dtype))
    student = copy.deepcopy(problem.model)
    batch = problem.forget.columns
    T = 4.0
    d = divergence_for(problem.task)
    model, task = problem.model, problem.task
    objective = -d(task.forward(model, batch), teacher_forward(model, task, batch, teacher), T)
    grads = torch.autograd.grad(objective, list(problem.model.parameters()))
    teacher_model = copy.deepcopy(student)
    with torch.no_grad():
        for k, p in teacher_model.named_parameters():
            p.copy_(teacher[k])
    hand = _softmax_kl_by_hand(student(batch["x"]), teacher_model(batch["x"]).detach(), T)
    hand_grads = torch.autograd.grad(hand, list(student.parameters()))
    for g, h in zip(grads, hand_grads):
        assert torch.allclose(g, -h, atol=1e-13)
        assert float(h.abs().max()) > 1e-3


@pytest.mark.parametrize("loss", ["bce_multilabel", "mse"])
def test_scrub_runs_for_the_other_losses(loss: str) -> None:
    problem = _problem(task=DenseInputTask(loss=loss))
    out = _run("scrub", problem, epochs=3, max_steps=2, lr=0.5, batch_size=16, forget_batch_size=6, alpha=0.5)
    assert out.record["forget_divergence"]["after"] > 0
    assert all(bool(torch.isfinite(v).all()) for v in out.new_parameters.values())


def test_scrub_refuses_more_max_steps_than_epochs() -> None:
    with pytest.raises(ValueError, match="max_steps"):
        get_method("scrub").Settings(epochs=2, max_steps=3)


# -- l1-sparse -------------------------------------------------------------------------------------

def test_l1_weight_decays_linearly_from_gamma_to_gamma_over_epochs() -> None:
    assert l1_weight(0.2, 0, 4) == 0.2
    assert l1_weight(0.2, 3, 4) == pytest.approx(0.05)
    out = _run("l1-sparse", _problem(), epochs=4, gamma=0.2, lr=0.01, batch_size=N)
    assert out.record["l1_weights"] == pytest.approx([0.2, 0.15, 0.1, 0.05])
    assert out.record["l1_norm"]["after"] < out.record["l1_norm"]["before"]


def test_l1_sparse_with_gamma_zero_is_finetune_weight_for_weight() -> None:
    common = dict(epochs=3, lr=0.2, momentum=0.9, batch_size=16, retain_samples=30)
    ft = _run("finetune", _problem(), **common)
    l1 = _run("l1-sparse", _problem(), gamma=0.0, **common)
    for k, v in ft.new_parameters.items():
        assert torch.equal(l1.new_parameters[k], v), k


def test_l1_sparse_full_batch_epochs_follow_the_schedule() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    lr, gamma, epochs = 0.3, 0.05, 2
    out = _run("l1-sparse", problem, epochs=epochs, gamma=gamma, lr=lr, momentum=0.0, batch_size=N)

    def by_hand(weights: list[float]) -> nn.Module:
        model = copy.deepcopy(before)
        for g_t in weights:
            grads = torch.autograd.grad(_ce(model, problem.retain) + _l2(model), list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p.sub_(lr * (g + g_t * torch.sign(p)))
        return model

    assert _max_diff(out.new_parameters, by_hand([gamma, gamma / 2])) < TOL
    assert _max_diff(out.new_parameters, by_hand([gamma, gamma])) > 1e-3   # no decay
    assert _max_diff(out.new_parameters, by_hand([0.0, 0.0])) > 1e-3       # no penalty


# -- all three ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["neggrad-plus", "scrub", "l1-sparse"])
def test_parameters_not_selected_never_change(name: str) -> None:
    problem = _problem()
    before = {k: v.detach().clone() for k, v in problem.model.state_dict().items()}
    extra = {"max_steps": 2, "lr": 0.5} if name == "scrub" else {}
    out = _run(name, problem, **{"parameters": ["2.weight"], "epochs": 3, "batch_size": 16, **extra})
    assert list(out.new_parameters) == ["2.weight"] and out.record["parameters"] == ["2.weight"]
    after = problem.model.state_dict()
    for k, v in before.items():
        if k == "2.weight":
            assert not torch.equal(after[k], v)
        else:
            assert torch.equal(after[k], v), k


@pytest.mark.parametrize("name", ["neggrad-plus", "scrub", "l1-sparse"])
def test_batchnorm_and_dropout_models_run_in_eval_mode_and_repeat_exactly(name: str) -> None:
    """Batch-norm statistics untouched, dropout off (a removal repeats bit for bit), modes restored."""
    def make() -> RemovalProblem:
        problem = _problem()
        torch.manual_seed(1)
        problem.model = nn.Sequential(nn.Linear(D, H), nn.BatchNorm1d(H), nn.ReLU(), nn.Dropout(0.5),
                                      nn.Linear(H, K)).double()
        problem.model.train()
        with torch.no_grad():  # non-trivial running statistics
            problem.model(problem.train.columns["x"])
        return problem

    extra = {"lr": 0.5} if name == "scrub" else {}
    first, second = make(), make()
    buffers = {k: v.clone() for k, v in first.model.named_buffers()}
    a = _run(name, first, epochs=2, batch_size=16, **extra)
    b = _run(name, second, epochs=2, batch_size=16, **extra)
    for k, v in a.new_parameters.items():
        assert torch.equal(v, b.new_parameters[k]), k
    assert all(torch.equal(v, buffers[k]) for k, v in first.model.named_buffers())
    assert first.model.training and a.record["retain_loss"]["after"] < a.record["retain_loss"]["before"]
