"""`unlearn eval --ulira-shadows S`: the U-LiRA distinguishing game (Hayes et al. 2024) as a user runs it.

Pair s is the card's recipe run with seed s0 + s on D (an original, written as a model directory with its recorded
run) and on D_r (a Retrain); pair 0 is the model itself and its Retrain. Every method removes D_f from every original
through ``pipeline.removal.remove``.

  (a) oracle: suffix-retrain over the whole network is Retrain to the bit (tests/test_suffix_retrain.py), so on every
      pair its phi is the Retrain's: each held-out decision is a tie and the attack reads 50 exactly, with no shift.
      A pairing off by one seed, or every shadow removed at the model's own seed, breaks the ties;
  (b) oracle: the untouched originals' row equals the game played on models trained here independently
      (``pipeline.recipe.train`` at each seed on D and on D_r), decision for decision, and scores near 100 on a
      forgotten class (the game has power: a reversed sign would read near 0);
  (c) the shadow originals are model directories with their recorded run and their seed on the card, cached: a
      second evaluation trains none and reads the same;
  (e) the controls (``ulira_controls``: members of D_r and test samples the removal was not asked about): the exact
      Retrain reads 50 there too, the originals' row is the game on the independently trained models read on the
      recorded control samples, and the same seed draws the same samples;
  (d) a method that fails on the model itself has no game and says on which pair; pair 0's Retrain is at the
      recipe's seed whatever seed the Retrain row has; the command line prints the game and refuses fewer than 3
      pairs and a game without Retrain; a model the game cannot pair (Mixed-Linear, a later version, another
      precision) is refused naming the field, before any work and without writing its output.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.evaluate.lira import logit_confidence, ulira_attack_accuracy
from pipeline.evaluate.predict import logits_of
from pipeline.evaluate.protocol import EvalConfig, EvaluationError, evaluate
from pipeline.models.card import load_model_dir, read_card, write_model_dir
from pipeline.recipe import recipe_of, train
from pipeline.removal import training_set

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = {"optimizer": "sgd", "epochs": 3, "lr": 0.05, "batch_size": 64, "momentum": 0.9, "weight_decay": 5e-4,
          "seed": 3}
CNN = {"channels": [8, 16], "pool": [1, 2], "hidden": [32], "image_size": 8}
CLASS = 3
PAIRS = 4
CONTROLS = 24


@pytest.fixture(scope="module")
def cnn_dir(tmp_path_factory):
    from tests import kit

    return kit.trained_model_dir(tmp_path_factory.mktemp("cnn"), "cnn", CNN, data_options={"flatten": False},
                                 recipe=RECIPE)


def _config(model_dir, tmp_path, **extra) -> EvalConfig:
    return EvalConfig.model_validate({
        "model_dir": str(model_dir), "forget": {"scenario": "class", "classes": [CLASS]},
        "methods": {"suffix-retrain": {"scope_cost_share": 1.0}, "trajectory-refit": {}},
        "finetune": {"epochs": 1}, "residual_gradient": False, "ulira_shadows": PAIRS,
        "cache_dir": str(tmp_path / "cache"), **extra})


@pytest.fixture(scope="module")
def played(cnn_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ulira")
    first = evaluate(_config(cnn_dir, tmp, out=str(tmp / "eval.json"), ulira_controls=CONTROLS))
    again = evaluate(_config(cnn_dir, tmp, ulira_controls=CONTROLS))
    return first, again, tmp


@pytest.fixture(scope="module")
def independent(cnn_dir):
    """The game's models trained here independently (``pipeline.recipe.train`` at each pair's seed on D and on D_r),
    with the data they split and the model's task: the reference both the forget set's and the controls' games are
    checked against."""
    card = read_card(cnn_dir)
    data = training_set(card)
    retain = data.take(torch.nonzero(data.columns["y"] != CLASS).squeeze(1))
    recipe = recipe_of(card)
    seeds = [recipe.seed + s for s in range(PAIRS)]
    models = {on: [train(card.preset, card.options, d, recipe.model_copy(update={"seed": s})).model for s in seeds]
              for on, d in (("D", data), ("D_r", retain))}
    _, task, _ = load_model_dir(cnn_dir)
    return {"card": card, "data": data, "retain": retain, "models": models, "task": task}


def _reference(independent, subset) -> dict:
    """The U-LiRA game of the independently trained originals against the Retrains, read on ``subset``."""
    def phi(model):
        return logit_confidence(logits_of(model, independent["task"], subset, 256), subset.columns["y"])

    return ulira_attack_accuracy(np.stack([phi(m) for m in independent["models"]["D"]]),
                                 np.stack([phi(m) for m in independent["models"]["D_r"]]))


def test_an_exact_retrain_reads_fifty_on_every_pair(played):
    game = played[0]["ulira"]
    row = game["rows"]["suffix-retrain"]
    assert row["accuracy"] == 50.0 and row["ci95"] == [50.0, 50.0]
    assert np.all(np.asarray(row["per_pair"]) == 0.5)
    assert row["reads"]["phi"]["shift"] == 0.0 and row["reads"]["phi"]["shift_spread"] == 0.0
    assert game["shadows"] == PAIRS and game["seeds"] == [RECIPE["seed"] + s for s in range(PAIRS)]


def test_the_originals_row_is_the_game_on_models_trained_independently(played, independent):
    game = played[0]["ulira"]
    data = independent["data"]
    forget = data.take(torch.nonzero(data.columns["y"] == CLASS).squeeze(1))
    reference = _reference(independent, forget)
    row = game["rows"]["original"]
    assert row["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-9)
    assert np.allclose(row["per_pair"], reference["per_pair"])
    assert row["accuracy"] >= 95 and game["attackable"]  # a class the originals know, Retrains never saw
    for name in ("trajectory-refit", "finetune"):  # methods that move play a game of the same shape
        other = game["rows"][name]
        assert 0 <= other["accuracy"] <= 100 and np.asarray(other["per_pair"]).shape == (PAIRS, len(forget))
        assert other["decisions"] == 2 * PAIRS * len(forget)


def test_shadow_originals_are_model_directories_cached_with_their_run(played):
    first, again, tmp = played
    directories = sorted((tmp / "cache").glob("original-*"))
    assert len(directories) == PAIRS - 1
    assert sorted(read_card(d).training.seed for d in directories) == [RECIPE["seed"] + s for s in range(1, PAIRS)]
    assert all((d / "trajectory.safetensors").exists() for d in directories)
    assert first["ulira"]["originals_trained"]["cached"] == 0 and again["ulira"]["originals_trained"]["cached"] == PAIRS - 1
    for name, row in first["ulira"]["rows"].items():
        assert again["ulira"]["rows"][name]["accuracy"] == row["accuracy"]
    saved = json.loads((tmp / "eval.json").read_text())
    assert saved["ulira"]["rows"]["suffix-retrain"]["accuracy"] == 50.0


def test_a_method_that_fails_on_the_model_itself_has_no_game(cnn_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(cnn_dir, bare)
    (bare / "trajectory.safetensors").unlink()  # trajectory-refit reads the recorded run: an error without it
    other_seed = RECIPE["seed"] + 5  # the Retrain row at another seed: pair 0's Retrain is still at the recipe's
    result = evaluate(_config(bare, tmp_path, ulira_shadows=3, continue_on_error=True, retrain_seeds=[other_seed],
                              methods={"trajectory-refit": {}, "suffix-retrain": {"scope_cost_share": 1.0}}))
    row = result["ulira"]["rows"]["trajectory-refit"]
    assert "accuracy" not in row and row["shadow"] == 0 and "trajectory" in row["error"]
    assert "trajectory-refit" in result["method_errors"]
    assert result["ulira"]["rows"]["finetune"]["shadow_pairs"] == 3
    assert result["ulira"]["rows"]["suffix-retrain"]["accuracy"] == 50.0


def test_the_command_line_prints_the_game_and_refuses_bad_input(cnn_dir, tmp_path):
    from jobs.evaluate import command

    runner = CliRunner()
    base = [str(cnn_dir), "--scenario", "class", "--classes", str(CLASS), "--cache-dir", str(tmp_path / "cache")]
    out = tmp_path / "eval.json"
    ok = runner.invoke(command, base + ["--method", "finetune", "--ulira-shadows", "3", "--ulira-controls", "8",
                                        "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    assert "U-LiRA, 3 shadow pairs" in ok.output and "original: " in ok.output and "finetune: " in ok.output
    assert "control, 8 retained samples (not asked about): original " in ok.output and "control, 8 test samples" in ok.output
    out.unlink()
    for extra, field in ((["--ulira-shadows", "2"], "ulira_shadows"), (["--ulira-shadows", "-1"], "ulira_shadows"),
                         (["--ulira-controls", "8"], "ulira_controls"),
                         (["--ulira-shadows", "3", "--ulira-controls", "-1"], "ulira_controls")):
        bad = runner.invoke(command, base + extra + ["--out", str(out)])
        assert bad.exit_code == 1 and field in bad.output and not out.exists()
    with pytest.raises(ValueError, match="ulira_shadows"):
        EvalConfig.model_validate({"model_dir": str(cnn_dir), "methods": {}, "baselines": [], "ulira_shadows": 3})


@pytest.mark.parametrize("patch, said", [
    ({"extra": {"mixed_linear": {"core": {}}}}, "Mixed-Linear"),
    ({"removed_ids": 2}, "not a trained original"),  # the first two of D
    ({"extra": {"dtype": "float64"}}, "float64"),
])
def test_a_model_the_game_cannot_pair_is_refused_before_any_work(cnn_dir, tmp_path, patch, said):
    """A Mixed-Linear model, a later version (pair 0 would be a removal, the other originals trained) and a model
    whose Retrain would be trained in another precision: refused naming the field, nothing computed or written."""
    from pipeline.checkpoint import read_state_dict

    card = read_card(cnn_dir)
    if "removed_ids" in patch:
        patch = {"removed_ids": training_set(card).sample_ids[: patch["removed_ids"]].tolist(),
                 "n": card.training.n - patch["removed_ids"]}
    training = card.training.model_copy(update={**{k: v for k, v in patch.items() if k != "extra"},
                                                "extra": {**card.training.extra, **patch.get("extra", {})}})
    write_model_dir(tmp_path / "model", read_state_dict(cnn_dir / "model.safetensors"),
                    card.model_copy(update={"training": training}))
    with pytest.raises(EvaluationError, match=f"ulira_shadows: .*{said}"):
        evaluate(_config(tmp_path / "model", tmp_path, out=str(tmp_path / "never.json")))
    assert not (tmp_path / "never.json").exists() and not (tmp_path / "cache").exists()


def test_games_on_several_forget_sets_are_pooled_per_row(cnn_dir, tmp_path):
    """`unlearn eval --pool-ulira A --pool-ulira B`: the games of two forget sets of one model (the same shadow
    originals, cached) pooled per row: the exact Retrain still reads 50, the originals' row is the weighted mean of
    its two games (``pooled_attack_accuracy``); a row one game lacks is not pooled and says which; results of another
    model, without a game, or of the same forget set twice are refused naming the file."""
    from jobs.evaluate import command
    from pipeline.evaluate.lira import pooled_attack_accuracy

    files = []
    for label in (CLASS, 5):
        methods = {"suffix-retrain": {"scope_cost_share": 1.0}} if label == CLASS else {}
        files.append(tmp_path / f"class{label}.json")
        evaluate(_config(cnn_dir, tmp_path, ulira_shadows=3, methods=methods, forget={"scenario": "class",
                                                                                      "classes": [label]},
                         out=str(files[-1])))
    runner = CliRunner()
    out = tmp_path / "pooled.json"
    said = runner.invoke(command, ["--pool-ulira", str(files[0]), "--pool-ulira", str(files[1]), "--out", str(out)])
    assert said.exit_code == 0, said.output
    pooled = json.loads(out.read_text())
    games = [json.loads(f.read_text())["ulira"] for f in files]
    original = pooled["rows"]["original"]
    reference = pooled_attack_accuracy([g["rows"]["original"] for g in games])
    assert original["accuracy"] == pytest.approx(reference["accuracy"]) and original["ci95"] == reference["ci95"]
    n = [g["rows"]["original"]["examples"] for g in games]
    assert original["examples"] == sum(n) and original["accuracy"] == pytest.approx(
        sum(k * g["rows"]["original"]["accuracy"] for k, g in zip(n, games)) / sum(n))
    assert pooled["attackable"] and pooled["rows"]["finetune"]["shadow_pairs"] == 3
    assert pooled["rows"]["suffix-retrain"]["not_pooled"] == f"no game on result {files[1]}"
    assert "original: " in said.output and f"over {sum(n)} examples of 2 sets" in said.output
    assert "suffix-retrain: no game (no game on result" in said.output
    other = json.loads(files[1].read_text())
    other["model_dir"] = "elsewhere"
    (tmp_path / "other.json").write_text(json.dumps(other))
    bad = runner.invoke(command, ["--pool-ulira", str(files[0]), "--pool-ulira", str(tmp_path / "other.json")])
    assert bad.exit_code == 1 and "other.json: model_dir" in bad.output
    bad = runner.invoke(command, ["--pool-ulira", str(files[0]), "--pool-ulira", str(files[0])])
    assert bad.exit_code == 1 and "the same forget set as" in bad.output
    other = {**json.loads(files[1].read_text()), "ulira": None}
    (tmp_path / "none.json").write_text(json.dumps(other))
    bad = runner.invoke(command, ["--pool-ulira", str(files[0]), "--pool-ulira", str(tmp_path / "none.json")])
    assert bad.exit_code == 1 and "none.json: holds no U-LiRA game" in bad.output


def test_the_controls_read_the_same_game_on_samples_the_removal_was_not_asked_about(played, independent):
    from pipeline.data import load_source

    first, again, _ = played
    controls = first["ulira"]["controls"]
    assert sorted(controls) == ["retained", "test"]
    card = independent["card"]
    test = load_source(card.data.source, card.data.options)["test"]
    for key, pool in (("retained", independent["retain"]), ("test", test)):
        control = controls[key]
        ids = control["sample_ids"]
        assert len(ids) == CONTROLS == len(set(ids)) and control == again["ulira"]["controls"][key]  # seeded
        subset = pool.take(pool.positions_of(ids))
        assert not np.isin(subset.columns["y"].numpy(), [CLASS]).any()  # the class scenario's kept classes
        reference = _reference(independent, subset)
        assert control["rows"]["original"]["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-9)
        assert control["rows"]["suffix-retrain"]["accuracy"] == 50.0   # Retrain to the bit: every decision a tie
        assert control["rows"]["suffix-retrain"]["ci95"] == [50.0, 50.0]
        assert control["rows"]["original"]["examples"] == CONTROLS
    assert first["ulira"]["rows"]["original"]["accuracy"] >= 95   # the forget set's game is still the forget set's
