"""suffix-retrain (pipeline/methods/suffix_retrain.py): a network's trailing layers set back to the recipe's start
and trained again with the recipe on the retained data, over the frozen prefix's outputs.

  (a) with scope_cost_share 1 and the recipe's epochs it is Retrain: the model the card's recipe trains on
      D \\ U from its own start (``pipeline.recipe.train``), to float rounding;
  (b) with a prefix (a Sequential CNN, no batch norm) the prefix is the trained model's to the bit and the suffix
      is what the recipe's ``fit`` makes of the recipe's start with the prefix frozen, also with other epochs,
      batch size and learning rate;
  (c) on the re-ID ResNet (batch norm in both parts) the suffix's statistics are re-estimated on D \\ U (its
      batch counts are the suffix's steps) and written into the version and the in-memory model, the prefix's kept;
      a run that fails half-way leaves every parameter and buffer as it was;
  (d) the prepared state carries to the next version and serves it as a fresh one does, and is not carried once
      the prefix moved;
  (e) an L-BFGS recipe is retrained as it is (Retrain, to 1e-9 in float64) and refuses the SGD settings; frozen
      parameters and non-persistent buffers are not part of the scope's state;
  (f) bad input: a model without its card, settings out of range, a prefix cache over the memory budget;
  (g) where nothing outside the scope moved from the recipe's start (a text model's frozen lower layers, the cut at
      its first trained layer) the record says the result depends on the retained data alone, and it is Retrain
      (``pipeline.recipe.train`` on D \\ U) to float rounding; where the prefix was trained, it says which entries;
  (h) ``prefix_pushes_scale`` s: the prefix moves by exactly s (1 / n) sum_k W_k G_U,P(c_k) (the trapezium over the
      recorded checkpoints, G_U,P summed by hand with autograd), and the suffix is the recipe's fit over the moved
      prefix's outputs on D \\ U; the prepared state (no prefix outputs: each removal computes its own) carries and
      serves the next version as a fresh one does; a model without its recorded run, a recorded run of another model
      and prefix outputs over the memory budget are refused, naming the setting, the parameter or the budget, before
      anything moved.
"""
from __future__ import annotations

import pydantic
import pytest
import torch

from pipeline.methods import RemovalProblem, get_method
from pipeline.methods.base import parse_settings
from pipeline.models.card import read_card
from pipeline.recipe import fit, initial_model, recipe_of, train
from pipeline.removal import load_trained, remove, training_set

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = {"optimizer": "sgd", "epochs": 3, "lr": 0.05, "batch_size": 64, "momentum": 0.9, "weight_decay": 5e-4,
          "seed": 3}
CNN = {"channels": [8, 16], "pool": [1, 2], "hidden": [32], "image_size": 8}
REID = {"num_classes": 6, "layers": [1, 1, 1, 1], "width": 4, "image_size": 16}
IDENTITIES = {"ids": 6, "per_id_train": 10, "per_id_test": 2, "height": 16, "width": 8, "seed": 0}


@pytest.fixture(scope="module")
def cnn_dir(tmp_path_factory):
    from tests import kit

    return kit.trained_model_dir(tmp_path_factory.mktemp("cnn"), "cnn", CNN, data_options={"flatten": False},
                                 recipe=RECIPE)


@pytest.fixture(scope="module")
def reid_dir(tmp_path_factory):
    from tests import kit

    return kit.trained_model_dir(tmp_path_factory.mktemp("reid"), "reid-resnet50", REID, source="synthetic-identities",
                                 data_options=IDENTITIES, recipe={**RECIPE, "batch_size": 16})


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """A 4-layer BERT of width 32 (seeded, MiniLM's tokenizer) with its last layer, pooler and head trained on a few
    Reuters R8 stories, the embeddings and lower layers frozen where the recipe started them."""
    from bench.deep_forgetting import tiny_text_model
    from tests import kit

    tiny = tiny_text_model(tmp_path_factory.mktemp("tiny-bert") / "tiny-bert")
    return kit.trained_model_dir(
        tmp_path_factory.mktemp("text"), "text",
        {"model_path": str(tiny), "num_labels": 8, "train_last_layers": 1, "dropout": 0.0}, source="reuters-r8",
        data_options={"tokenizer": "all-MiniLM-L6-v2", "max_length": 12, "per_class": 6, "test_per_class": 3},
        recipe={**RECIPE, "epochs": 2, "batch_size": 8})


