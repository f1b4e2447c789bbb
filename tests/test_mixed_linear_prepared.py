"""Prepared Mixed-Linear forgetting (output-layer user block, closed-form sums) against a dense
float64 oracle, the CG path and retraining (pipeline/mixed_linear_prepared.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipeline.linearized import LinearizedModel
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem, TrainedModel, prepare
from pipeline.methods.mixed_linear import (
    UserWeights, UserWeightsBindingError, forget_all_user_data, forget_user_data, train_user_weights, user_block,
)
from pipeline.mixed_linear_prepared import PreparedUserSums
from pipeline.tasks import DenseInputTask
from tests.kit import digits64
from tests.scrub_helpers import one_thread, rel  # noqa: F401  (fixture)
from tests.test_mixed_linear import dense_oracle, fitted_core

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 1e-2
RTOL = 1e-12


@pytest.fixture(scope="module")
def case():
    """Core MLP fitted loosely on 300 core digits; the user block is its output layer (16 x 10 + 10);
    400 other digits are the user data; user weights trained on them by CG."""
    model, task, user = fitted_core()
    block = user_block(model, last_modules=1)
    lin = LinearizedModel(model, task, block)
    w = train_user_weights(lin, user, LAMBDA, rtol=RTOL).user_weights
    return model, task, block, lin, user, w


def test_sums_give_the_exact_gradient_of_the_user_objective(case):
    """grad L_D from the prepared sums = the JVP/VJP gradient at any w_u (1e-10)."""
    from pipeline.methods.mixed_linear import UserObjective

    _, _, _, lin, user, w = case
    sums = PreparedUserSums.prepare(lin, user, LAMBDA, batch_size=97)
    assert sums.count == 400 and sums.gram.shape == (17, 17) and sums.cross.shape == (17, 10)
    probe = torch.randn(lin.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = UserObjective(lin, user, LAMBDA).gradient(probe)
    assert rel(sums.gradient(probe), expected) <= 1e-10
    assert float(torch.linalg.vector_norm(sums.gradient(w))) <= 1e-9 * float(torch.linalg.vector_norm(expected))


def test_prepared_forget_equals_retraining_the_cg_path_and_the_dense_oracle(case):
    _, _, _, lin, user, w = case
    forget_pos = torch.arange(0, 400, 7)  # 58 samples
    retain = user.without(forget_pos)
    sums = PreparedUserSums.prepare(lin, user, LAMBDA)
    new, retained_sums, record = sums.forget(lin, w, user.take(forget_pos))
    oracle = dense_oracle(lin, retain)
    retrained = train_user_weights(lin, retain, LAMBDA, rtol=RTOL).user_weights
    by_cg = forget_user_data(lin, w, retain, LAMBDA, rtol=RTOL).user_weights
    assert rel(w, oracle) > 1e-2  # the request mattered
    assert rel(new, oracle) <= 1e-9
    assert rel(new, retrained) <= 1e-9
    assert rel(new, by_cg) <= 1e-9
    assert record["path"] == "prepared-kronecker" and record["samples_retained"] == 342
    assert record["retain_gradient_norm_after"] <= 1e-12 * record["retain_gradient_norm_before"]
    # the returned sums are those of D_r, exactly as if prepared there
    fresh = PreparedUserSums.prepare(lin, retain, LAMBDA)
    assert retained_sums.count == 342 and retained_sums.sample_ids == fresh.sample_ids
    assert rel(retained_sums.gram, fresh.gram) <= 1e-12 and rel(retained_sums.cross, fresh.cross) <= 1e-12


def test_a_stale_sample_count_would_miss_the_retrained_weights(case):
    """The 2/(N_r K) of the retained objective matters: the same step with D's count N fails."""
    _, _, _, lin, user, w = case
    forget_pos = torch.arange(0, 400, 7)
    sums = PreparedUserSums.prepare(lin, user, LAMBDA)
    good, retained, _ = sums.forget(lin, w, user.take(forget_pos))
    stale = dataclasses.replace(retained, count=400)
    wrong = w - stale._flat(torch.linalg.solve(  # Theta - g A^{-1} with A, g built on N instead of N_r
        (2.0 / (400 * 10)) * stale.gram + LAMBDA * torch.eye(17, dtype=torch.float64),
        stale._theta(stale.gradient(w)).T).T)
    oracle = dense_oracle(lin, user.without(forget_pos))
    assert rel(good, oracle) <= 1e-9
    assert rel(wrong, oracle) > 1e-3


def bound(w, user):
    return UserWeights(w.clone(), LAMBDA, user.sample_ids.tolist())


