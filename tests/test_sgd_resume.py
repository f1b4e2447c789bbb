"""An SGD recipe resumed at a recorded epoch (``fit_sgd(start_epoch=k)``, ``pipeline.recipe.fit``): epoch e draws the
whole run's order and rate for epoch e, so without momentum (whose buffer a checkpoint does not keep) the resumed run
ends on the whole run's weights to the bit."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.recipe import Recipe, fit
from pipeline.trajectory import TrajectoryRecorder, load_checkpoint
from pipeline.training import fit_sgd
from tests.kit import digits64, softmax_task


@pytest.fixture(scope="module")
def digits():
    return digits64()["train"]


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)).double()


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_run_resumed_at_a_recorded_checkpoint_ends_on_the_whole_runs_weights(digits):
    recipe = Recipe(optimizer="sgd", epochs=5, lr=0.2, batch_size=64, momentum=0.0, weight_decay=1e-3, seed=3,
                    trajectory_checkpoints=5)
    whole = mlp(0)
    recorder = TrajectoryRecorder(whole, recipe)
    fit(whole, softmax_task(), digits, recipe, recorder)
    checkpoints = recorder.trajectory(len(digits)).checkpoints
    assert len(checkpoints) == 6
    for k in (0, 2, 4):
        resumed = mlp(1)  # other weights: the checkpoint replaces every one of them
        load_checkpoint(resumed, checkpoints[k])
        fit(resumed, softmax_task(), digits, recipe, start_epoch=k)
        assert torch.equal(weights(resumed), weights(whole)), k
    # the wrong orders (another seed) or the wrong rates (the schedule restarted: a fresh 3-epoch run from epoch 2's
    # checkpoint, the same 3 epochs of data) end elsewhere
    for changed, start in ((recipe.model_copy(update={"seed": 4}), 2), (recipe.model_copy(update={"epochs": 3}), 0)):
        resumed = mlp(1)
        load_checkpoint(resumed, checkpoints[2])
        fit(resumed, softmax_task(), digits, changed, start_epoch=start)
        assert (weights(resumed) - weights(whole)).norm() > 1e-3 * weights(whole).norm()
    with pytest.raises(ValueError, match="recorded from a run's start"):
        fit(mlp(1), softmax_task(), digits, recipe, TrajectoryRecorder(mlp(1), recipe), start_epoch=2)


def test_start_epoch_at_the_end_trains_nothing_and_outside_the_run_is_refused(digits):
    model = mlp(0)
    before = weights(model).clone()
    report = fit_sgd(model, softmax_task(), digits, 1e-3, epochs=3, lr=0.1, batch_size=64, start_epoch=3)
    assert torch.equal(weights(model), before) and report.steps == 0
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="start_epoch"):
            fit_sgd(copy.deepcopy(model), softmax_task(), digits, 1e-3, epochs=3, lr=0.1, batch_size=64,
                    start_epoch=bad)
    with pytest.raises(ValueError, match="lbfgs"):
        fit(model, softmax_task(), digits, Recipe(optimizer="lbfgs"), start_epoch=1)