def _forget(model_dir, every: int = 7) -> list[int]:
    return training_set(read_card(model_dir)).sample_ids[::every].tolist()


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


# -- (a) the whole model: Retrain -----------------------------------------------------------------------
def test_whole_model_scope_is_retrain(cnn_dir):
    card = read_card(cnn_dir)
    ids = _forget(cnn_dir)
    run = remove(cnn_dir, ids, method="suffix-retrain", settings={"scope_cost_share": 1.0})
    data = training_set(card)
    retain = data.without(data.positions_of(ids))
    reference = train(card.preset, card.options, retain, recipe_of(card)).model.state_dict()
    assert _max_difference(run.new_state, reference) <= 1e-6
    original = load_trained(cnn_dir).model.state_dict()
    assert _max_difference(run.new_state, original) > 1e-2  # it moved: not the trained model
    assert run.record["scope"]["split_at"] is None and run.record["retrain"]["epochs"] == RECIPE["epochs"]
    assert run.record["release"]["guarantee"] == "none"
    assert run.record["retrain"]["outside_scope_at_start"] is True  # nothing outside the whole model


# -- (b) a prefix: the suffix is the recipe's fit of the recipe's start, the prefix untouched ------------
@pytest.mark.parametrize("epochs,batch_size,lr_scale", [(None, None, 1.0), (1, 128, 2.0)])
def test_suffix_is_the_recipes_fit_from_its_start_with_the_prefix_frozen(cnn_dir, epochs, batch_size, lr_scale):
    card = read_card(cnn_dir)
    ids = _forget(cnn_dir)
    settings = {"scope_cost_share": 0.3, "lr_scale": lr_scale, **({"epochs": epochs} if epochs else {}),
                **({"batch_size": batch_size} if batch_size else {})}
    run = remove(cnn_dir, ids, method="suffix-retrain", settings=settings)
    split_at = run.record["scope"]["split_at"]
    assert split_at is not None and split_at != "0"
    names = run.record["scope"]["parameters"]

    trained = load_trained(cnn_dir)
    original = {k: v.clone() for k, v in trained.model.state_dict().items()}
    start, _, _ = initial_model(card.preset, card.options, seed=RECIPE["seed"])
    reference = trained.model
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in names:
                p.copy_(start.state_dict()[name])
            p.requires_grad_(name in names)
    data = training_set(card)
    recipe = recipe_of(card).model_copy(update={"lr": RECIPE["lr"] * lr_scale})
    if epochs:
        recipe = recipe.model_copy(update={"epochs": epochs, "batch_size": batch_size})
    fit(reference, trained.task, data.without(data.positions_of(ids)), recipe)  # caches the prefix (no batch norm)
    expected = reference.state_dict()
    assert _max_difference(run.new_state, expected) <= 1e-6
    for key in original:
        if key.rsplit(".", 1)[0] + ".weight" not in names and key not in names:
            assert torch.equal(run.new_state[key], original[key]), key  # the prefix: the trained model's
    assert all(_max_difference({n: run.new_state[n]}, {n: original[n]}) > 1e-3 for n in names)
    assert run.record["retrain"]["epochs"] == (epochs or RECIPE["epochs"])
    assert run.record["retrain"]["batch_size"] == (batch_size or RECIPE["batch_size"])
    assert run.record["retrain"]["outside_scope_at_start"] is False  # the prefix was trained on D, U included
    reason = " ".join(run.record["release"]["reasons"])
    assert "heuristic" in reason and "0.weight" in reason


# -- (c) batch norm: the suffix's statistics re-estimated, the prefix's kept ----------------------------
def test_batch_norm_statistics_of_the_suffix_are_re_estimated_and_written(reid_dir):
    ids = _forget(reid_dir, 5)
    trained = load_trained(reid_dir)
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    run = remove(trained, ids, method="suffix-retrain", settings={"scope_cost_share": 0.5})
    assert run.record["scope"]["split_at"].startswith("layer")
    stage = int(run.record["scope"]["split_at"][5])
    suffix_stats = [k for k in before if k.endswith("running_mean") and
                    (k.startswith(("bottleneck", "classifier")) or (k.startswith("layer") and int(k[5]) >= stage))]
    prefix_stats = [k for k in before if k.endswith("running_mean") and k not in suffix_stats]
    assert suffix_stats and prefix_stats
    for k in prefix_stats:
        assert torch.equal(run.new_state[k], before[k]), k
    for k in suffix_stats:
        assert not torch.allclose(run.new_state[k], before[k]), k   # re-estimated, not the original's
        assert float(run.new_state[k].abs().max()) > 0, k           # nor the initial zeros
    live = run.after.model.state_dict()
    assert all(torch.equal(live[k], run.new_state[k]) for k in run.new_state)  # the in-memory model is the version


