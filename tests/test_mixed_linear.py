"""Mixed-Linear forgetting against exact float64 oracles (shared/REFERENCE.md sections 4, 5)."""
from __future__ import annotations

import copy

import json
import threading

import pytest
import torch
from torch import nn

from pipeline.data import SampleSet
from pipeline.linearized import LinearizedModel, output_targets
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.methods.mixed_linear import (
    USER_WEIGHT_PREFIX, GaussNewtonOperator, UserObjective, UserWeights, UserWeightsBindingError,
    forget_all_user_data, forget_user_data, newton_step, read_user_weights, save_user_weights,
    train_user_weights, user_block, user_state,
)
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs
from tests.kit import digits64
from tests.scrub_helpers import assert_yaml_mirrors_settings, one_thread, rel  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 1e-2
RTOL = 1e-12


def fitted_core() -> tuple[nn.Sequential, DenseInputTask, SampleSet]:
    """Core MLP 64-16-10 trained (loosely) on 300 core digits, eval mode; 400 other digits are
    the user data; the user objective's task (MSE)."""
    data = digits64()["train"]
    core_data, user = data.take(torch.arange(0, 300)), data.take(torch.arange(300, 700))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    fit_lbfgs(model, DenseInputTask(loss="cross_entropy"), core_data, 1e-3, max_steps=3, tolerance=1e-6)
    model.eval()
    return model, DenseInputTask(loss="mse"), user


@pytest.fixture(scope="module")
def setup():
    model, task, user = fitted_core()
    block = user_block(model, last_modules=2)  # both Linear layers: 1,210 user weights
    lin = LinearizedModel(model, task, block)
    return model, task, block, lin, user


def dense_oracle(lin: LinearizedModel, data: SampleSet) -> torch.Tensor:
    """argmin (1/(N K)) ||f_c + J u - Y||^2 + (lambda/2)||u||^2 by a dense solve."""
    jac = torch.cat([lin.jacobian(b) for b in data.batches(100)])
    f0 = torch.cat([lin.base_outputs(b) for b in data.batches(100)])
    y = output_targets(data.columns["y"], f0.shape[1], f0.dtype)
    nk = f0.numel()
    h = 2.0 / nk * jac.T @ jac + LAMBDA * torch.eye(lin.dim, dtype=torch.float64)
    return torch.linalg.solve(h, -2.0 / nk * jac.T @ (f0 - y).reshape(-1))


@pytest.mark.parametrize("cache", [True, False])
def test_training_solves_the_quadratic(setup, cache):
    _, _, _, lin, user = setup
    result = train_user_weights(lin, user, LAMBDA, rtol=RTOL, cache=cache)
    assert result.solve.converged
    assert rel(result.user_weights, dense_oracle(lin, user)) <= 1e-8
    assert result.record["gradient_norm_after"] <= 1e-9 * result.record["gradient_norm_before"]
    assert result.record["hessian_scale"] == pytest.approx(2.0 / (400 * 10))


@pytest.fixture(scope="module")
def trained(setup):
    _, _, _, lin, user = setup
    return train_user_weights(lin, user, LAMBDA, rtol=RTOL).user_weights


def test_forgetting_equals_retraining(setup, trained):
    _, _, _, lin, user = setup
    forget = torch.arange(0, 400, 7)  # 58 samples
    retain = user.without(forget)
    out = forget_user_data(lin, trained, retain, LAMBDA, rtol=RTOL)
    oracle = dense_oracle(lin, retain)
    assert rel(out.user_weights, oracle) <= 1e-6
    assert rel(trained, oracle) > 1e-2  # the request mattered
    retrained = train_user_weights(lin, retain, LAMBDA, rtol=RTOL).user_weights
    assert rel(out.user_weights, retrained) <= 1e-6


