"""The recipe replay's oracles (pipeline.target.oracles) against dense references: the softmax layer's
closed-form gradient and Gauss-Newton matrix against autograd's gradient and Hessian (exact for a layer
whose logits are linear in its weights), the module-block oracle against the closed form on the same
layer, and the subsampled curvature against the full oracle on the shared samples; the replay with a
subsampled curvature against the replay with the full one."""
from __future__ import annotations

import torch
from torch import nn

from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.target.oracles import ModuleBlockOracle, SoftmaxLayerOracle, SubsampledCurvature
from pipeline.target.replay import ReplaySchedule, prepare_replay, replay_target
from pipeline.tasks import DenseInputTask

N, D, K = 120, 5, 4


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (N,), generator=g)
    theta = 0.5 * torch.randn(K, D + 1, generator=g, dtype=torch.float64)
    return x, y, theta


def _mean_ce(theta_flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    theta = theta_flat.reshape(K, D + 1)
    logits = x @ theta[:, :D].T + theta[:, D]
    return nn.functional.cross_entropy(logits, y)


def test_softmax_layer_oracle_equals_autograd_gradient_and_hessian():
    x, y, theta = _problem()
    oracle = SoftmaxLayerOracle(torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1),
                                nn.functional.one_hot(y, K).to(torch.float64), chunk=37)
    idx = torch.arange(0, N, 3)
    w = theta.reshape(-1)
    ref_grad = torch.func.grad(_mean_ce)(w, x[idx], y[idx])
    ref_hess = torch.func.hessian(_mean_ce)(w, x[idx], y[idx])
    assert torch.allclose(oracle.grad(w, idx), ref_grad, rtol=1e-10, atol=1e-13)
    assert torch.allclose(oracle.curvature(w, idx), ref_hess, rtol=1e-10, atol=1e-13)


def test_module_block_oracle_equals_the_closed_form_on_the_last_layer():
    x, y, theta = _problem(1)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, K)).to(torch.float64)
    with torch.no_grad():
        model[2].weight.copy_(theta[:, :D])
        model[2].bias.copy_(theta[:, D])
        hidden = model[1](model[0](x))
    data = SampleSet({"x": x, "y": y}, torch.arange(N))
    block = ParamBlock.from_rows(model, {"2.weight": None, "2.bias": None})
    module = ModuleBlockOracle(model, DenseInputTask(loss="cross_entropy"), data, block, chunk=50)
    closed = SoftmaxLayerOracle(torch.cat([hidden, torch.ones(N, 1, dtype=torch.float64)], 1),
                                nn.functional.one_hot(y, K).to(torch.float64))
    idx = torch.arange(N)
    w = module.w_ref
    # the block's order (weight rows, then bias) against the closed form's class-major [W | b] rows
    perm = torch.cat([torch.arange(K * D).reshape(K, D), K * D + torch.arange(K).reshape(K, 1)], 1).reshape(-1)
    assert torch.allclose(module.grad(w, idx)[perm], closed.grad(theta.reshape(-1), idx), atol=1e-12)
    assert torch.allclose(module.curvature(w, idx)[perm][:, perm], closed.curvature(theta.reshape(-1), idx),
                          atol=1e-12)


def test_subsampled_curvature_is_the_oracles_on_the_shared_samples_and_leaves_the_rest_exact():
    x, y, theta = _problem(2)
    oracle = SoftmaxLayerOracle(torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1),
                                nn.functional.one_hot(y, K).to(torch.float64))
    subsample = torch.arange(0, N, 4)
    sub = SubsampledCurvature(oracle, subsample)
    w = theta.reshape(-1)
    retained = torch.arange(N)[torch.arange(N) % 5 != 0]
    shared = retained[torch.isin(retained, subsample)]
    assert torch.equal(sub.curvature(w, retained), oracle.curvature(w, shared))
    assert not torch.allclose(sub.curvature(w, retained), oracle.curvature(w, retained))
    assert torch.equal(sub.grad(w, retained), oracle.grad(w, retained))
    assert torch.equal(sub.outputs(w, retained), oracle.outputs(w, retained))
    # no shared sample: the samples asked
    assert torch.equal(sub.curvature(w, torch.tensor([1, 2, 3])), oracle.curvature(w, torch.tensor([1, 2, 3])))