# -- (d) the prepared state carries to the next version --------------------------------------------------
def test_prepared_state_carries_and_serves_as_a_fresh_one(cnn_dir):
    ids = _forget(cnn_dir)
    settings = {"scope_cost_share": 0.3, "epochs": 1}
    run = remove(cnn_dir, ids, method="suffix-retrain", settings=settings)
    assert run.record["preparation"]["built_for_this_request"]
    nxt = run.next_prepared()
    assert nxt is not None and nxt.details["updated_from_removal"]
    more = [int(i) for i in run.after.train.sample_ids[:9]]
    carried = remove(run.after, more, method="suffix-retrain", settings=settings, prepared=nxt)
    assert not carried.record["preparation"]["built_for_this_request"]

    again = load_trained(cnn_dir)
    first = remove(again, ids, method="suffix-retrain", settings=settings)
    fresh = remove(first.after, more, method="suffix-retrain", settings=settings)
    assert fresh.record["preparation"]["built_for_this_request"]
    assert _max_difference(carried.new_state, fresh.new_state) == 0.0


# -- (e) bad input ---------------------------------------------------------------------------------------
def test_a_model_without_its_card_is_an_error_naming_it(cnn_dir):
    trained = load_trained(cnn_dir)
    problem = RemovalProblem(trained.model, trained.task, trained.train, torch.arange(3), trained.weight_decay)
    with pytest.raises(ValueError, match="card"):
        get_method("suffix-retrain").run(problem, parse_settings("suffix-retrain", {}))


@pytest.mark.parametrize("field,value", [("epochs", 0), ("batch_size", 0), ("lr_scale", 0.0),
                                         ("scope_cost_share", 0.0), ("prefix_pushes_scale", 1.5),
                                         ("prefix_pushes_scale", -0.1), ("prefix_pushes_checkpoints", 1)])
def test_out_of_range_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        parse_settings("suffix-retrain", {field: value})


def test_a_prefix_cache_over_the_memory_budget_is_refused_before_anything_is_computed(cnn_dir):
    from pipeline.memory import MemoryBudgetError

    trained = load_trained(cnn_dir)
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    with pytest.raises(MemoryBudgetError, match="prefix's outputs on D .* raise memory_budget") as err:
        remove(trained, _forget(cnn_dir), method="suffix-retrain", settings={"scope_cost_share": 0.3},
               memory_budget="256KiB")
    assert "scope_cost_share" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in trained.model.state_dict().items())


