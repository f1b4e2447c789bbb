"""bench.trajectory_pushes: the recipe replayed through fit_sgd's batch hook ends on the saved weights to the bit,
its exact pushes of all of D are the run's data displacement, and the smoke run writes the comparison."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from bench import trajectory_pushes as tp
from pipeline.recipe import init_of, initial_model, recipe_of
from pipeline.removal import load_trained


def test_the_exact_pushes_of_all_of_d_are_the_runs_data_displacement(tmp_path: Path) -> None:
    """Sum_k c_k (mean batch gradient) over every step is w_0 - w_K less lambda sum_k c_k w_k (heavy ball from b = 0,
    c_k = sum_{j >= k} eta_j beta^(j-k)): a missing factor (1/B, c_k, the decay's share) or a step read at the wrong
    weights breaks it; and a U and its complement split the pushes exactly."""
    tp.train_model(tp.PROFILES["smoke"], tmp_path / "model")
    trained = load_trained(tmp_path / "model")
    recipe, data = recipe_of(trained.card), trained.train
    names = [k for k, p in trained.model.named_parameters() if p.requires_grad]

    def replayed(forget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
        start, _, _ = initial_model(trained.card.preset, trained.card.options, seed=recipe.seed,
                                    init=init_of(trained.card))
        pushes, means, decay = tp.exact_pushes(start, trained.task, data, recipe, forget)
        assert len(means) == recipe.epochs
        return pushes, decay, start

    everything, decay, model = replayed(torch.arange(len(data)))
    saved = trained.model.state_dict()
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved if saved[k].is_floating_point())
    first, last = (torch.cat([c[k].reshape(-1).double() for k in names])
                   for c in (trained.trajectory.checkpoints[0], trained.trajectory.checkpoints[-1]))
    assert torch.allclose(everything, first - last - decay, rtol=1e-4, atol=1e-6)
    assert float((first - last).norm()) > 10 * float((everything - (first - last - decay)).norm())
    half = torch.arange(0, len(data), 2)
    rest = torch.arange(1, len(data), 2)
    assert torch.allclose(replayed(half)[0] + replayed(rest)[0], everything, rtol=1e-4, atol=1e-7)


def test_the_smoke_run_writes_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    assert tp.main(["--smoke", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["replay"]["bitwise_equal_to_the_saved_model"] is True and d["profile"] == "smoke"
    for part in (d["all_of_D"]["trapezium"], d["forget_set"]["trapezium"], d["forget_set"]["midpoint"]):
        assert -1.0 <= part["cosine"] <= 1.0 and part["norm"] > 0 and part["relative_error"] >= 0
    table = d["added_back_without_refit"]
    assert set(table) == {"original", "exact", "midpoint", "trapezium"} and table["exact"][0]["scale"] == 0.3
    assert d["m"] == round(0.25 * d["n"])