def test_replay_with_a_subsampled_curvature_converges_to_the_full_replay():
    """The replay with G on a subsample S: on every sample it is the full replay exactly; on fewer its
    target departs by the estimate's error, which shrinks as S grows (measured 0.22, 0.14, 0.08 of the
    replay's move for a quarter, half and three quarters of 120 samples: at real sizes S is thousands).
    A curvature summed instead of averaged, or taken on the wrong samples, departs by far more."""
    x, y, _ = _problem(3)
    oracle = SoftmaxLayerOracle(torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1),
                                nn.functional.one_hot(y, K).to(torch.float64))
    schedule = ReplaySchedule(epochs=4, lr=0.1, momentum=0.9, batch_size=16, weight_decay=1e-3)
    w_init = 0.1 * torch.randn(K * (D + 1), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    forget = torch.arange(0, 24)
    prepared = prepare_replay(oracle, schedule, w_init)
    full, _ = replay_target(oracle, prepared, forget)
    move = float((full - prepared.w_mean_field).norm())
    assert move > 0
    order = torch.randperm(N, generator=torch.Generator().manual_seed(1))

    def departure(size: int) -> float:
        sub = SubsampledCurvature(oracle, order[:size])
        target, _ = replay_target(sub, prepare_replay(sub, schedule, w_init), forget)
        return float((target - full).norm()) / move

    assert departure(N) == 0.0
    quarter, half, most = departure(N // 4), departure(N // 2), departure(3 * N // 4)
    assert most < quarter and half <= 0.25, (quarter, half, most)


def test_the_decision_layers_difference_form_drops_an_emptied_class_own_offset():
    """theta_0 + replay(D \\ U) - replay(D) row by row; a class with no retained sample keeps the mean
    offset of the retained classes, not its own (pipeline.decision_layer.LayerReplay)."""
    from pipeline.decision_layer import LayerReplay

    x, y, _ = _problem(4)
    schedule = ReplaySchedule(epochs=3, lr=0.1, momentum=0.9, batch_size=16, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(5)
    theta_init = 0.1 * torch.randn(K * (D + 1), generator=gen, dtype=torch.float64)
    theta_origin = torch.randn(K * (D + 1), generator=gen, dtype=torch.float64)
    inputs = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    replay = LayerReplay.build(inputs, y, torch.arange(N), 0.0, K, schedule, theta_init, theta_origin, False)
    offset = (theta_origin - replay.prepared.w_mean_field).reshape(K, D + 1)
    # the row algebra on one replay's output (two replays of one removal agree only to the adaptive refresh
    # rule's rounding where threads reorder sums: 0.0067 apart on two threads, measured)
    # a random removal: every row keeps its own offset
    keep = torch.ones(N, dtype=torch.bool)
    keep[:10] = False
    plain, _ = replay_target(replay.oracle, replay.prepared, torch.arange(10), labels=y)
    assert torch.allclose(replay._difference_form(plain, y, keep), plain + offset.reshape(-1), atol=1e-12)
    # class 2 emptied: its row takes the mean offset of classes 0, 1, 3; the others their own
    keep = y != 2
    plain, _ = replay_target(replay.oracle, replay.prepared, torch.nonzero(~keep).squeeze(1), labels=y)
    rows, base = replay._difference_form(plain, y, keep).reshape(K, D + 1), plain.reshape(K, D + 1)
    for c in (0, 1, 3):
        assert torch.allclose(rows[c], base[c] + offset[c], atol=1e-12)
    assert torch.allclose(rows[2], base[2] + offset[[0, 1, 3]].mean(0), atol=1e-12)
    # and replay.target is that form of the replay of the same removal (to the replay's own rounding)
    target, _ = replay.target(torch.nonzero(keep).squeeze(1))
    assert float((target.reshape(K, D + 1) - rows).abs().max()) <= 0.05 * float(rows.abs().max())
    assert not torch.allclose(rows[2], base[2] + offset[2], atol=1e-3)
