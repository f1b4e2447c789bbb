"""The ``retrain`` target against Retrain itself (issue: the removal's target is Retrain's).

Models trained by the project's SGD recipe for a fixed budget (3 epochs, lr 0.1, batch 64, momentum
0.9, cosine, weight decay 1e-3) on the real digits in float64: softmax regression (convex) and an MLP
64-16-10. Retrain is the same recipe on D \\ U from the same w_init; 5 retrains with different shuffle
seeds give its mean and spread (weights: s = sqrt(sum ||r_i - r_bar||^2 / (K - 1)); an independent
retrain scores about sqrt(1 + 1/K) = 1.1 of it). The MLP is judged in function space: mean
KL(p_model || p_bar) on the test and forget sets in units of the retrains' own leave-one-out
spread. Floors: a random forget set within 1 spread of the retrains' mean, a whole class within 3 and
closer than both doing nothing and the exact minimiser of L_{D\\U}; each test prints the three.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.data import load_source
from pipeline.recipe import Recipe, fit, initial_model
from pipeline.removal import remove
from pipeline.training import fit_lbfgs, fit_newton
from tests.kit import trained_model_dir

RECIPE = {"optimizer": "sgd", "epochs": 3, "lr": 0.1, "batch_size": 64, "weight_decay": 1e-3, "momentum": 0.9,
          "seed": 0}
RETRAINS = 5
MLP = {"hidden": [16]}


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float64)


@pytest.fixture(scope="module")
def digits():
    return load_source("digits", {"dtype": "float64"})


def forget_sets(train) -> dict[str, torch.Tensor]:
    n = len(train)
    labels = train.columns["y"].long()
    return {"random": torch.randperm(n, generator=torch.Generator().manual_seed(11))[: n // 10].sort().values,
            "class": torch.nonzero(labels == 3).squeeze(1)}


def retrain_ensemble(preset: str, options: dict, train, forget: torch.Tensor) -> list[torch.nn.Module]:
    """Retrain: the recipe on D \\ U from the original's w_init, shuffled with seeds 1..K."""
    keep = torch.ones(len(train), dtype=torch.bool)
    keep[forget] = False
    retained = train.take(torch.nonzero(keep).squeeze(1))
    models = []
    for seed in range(1, RETRAINS + 1):
        model, task, _ = initial_model(preset, options, seed=0)
        model = model.to(torch.float64)
        fit(model, task, retained, Recipe.model_validate({**RECIPE, "seed": seed}))
        models.append(model.eval())
    return models


def minimiser(model_dir: Path, preset: str, options: dict, train, forget: torch.Tensor) -> torch.nn.Module:
    """The exact minimiser of L_{D\\U}: 20 L-BFGS steps from the trained weights into the basin, then damped
    Newton (dense Hessian) to ||grad|| <= 1e-10. L-BFGS alone stalled: 400 steps left ||grad|| 2.3e-9 (MLP, 8 s
    and 20 s on 2 cores); these take 5 s, reach ~1e-15, and land 2.4e-5 (random) and 2.7e-5 (class) from the
    stalled point, in its basin (Newton alone from the trained weights went to another minimiser, 9.1 away)."""
    from tests.kit import load_in_dtype

    model, task = load_in_dtype(model_dir, preset, options, torch.float64)
    keep = torch.ones(len(train), dtype=torch.bool)
    keep[forget] = False
    retained = train.take(torch.nonzero(keep).squeeze(1))
    fit_lbfgs(model, task, retained, RECIPE["weight_decay"], max_steps=20, tolerance=1e-10)
    report = fit_newton(model, task, retained, RECIPE["weight_decay"], tolerance=1e-10)
    assert report.gradient_norm <= 1e-10, report
    return model.eval()


def ids_of(train, positions: torch.Tensor) -> list[int]:
    return train.sample_ids[positions].tolist()


def weights_after(model_dir: Path, ids: list[int], method: str, settings: dict | None = None) -> tuple[torch.Tensor, dict]:
    run = remove(model_dir, ids, method=method, settings=settings or {})
    return torch.cat([v.reshape(-1) for k, v in run.new_state.items()]).to(torch.float64), run.record


@pytest.fixture(scope="module")
def linear_case(tmp_path_factory, digits):
    directory = trained_model_dir(tmp_path_factory.mktemp("linear-sgd"), "linear", dtype="float64", recipe=RECIPE)
    return directory


@pytest.fixture(scope="module")
def mlp_case(tmp_path_factory, digits):
    return trained_model_dir(tmp_path_factory.mktemp("mlp-sgd"), "mlp", MLP, dtype="float64", recipe=RECIPE)