def test_hessian_scale_mismatch_would_fail(setup, trained):
    """A Hessian J^T J/(N K) + lambda I (factor 2 off the MSE's) misses the retrained weights."""
    _, _, _, lin, user = setup
    retain = user.without(torch.arange(0, 400, 7))
    oracle = dense_oracle(lin, retain)
    objective = UserObjective(lin, retain, LAMBDA)
    good, _, _ = newton_step(objective, trained, rtol=RTOL)
    bad, _, _ = newton_step(objective, trained, operator=GaussNewtonOperator(objective, scale=objective.scale / 2),
                            rtol=RTOL)
    assert rel(good, oracle) <= 1e-6
    assert rel(bad, oracle) > 1e-2, rel(bad, oracle)


def test_zeroing_reproduces_the_core_model(setup, trained):
    model, _, _, lin, user = setup
    zero = forget_all_user_data(trained)
    batch = user.columns
    with torch.no_grad():
        core = model(batch["x"])
    assert torch.equal(lin.predict(batch, zero), core)
    assert not torch.equal(lin.predict(batch, trained), core)


def test_sequential_requests_equal_one_combined(setup, trained):
    _, _, _, lin, user = setup
    first, second = torch.arange(0, 40), torch.arange(40, 90)
    after_first = forget_user_data(lin, trained, user.without(first), LAMBDA, rtol=RTOL).user_weights
    both = torch.cat([first, second])
    after_second = forget_user_data(lin, after_first, user.without(both), LAMBDA, rtol=RTOL).user_weights
    combined = forget_user_data(lin, trained, user.without(both), LAMBDA, rtol=RTOL).user_weights
    assert rel(after_second, combined) <= 1e-6


def _rank_copies(lin: LinearizedModel, size: int) -> list[LinearizedModel]:
    """One model per 'rank', as real ranks have: torch.func.functional_call swaps the module's
    parameters in place while it runs, so two threads must never share one module."""
    copies = []
    for _ in range(size):
        model = copy.deepcopy(lin.model)
        copies.append(LinearizedModel(model, lin.task, user_block(model, last_modules=2)))  # the setup's block
    return copies


