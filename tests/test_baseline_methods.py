"""The field's reference approximate methods as registered removal methods: fine-tune, gradient
ascent, random labels, SalUn. Oracles: one full-batch step equals the hand-computed update
(a wrong sign or a missing term moves it by lr * ||grad||, far above the tolerance), the forget
loss moves the right way, SalUn leaves every weight outside its mask bit-identical."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.data.sampleset import SampleSet
from pipeline.methods import RemovalProblem, get_method
from pipeline.methods.random_labels import random_other_labels
from pipeline.methods.salun import saliency_masks
from pipeline.tasks import DenseInputTask
from tests.scrub_helpers import assert_yaml_mirrors_settings

N, D, K = 60, 5, 3
LAMBDA = 0.01


def _problem(seed: int = 0, m: int = 12) -> RemovalProblem:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen, dtype=torch.float64)
    w_true = torch.randn(D, K, generator=gen, dtype=torch.float64)
    y = (x @ w_true).argmax(1)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D, K)).double()
    data = SampleSet({"x": x, "y": y}, torch.arange(N) + 1000)
    return RemovalProblem(model, DenseInputTask(), data, torch.arange(m), LAMBDA, seed=seed, batch_size=N)


def _mean_loss(model: nn.Module, data: SampleSet) -> torch.Tensor:
    return nn.functional.cross_entropy(model(data.columns["x"]), data.columns["y"])


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [k for k, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


@pytest.mark.parametrize("name", ["finetune", "gradient-ascent", "random-labels", "salun", "lfoci-newton"])
def test_configs_mirror_settings(name: str) -> None:
    assert_yaml_mirrors_settings(name)


def test_gradient_ascent_one_step_is_plus_lr_gradient_and_raises_forget_loss() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    forget = problem.forget
    g = _grads(before, _mean_loss(before, forget))
    lr = 0.5
    method = get_method("gradient-ascent")
    out = method.run(problem, method.Settings(epochs=1, lr=lr, momentum=0.0, batch_size=N))
    for name, p in before.named_parameters():
        assert torch.allclose(out.new_parameters[name], p.detach() + lr * g[name], atol=1e-12)
        assert float((lr * g[name]).abs().max()) > 1e-3  # the step is not negligible
    assert out.record["forget_loss"]["after"] > out.record["forget_loss"]["before"] + 1e-3
    assert float(_mean_loss(problem.model, forget).detach()) == pytest.approx(out.record["forget_loss"]["after"])


def test_finetune_one_step_descends_the_retained_objective() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    retain = problem.retain
    objective = _mean_loss(before, retain) + 0.5 * LAMBDA * sum(p.pow(2).sum() for p in before.parameters())
    g = _grads(before, objective)
    lr = 0.3
    method = get_method("finetune")
    out = method.run(problem, method.Settings(epochs=1, lr=lr, momentum=0.0, batch_size=N))
    for name, p in before.named_parameters():
        assert torch.allclose(out.new_parameters[name], p.detach() - lr * g[name], atol=1e-12)
    assert float(_mean_loss(problem.model, retain).detach()) < float(_mean_loss(before, retain).detach()) - 1e-3


def test_random_other_labels_differ_and_are_uniform() -> None:
    y = torch.arange(6000) % 4
    new = random_other_labels(y, 4, torch.Generator().manual_seed(0))
    assert bool((new != y).all())
    for cls in range(4):
        counts = torch.bincount(new[y == cls], minlength=4).double() / 1500
        assert counts[cls] == 0
        others = counts[torch.arange(4) != cls]
        assert torch.allclose(others, torch.full_like(others, 1 / 3), atol=0.05)


def test_random_labels_one_step_uses_relabelled_forget_set_and_retain() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    method = get_method("random-labels")
    lr = 0.3
    out = method.run(problem, method.Settings(epochs=1, lr=lr, momentum=0.0, batch_size=10 * N))
    # the hand-computed objective with the same seeded relabelling
    from pipeline.methods.random_labels import relabelled_forget

    relabelled = relabelled_forget(_problem())
    assert bool((relabelled.columns["y"] != problem.forget.columns["y"]).all())
    x = torch.cat([relabelled.columns["x"], problem.retain.columns["x"]])
    y = torch.cat([relabelled.columns["y"], problem.retain.columns["y"]])
    objective = nn.functional.cross_entropy(before(x), y) + 0.5 * LAMBDA * sum(p.pow(2).sum() for p in before.parameters())
    g = _grads(before, objective)
    for name, p in before.named_parameters():
        assert torch.allclose(out.new_parameters[name], p.detach() - lr * g[name], atol=1e-12)
    # with the true labels instead the step would differ by far more than the tolerance
    true_obj = _mean_loss(before, problem.train) + 0.5 * LAMBDA * sum(p.pow(2).sum() for p in before.parameters())
    g_true = _grads(before, true_obj)
    assert max(float((g[k] - g_true[k]).abs().max()) for k in g) > 1e-2


def test_random_labels_raise_forget_loss_where_finetune_does_not() -> None:
    from pipeline.training import fit_lbfgs

    losses = {}
    for name in ("random-labels", "finetune"):
        problem = _problem()
        fit_lbfgs(problem.model, problem.task, problem.train, LAMBDA, max_steps=50)
        method = get_method(name)
        out = method.run(problem, method.Settings(epochs=40, lr=0.5, momentum=0.5, batch_size=N))
        losses[name] = out.record["forget_loss"]
    # the trained model fits D_f; relabelling pushes its loss up, plain fine-tuning keeps it low
    assert losses["random-labels"]["after"] > losses["random-labels"]["before"] + 0.3
    assert losses["random-labels"]["after"] > losses["finetune"]["after"] + 0.3


def test_salun_mask_is_top_gradient_and_only_masked_weights_change() -> None:
    problem = _problem()
    before = copy.deepcopy(problem.model)
    g = _grads(before, _mean_loss(before, problem.forget))
    flat = torch.cat([v.abs().flatten() for v in g.values()])
    masks = saliency_masks(g, 0.25)
    kept = torch.cat([m.flatten() for m in masks.values()])
    assert int(kept.sum()) == round(0.25 * flat.numel())
    assert float(flat[kept > 0].min()) >= float(flat[kept == 0].max())
    method = get_method("salun")
    out = method.run(problem, method.Settings(epochs=3, lr=0.3, momentum=0.9, batch_size=N, sparsity=0.25))
    assert out.record["mask"]["kept"] == int(kept.sum())
    for name, p in before.named_parameters():
        new, old, mask = out.new_parameters[name], p.detach(), masks[name] > 0
        assert torch.equal(new[~mask], old[~mask])  # bit-identical outside the mask
        assert bool((new[mask] != old[mask]).all())  # every salient weight moved