@pytest.mark.parametrize("scenario", ["random", "class"])
def test_convex_target_lands_within_the_retrains_spread(linear_case, digits, scenario):
    train = digits["train"]
    forget = forget_sets(train)[scenario]
    retrains = torch.stack([flat(m) for m in retrain_ensemble("linear", {}, train, forget)])
    mean = retrains.mean(0)
    spread = float((retrains - mean).pow(2).sum().div(RETRAINS - 1).sqrt())

    def distance(w: torch.Tensor) -> float:
        return float((w - mean).norm()) / spread

    from tests.kit import load_in_dtype

    original, _ = load_in_dtype(linear_case, "linear", {}, torch.float64)
    ours, record = weights_after(linear_case, ids_of(train, forget), "decision-layer-newton")
    exact = flat(minimiser(linear_case, "linear", {}, train, forget))
    d_ours, d_nothing, d_exact = distance(ours), distance(flat(original)), distance(exact)
    print(f"softmax regression, {scenario}: target {d_ours:.2f}, doing nothing {d_nothing:.2f}, "
          f"exact minimiser {d_exact:.2f} spreads")
    assert record["target"]["how"] == "replay" and record["newton"]["converged"]
    if scenario == "random":
        assert d_ours <= 1.0
    else:
        assert d_ours <= 3.0 and d_ours < d_nothing and d_ours < d_exact
    # the minimiser setting lands on the minimiser (the other target, the same path)
    minimised, rec = weights_after(linear_case, ids_of(train, forget), "decision-layer-newton",
                                   {"target": "minimiser", "newton_rtol": 1e-8})
    assert rec["target"]["how"] == "minimiser"
    assert float((minimised - exact).norm()) <= 1e-3 * float((exact - flat(original)).norm())


def function_space(model: torch.nn.Module, retrains: list[torch.nn.Module], x: torch.Tensor) -> float:
    """mean_x KL(p_model || p_bar) / mean_j mean_x KL(p_j || p_bar_{-j})."""
    with torch.no_grad():
        logp = [torch.log_softmax(r(x), -1) for r in retrains]
        p = torch.stack([lp.exp() for lp in logp])

        def kl(lq: torch.Tensor, p_ref: torch.Tensor) -> float:
            return float((lq.exp() * (lq - p_ref.log())).sum(-1).mean())

        own = sum(kl(logp[j], torch.cat([p[:j], p[j + 1:]]).mean(0)) for j in range(len(retrains))) / len(retrains)
        return kl(torch.log_softmax(model(x), -1), p.mean(0)) / own


@pytest.mark.parametrize("scenario", ["random", "class"])
def test_mlp_target_lands_within_the_retrains_spread_in_function_space(mlp_case, digits, scenario):
    from pipeline.models.registry import build
    from pipeline.checkpoint import load_into
    from tests.kit import load_in_dtype

    train, test = digits["train"], digits["test"]
    forget = forget_sets(train)[scenario]
    retrains = retrain_ensemble("mlp", MLP, train, forget)
    original, _ = load_in_dtype(mlp_case, "mlp", MLP, torch.float64)
    run = remove(mlp_case, ids_of(train, forget), method="lfoci-newton", settings={"selection": "all"})
    ours, _ = build("mlp", MLP)
    ours = ours.to(torch.float64)
    load_into(ours, run.new_state)
    exact = minimiser(mlp_case, "mlp", MLP, train, forget)
    cells = {}
    for name, x in (("test", test.columns["x"]), ("forget", train.take(forget).columns["x"])):
        cells[name] = {label: function_space(m.eval(), retrains, x)
                       for label, m in (("target", ours), ("nothing", original), ("minimiser", exact))}
    print(f"MLP, {scenario}: " + "; ".join(f"{k}: " + ", ".join(f"{a} {b:.2f}" for a, b in v.items())
                                            for k, v in cells.items()) + " (retrain spreads)")
    assert run.record["target"]["how"] == "replay"
    for name, c in cells.items():
        if scenario == "random":
            assert c["target"] <= 1.0, name
        else:
            assert c["target"] <= 3.0 and c["target"] < c["nothing"] and c["target"] < c["minimiser"], name


def test_one_setting_is_one_point_on_every_path(linear_case, digits):
    """target: retrain gives the same layer on the decision-layer path, the block Newton path and the
    stream's fast path (a class removal, where paths used to disagree by many spreads)."""
    from pipeline.stream_removal import WarmStreamRemover
    from pipeline.streaming import StreamSettings

    train = digits["train"]
    ids = ids_of(train, forget_sets(train)["class"])
    layer, _ = weights_after(linear_case, ids, "decision-layer-newton", {"newton_rtol": 1e-9})
    block, rec = weights_after(linear_case, ids, "lfoci-newton", {"selection": "parameters",
                                                                 "parameters": ["1.weight", "1.bias"]})
    assert rec["target"]["how"] == "replay"
    from tests.kit import load_in_dtype

    original, _ = load_in_dtype(linear_case, "linear", {}, torch.float64)
    moved = float((layer - flat(original)).norm())
    # the same replay through two oracles (closed form, torch.func): rounding may move a refresh of the
    # trust region by a step (measured 3e-4 of the move, a few hundredths of a retrain spread)
    assert float((block - layer).norm()) <= 1e-2 * moved
    stream = WarmStreamRemover("decision-layer-newton", {}, StreamSettings(refresh_every=1))
    run = stream.remove(linear_case, ids)
    served = torch.cat([v.reshape(-1) for v in run.new_state.values()]).to(torch.float64)
    assert run.record["target"]["how"] == "replay" and run.record["fast_path"]["target_reached"]
    assert float((served - layer).norm()) <= run.record["fast_path"]["distance_to_target_bound"] + 1e-2 * moved