class ThreadGroup:
    """An in-process stand-in for torch.distributed.all_reduce across ``size`` threads."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)

    def allreduce(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            return total

        return reduce

    def run(self, work) -> list:
        """``work(rank, allreduce)`` on every rank in its own thread; the results by rank."""
        results = [None] * self.size

        def one(rank: int) -> None:
            results[rank] = work(rank, self.allreduce(rank))

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def _two_shards(data):
    return [data.take(torch.arange(0, len(data), 2)), data.take(torch.arange(1, len(data), 2))]


def test_sharded_reduction_matches_single_process(setup, trained):
    """Two 'ranks' with disjoint shards and a summing allreduce give the single-process result."""
    _, _, _, lin, user = setup
    retain = user.without(torch.arange(0, 400, 7))
    shards = _two_shards(retain)
    lins = _rank_copies(lin, 2)
    results = ThreadGroup(2).run(lambda rank, reduce: forget_user_data(
        lins[rank], trained, shards[rank], LAMBDA, rtol=RTOL, allreduce=reduce).user_weights)
    single = forget_user_data(lin, trained, retain, LAMBDA, rtol=RTOL).user_weights
    assert torch.equal(results[0], results[1])
    assert rel(results[0], single) <= 1e-9


def test_noise_is_secret_and_scaled(setup, trained):
    """The noise comes from the OS CSPRNG: two runs differ (nothing seeds it), its std is sigma,
    and the record holds nothing that could regenerate it."""
    _, _, _, lin, user = setup
    retain = user.without(torch.arange(0, 10))
    exact = forget_user_data(lin, trained, retain, LAMBDA, rtol=RTOL).user_weights
    runs = [forget_user_data(lin, trained, retain, LAMBDA, rtol=RTOL, sigma=0.05) for _ in range(2)]
    assert not torch.equal(runs[0].user_weights, runs[1].user_weights)
    noise = runs[0].user_weights - exact
    assert float(noise.std()) == pytest.approx(0.05, rel=0.1)  # 1,210 draws: std error ~2%
    assert abs(float(noise.mean())) < 5 * 0.05 / noise.numel() ** 0.5
    assert "seed" not in json.dumps(runs[0].record)
    assert runs[0].record["noise"] == {"sigma": 0.05, "source": "os-csprng"}


def test_noise_is_the_same_on_every_rank(setup, trained):
    """Two 'ranks': only the root draws; the all-reduce hands every rank the same noise."""
    _, _, _, lin, user = setup
    retain = user.without(torch.arange(0, 10))
    shards = _two_shards(retain)
    lins = _rank_copies(lin, 2)
    results = ThreadGroup(2).run(lambda rank, reduce: forget_user_data(
        lins[rank], trained, shards[rank], LAMBDA, rtol=RTOL, sigma=0.05, root=rank == 0, allreduce=reduce).user_weights)
    exact = forget_user_data(lin, trained, retain, LAMBDA, rtol=RTOL).user_weights
    assert torch.equal(results[0], results[1])
    assert float((results[0] - exact).std()) == pytest.approx(0.05, rel=0.1)


def test_removal_method_wrapper(setup, trained):
    model, task, block, lin, user = setup
    forget = torch.tensor([3, 30, 300])
    method = get_method("mixed-linear")
    bound = UserWeights(trained.clone(), LAMBDA, user.sample_ids.tolist())
    problem = RemovalProblem(model, task, user, forget, LAMBDA, user_weights=bound)
    outcome = method.run(problem, method.Settings(user_last_modules=2, cg_rtol=RTOL))
    direct = forget_user_data(lin, trained, user.without(forget), LAMBDA, rtol=RTOL).user_weights
    assert rel(outcome.user_weights.weights, direct) <= 1e-9
    assert outcome.user_weights.sample_ids == user.without(forget).sample_ids.tolist()
    assert torch.equal(bound.weights, trained)  # the problem's own user weights are not changed
    keys = {USER_WEIGHT_PREFIX + n for n in ("1.weight", "1.bias", "3.weight", "3.bias")}
    assert set(outcome.new_parameters) == keys
    assert outcome.record["samples_retained"] == 397
    json.dumps(outcome.record)
    with pytest.raises(ValueError, match="user_weights"):
        method.run(RemovalProblem(model, task, user, forget, LAMBDA), method.Settings())
    assert_yaml_mirrors_settings("mixed-linear")


def test_forget_refuses_another_lambda_or_other_data(setup, trained):
    """Issue 11 item 6: user weights carry their lambda and data; a forget against another
    lambda, other data, or with unbound weights is refused before anything is computed."""
    model, task, _, _, user = setup
    method = get_method("mixed-linear")
    settings = method.Settings(user_last_modules=2)
    forget = torch.tensor([3])
    wrong_lambda = UserWeights(trained.clone(), 2 * LAMBDA, user.sample_ids.tolist())
    with pytest.raises(UserWeightsBindingError, match="weight decay"):
        method.run(RemovalProblem(model, task, user, forget, LAMBDA, user_weights=wrong_lambda), settings)
    fewer = UserWeights(trained.clone(), LAMBDA, user.sample_ids.tolist()[1:])
    with pytest.raises(UserWeightsBindingError, match="other data"):
        method.run(RemovalProblem(model, task, user, forget, LAMBDA, user_weights=fewer), settings)
    with pytest.raises(UserWeightsBindingError, match="UserWeights"):
        method.run(RemovalProblem(model, task, user, forget, LAMBDA, user_weights=trained.clone()), settings)


def test_user_weights_file_keeps_its_binding(setup, trained, tmp_path):
    model, _, block, _, user = setup
    state = user_state(block, model, trained)
    save_user_weights(tmp_path / "u.safetensors", UserWeights(state, LAMBDA, user.sample_ids.tolist()[::-1]))
    back = read_user_weights(tmp_path / "u.safetensors")
    assert back.weight_decay == LAMBDA and back.sample_ids == sorted(user.sample_ids.tolist())
    assert all(torch.equal(back.weights[k], v) for k, v in state.items())