def test_method_uses_the_sums_composes_and_keeps_the_binding(case):
    model, task, block, lin, user, w = case
    method = get_method("mixed-linear")
    settings = method.Settings()
    first = torch.arange(0, 400, 9)
    problem = RemovalProblem(model, task, user, first, LAMBDA, user_weights=bound(w, user))
    outcome = method.run(problem, settings)
    assert outcome.record["path"] == "prepared-kronecker"
    assert outcome.record["preparation"]["built_for_this_request"]
    # a second request against what the first left (user data D \ U1), from the sums it returned
    rest = user.without(first)
    after = TrainedModel(model, task, rest, LAMBDA, user_weights=outcome.user_weights)
    state = outcome.prepared.after_removal(after, first, outcome, method.binding(after, settings))
    assert state is not None and state.details["updated_from_removal"]
    second_ids = rest.sample_ids[torch.arange(0, len(rest), 11)].tolist()
    second = rest.positions_of(second_ids)
    outcome2 = method.run(RemovalProblem(model, task, rest, second, LAMBDA, user_weights=outcome.user_weights),
                          settings, state)
    assert not outcome2.record["preparation"]["built_for_this_request"]
    final = outcome2.user_weights.weights
    oracle = dense_oracle(lin, rest.without(second))
    assert rel(final, oracle) <= 1e-9
    assert outcome2.record["samples_retained"] == len(rest) - len(second)
    # sums of another lambda, of other data, or taken with another core (under a binding that claims
    # otherwise) are refused before anything changes
    good = outcome.prepared
    for bad in (dataclasses.replace(good.sums, weight_decay=2 * LAMBDA),
                dataclasses.replace(good.sums, sample_ids=frozenset(list(good.sums.sample_ids)[1:])),
                dataclasses.replace(good.sums, core=good.sums.core[::-1])):
        problem = RemovalProblem(model, task, user, first, LAMBDA, user_weights=bound(w, user))
        with pytest.raises(UserWeightsBindingError, match="prepare them again"):
            method.run(problem, settings, dataclasses.replace(good, sums=bad))
        assert torch.equal(problem.user_weights.weights, w)


def test_other_blocks_are_refused_with_the_fix(case):
    model, task, _, _, user, _ = case
    both = LinearizedModel(model, task, user_block(model, last_modules=2))
    with pytest.raises(ValueError, match="whole last Linear layer"):
        PreparedUserSums.prepare(both, user, LAMBDA)


def test_sums_of_a_changed_core_are_not_used(case):
    """phi and F_c depend on the core: one weight changed after preparing makes the sums stale; a
    removal handed them prepares anew (and says why) and lands on the oracle of the changed core."""
    model, task, block, lin, user, w = case
    method = get_method("mixed-linear")
    settings = method.Settings()
    state, _ = prepare(method, TrainedModel(model, task, user, LAMBDA), settings)
    with torch.no_grad():
        model[1].weight[0, 0] += 1e-3
    try:
        forget = torch.arange(3)
        outcome = method.run(RemovalProblem(model, task, user, forget, LAMBDA, user_weights=bound(w, user)),
                             settings, state)
        assert outcome.record["preparation"]["built_for_this_request"]
        assert "other weights or buffers" in outcome.record["preparation"]["why"]
        exact = dense_oracle(LinearizedModel(model, task, block), user.without(forget))
        assert rel(outcome.user_weights.weights, exact) <= 1e-9
    finally:
        with torch.no_grad():
            model[1].weight[0, 0] -= 1e-3


def test_sums_are_taken_in_eval_mode():
    """A core with dropout left in train mode: the method's preparation (the seam's eval-mode guard)
    gives the sums of the eval-mode core and restores the mode, so G_D - G_U is G of D_r whatever
    mode the caller left."""
    data = digits64()["train"].take(torch.arange(0, 200))
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 10)).double()
    lin = LinearizedModel(model, DenseInputTask(loss="mse"), user_block(model, last_modules=1))
    method = get_method("mixed-linear")
    model.train()
    in_train, _ = prepare(method, TrainedModel(model, DenseInputTask(loss="mse"), data, LAMBDA), method.Settings())
    assert model.training and model[3].training
    model.eval()
    in_eval = PreparedUserSums.prepare(lin, data, LAMBDA)
    assert torch.equal(in_train.sums.gram, in_eval.gram) and torch.equal(in_train.sums.cross, in_eval.cross)


def test_forgetting_every_user_sample_gives_zero_weights(case):
    """No data term left: the minimiser of (lambda/2)||w_u||^2 is 0, as on the CG path."""
    _, _, _, lin, user, w = case
    sums = PreparedUserSums.prepare(lin, user, LAMBDA)
    new, retained, record = sums.forget(lin, w, user)
    assert torch.count_nonzero(new) == 0 and retained.count == 0 and not retained.sample_ids
    assert record["forgot_all_user_data"] and record["samples_retained"] == 0
    assert torch.equal(retained.gradient(w), LAMBDA * w)
    assert torch.equal(new, forget_all_user_data(w))  # the CG path's answer for an empty D_r


def test_noise_is_added_secret_and_kept_out_of_the_returned_sums(case):
    """sigma > 0: the published weights are the exact step plus N(0, sigma^2 I) from the OS source
    (two runs differ; the deviation's norm is about sigma sqrt(dim)); the record carries no
    noise vector or seed; the returned sums are the noise-free sums of D_r."""
    model, task, block, lin, user, w = case
    method = get_method("mixed-linear")
    forget = torch.arange(0, 400, 13)
    exact = dense_oracle(lin, user.without(forget))
    sigma = 1e-2
    published, sums_after = [], []
    for _ in range(2):
        outcome = method.run(RemovalProblem(model, task, user, forget, LAMBDA, user_weights=bound(w, user)),
                             method.Settings(sigma=sigma))
        assert outcome.record["path"] == "prepared-kronecker"
        assert outcome.record["noise"] == {"sigma": sigma, "source": "os-csprng"}
        assert not any("seed" in str(k) for k in outcome.record["noise"])
        published.append(outcome.user_weights.weights.clone())
        sums_after.append(outcome.retained_sums)
    deviation = float(torch.linalg.vector_norm(published[0] - exact))
    expected = sigma * lin.dim ** 0.5
    assert 0.7 * expected <= deviation <= 1.3 * expected
    assert rel(published[0], published[1]) > 1e-3  # fresh noise each time, not a function of the inputs
    fresh = PreparedUserSums.prepare(lin, user.without(forget), LAMBDA)
    for retained in sums_after:
        assert rel(retained.gram, fresh.gram) <= 1e-12 and rel(retained.cross, fresh.cross) <= 1e-12