def test_a_failed_retrain_leaves_every_parameter_and_buffer_as_it_was(reid_dir, monkeypatch):
    from pipeline.methods import suffix_retrain

    trained = load_trained(reid_dir)
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    sgd = suffix_retrain.OPTIMIZERS["sgd"]

    def one_epoch_then_fail(model, task, data, recipe):
        sgd(model, task, data, recipe.model_copy(update={"epochs": 1}))  # moves the suffix and its statistics
        raise RuntimeError("interrupted")

    monkeypatch.setitem(suffix_retrain.OPTIMIZERS, "sgd", one_epoch_then_fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        remove(trained, _forget(reid_dir, 5), method="suffix-retrain", settings={"scope_cost_share": 0.5})
    assert all(torch.equal(v, before[k]) for k, v in trained.model.state_dict().items())


def test_batch_norm_counts_are_the_suffix_s_steps_on_the_retained_data(reid_dir):
    ids = _forget(reid_dir, 5)
    trained = load_trained(reid_dir)
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    run = remove(trained, ids, method="suffix-retrain", settings={"scope_cost_share": 0.5, "epochs": 2})
    steps = 2 * -(-(len(trained.train) - len(ids)) // 16)   # epochs x batches of 16 over D \ U
    stage = int(run.record["scope"]["split_at"][5])
    for key, count in run.new_state.items():
        if key.endswith("num_batches_tracked"):
            in_suffix = key.startswith("bottleneck") or (key.startswith("layer") and int(key[5]) >= stage)
            assert int(count) == (steps if in_suffix else int(before[key])), key


def test_an_lbfgs_recipe_is_retrained_as_it_is_and_refuses_sgd_settings(trained_model_dir):
    model_dir = trained_model_dir("linear", dtype="float64")
    card = read_card(model_dir)
    ids = _forget(model_dir)
    run = remove(model_dir, ids, method="suffix-retrain", settings={"scope_cost_share": 1.0})
    data = training_set(card)
    reference = train(card.preset, card.options, data.without(data.positions_of(ids)), recipe_of(card),
                      dtype=torch.float64).model.state_dict()
    assert _max_difference(run.new_state, reference) <= 1e-9
    with pytest.raises(ValueError, match="settings.epochs: the model card's recipe is 'lbfgs'"):
        remove(model_dir, ids, method="suffix-retrain", settings={"scope_cost_share": 1.0, "epochs": 3})


def test_the_scope_state_leaves_out_frozen_parameters_and_non_persistent_buffers():
    from torch import nn

    from pipeline.methods.suffix_retrain import scope_state_names

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[2].register_buffer("scratch", torch.zeros(2), persistent=False)
    model[2].bias.requires_grad_(False)
    names = scope_state_names(model, model[1:])
    assert names == ["1.weight", "1.bias", "2.weight", "1.running_mean", "1.running_var", "1.num_batches_tracked"]


def test_a_prepared_state_whose_prefix_moved_is_not_carried(cnn_dir):
    settings = {"scope_cost_share": 0.3, "epochs": 1}
    run = remove(cnn_dir, _forget(cnn_dir), method="suffix-retrain", settings=settings)
    with torch.no_grad():
        next(run.after.model.parameters()).add_(1.0)   # the first layer: the prefix
    assert run.next_prepared() is None


# -- (g) a frozen prefix where the recipe started it: Retrain ---------------------------------------------
def test_cut_at_a_frozen_encoders_first_trained_layer_is_retrain(text_dir):
    card = read_card(text_dir)
    ids = _forget(text_dir, 5)
    run = remove(text_dir, ids, method="suffix-retrain", settings={"scope_cost_share": 0.9})
    assert run.record["scope"]["split_at"] is not None  # the frozen layers ran once, not per request
    assert run.record["retrain"]["outside_scope_at_start"] is True
    assert "retained data alone" in " ".join(run.record["release"]["reasons"])
    data = training_set(card)
    reference = train(card.preset, card.options, data.without(data.positions_of(ids)), recipe_of(card)).model
    assert _max_difference(run.new_state, {k: v for k, v in reference.state_dict().items() if k in run.new_state}) <= 1e-6
    original = load_trained(text_dir).model.state_dict()
    assert _max_difference(run.new_state, {k: original[k] for k in run.new_state}) > 1e-3  # it moved
    trained_names = {n for n, p in load_trained(text_dir).model.named_parameters() if p.requires_grad}
    assert trained_names <= set(run.new_state)  # every trained weight was retrained


# -- (h) the forget set's recorded pushes taken back from the prefix -----------------------------------------------
def _prefix_pushes_by_hand(trained, names: list[str], forget_positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """(1 / n) sum_k W_k G_U,P(c_k), W_k = (C_{k-1} + C_k) / 2, over every recorded checkpoint, G_U,P the summed
    cross-entropy gradient over U of the whole network at c_k with respect to the prefix's parameters P."""
    from pipeline.trajectory import load_checkpoint

    model, trajectory = trained.model, trained.trajectory
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    forget = trained.train.take(forget_positions)
    rates = trajectory.rates
    total = {n: torch.zeros_like(dict(model.named_parameters())[n], dtype=torch.float64) for n in names}
    for k, checkpoint in enumerate(trajectory.checkpoints):
        weight = 0.5 * ((rates[k - 1] if k > 0 else 0.0) + (rates[k] if k < len(rates) else 0.0))
        load_checkpoint(model, checkpoint)
        model.zero_grad()
        for batch in forget.batches(len(forget)):
            logits = trained.task.forward(model, batch)
            torch.nn.functional.cross_entropy(logits, batch["y"], reduction="sum").backward()
        for name, p in model.named_parameters():
            if name in total:
                total[name] += weight * p.grad.double()
    model.load_state_dict(kept)
    return {n: v / trajectory.n for n, v in total.items()}


def test_prefix_pushes_taken_back_then_the_suffix_fit_over_the_moved_prefix(cnn_dir):
    card = read_card(cnn_dir)
    ids = _forget(cnn_dir)
    scale = 0.5
    settings = {"scope_cost_share": 0.3, "epochs": 1, "prefix_pushes_scale": scale}
    run = remove(cnn_dir, ids, method="suffix-retrain", settings=settings)
    names = run.record["scope"]["parameters"]
    trained = load_trained(cnn_dir)
    assert trained.trajectory is not None
    original = {k: v.clone() for k, v in trained.model.state_dict().items()}
    prefix = [n for n, _ in trained.model.named_parameters() if n not in names]
    assert prefix and run.record["prefix_pushes"]["tensors"] == len(prefix)
    pushes = _prefix_pushes_by_hand(trained, prefix, trained.train.positions_of(ids))
    for name in prefix:
        moved = run.new_state[name].double() - original[name].double()
        assert float(pushes[name].abs().max()) > 1e-4, name   # something to take back
        assert torch.allclose(moved, scale * pushes[name], rtol=1e-4, atol=1e-7), name   # + s delta: not -, not 2s

    reference = trained.model   # the moved prefix, the suffix from the recipe's start, fit with the prefix frozen
    start, _, _ = initial_model(card.preset, card.options, seed=RECIPE["seed"])
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(start.state_dict()[name] if name in names else original[name] + scale * pushes[name].float())
            p.requires_grad_(name in names)
    data = training_set(card)
    fit(reference, trained.task, data.without(data.positions_of(ids)),
        recipe_of(card).model_copy(update={"epochs": 1}))
    assert _max_difference({n: run.new_state[n] for n in names}, {n: reference.state_dict()[n] for n in names}) <= 1e-5
    assert run.record["preparation"]["built_for_this_request"]
    nxt = run.next_prepared()   # no prefix outputs kept (each removal computes them over its moved prefix)
    assert nxt is not None and nxt.features is None
    more = [int(i) for i in run.after.train.sample_ids[:9]]
    carried = remove(run.after, more, method="suffix-retrain", settings=settings, prepared=nxt)
    assert not carried.record["preparation"]["built_for_this_request"]
    first = remove(load_trained(cnn_dir), ids, method="suffix-retrain", settings=settings)
    fresh = remove(first.after, more, method="suffix-retrain", settings=settings)
    assert fresh.record["preparation"]["built_for_this_request"]
    assert _max_difference(carried.new_state, fresh.new_state) == 0.0
    assert "taken back" in " ".join(run.record["release"]["reasons"])
    assert set(run.record["timings"]) >= {"prefix_pushes", "prefix_outputs", "retrain"}


def test_prefix_pushes_without_the_recorded_run_are_refused_naming_the_setting(cnn_dir):
    trained = load_trained(cnn_dir)
    trained.trajectory = None
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    with pytest.raises(ValueError, match="prefix_pushes_scale.*recorded run"):
        remove(trained, _forget(cnn_dir), method="suffix-retrain",
               settings={"scope_cost_share": 0.3, "prefix_pushes_scale": 0.1})
    assert all(torch.equal(v, before[k]) for k, v in trained.model.state_dict().items())


def test_prefix_pushes_over_the_memory_budget_are_refused_before_anything_moves(cnn_dir):
    from pipeline.memory import MemoryBudgetError

    trained = load_trained(cnn_dir)
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    with pytest.raises(MemoryBudgetError, match="prefix's outputs on D .* raise memory_budget"):
        remove(trained, _forget(cnn_dir), method="suffix-retrain",
               settings={"scope_cost_share": 0.3, "prefix_pushes_scale": 0.1}, memory_budget="256KiB")
    assert all(torch.equal(v, before[k]) for k, v in trained.model.state_dict().items())


def test_a_recorded_run_of_another_model_is_refused_naming_the_prefix_parameter_before_anything_moves(cnn_dir):
    from pipeline.trajectory import Trajectory

    trained = load_trained(cnn_dir)
    run = trained.trajectory
    trained.trajectory = Trajectory([{k: v for k, v in c.items() if k != "0.weight"} for c in run.checkpoints],
                                    run.rates, run.n)
    before = {k: v.clone() for k, v in trained.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"does not hold the prefix's parameters \['0.weight'\]: it belongs to another"):
        remove(trained, _forget(cnn_dir), method="suffix-retrain",
               settings={"scope_cost_share": 0.3, "prefix_pushes_scale": 0.1})
    assert all(torch.equal(v, before[k]) for k, v in trained.model.state_dict().items())
