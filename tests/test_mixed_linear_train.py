"""`unlearn train` produces a Mixed-Linear model end to end (configs/models/mixed-linear-digits.yaml,
as written), and `unlearn forget --method mixed-linear` on it equals retraining the user weights on
the retained data (Golatkar et al., CVPR 2021: the user objective is quadratic, forgetting exact)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from jobs.forget import command as forget_command
from jobs.train import command as train_command
from pipeline.linearized import LinearizedModel
from pipeline.methods.mixed_linear import (
    FLAT_KEY, USER_WEIGHTS_FILE, read_user_weights, train_user_weights, user_block, user_vector)
from pipeline.models.card import load_model_dir, read_card
from pipeline.removal import training_set

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "models" / "mixed-linear-digits.yaml"
FORGET = [1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14]  # digits train ids (multiples of 5 are the test split)


def _user(directory: Path) -> torch.Tensor:
    """The user weights of a model directory as a flat block vector (per-parameter tensors read)."""
    core, _, _ = load_model_dir(directory)
    weights = read_user_weights(directory / USER_WEIGHTS_FILE).weights
    return user_vector(user_block(core), {k: v for k, v in weights.items() if k != FLAT_KEY})


def _exact_user_weights(model_dir: Path, drop: list[int]) -> torch.Tensor:
    """Oracle: the user objective minimised from scratch on the card's data minus ``drop``."""
    core, task, card = load_model_dir(model_dir)
    data = training_set(card).astype(torch.float64)
    if drop:
        data = data.without(data.positions_of(drop))
    lin = LinearizedModel(core.eval(), task, user_block(core))
    return train_user_weights(lin, data, card.training.weight_decay, rtol=1e-12).user_weights


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ml") / "model"
    result = CliRunner().invoke(train_command, [str(EXAMPLE), "--output", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["n"] == 1437 and summary["gradient_norm"] < 1e-8
    assert summary["test_accuracy"] > 85  # f_ML = random tanh features + trained linear read-out
    return out


def test_train_writes_core_card_and_bound_user_weights(trained):
    card = read_card(trained)
    assert card.training.weight_decay == 0.001 and card.training.n == 1437
    assert card.training.extra["mixed_linear"]["core"]["source"].startswith("initial weights")
    user = read_user_weights(trained / USER_WEIGHTS_FILE)
    assert user.weight_decay == 0.001 and len(user.sample_ids) == 1437
    # the user weights are the exact minimiser on D (not some other point): equal to a fresh solve
    exact = _exact_user_weights(trained, [])
    assert torch.equal(user.weights[FLAT_KEY], _user(trained))  # the flat copy and the tensors agree
    assert float(torch.linalg.vector_norm(_user(trained) - exact)) <= 1e-8 * float(torch.linalg.vector_norm(exact))
    # the core is the seeded initialisation: the last layer's stored weights are the init, not w_u
    core, _, _ = load_model_dir(trained)
    assert not torch.allclose(core[3].weight.double(), user.weights["3.weight"].double())


def test_forget_equals_retraining_the_user_weights(trained, tmp_path):
    spec = {"model": str(trained), "forget": {"sample_ids": FORGET}, "method": "mixed-linear", "seed": 0,
            "output": str(tmp_path / "forgot")}
    (tmp_path / "forget.yaml").write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(forget_command, ["--config", str(tmp_path / "forget.yaml")])
    assert result.exit_code == 0, result.output
    before, after = _user(trained), _user(tmp_path / "forgot")
    exact = _exact_user_weights(trained, FORGET)
    moved = float(torch.linalg.vector_norm(before - exact))
    assert moved > 1e-3  # forgetting 12 samples moves the optimum measurably
    assert float(torch.linalg.vector_norm(after - exact)) <= 1e-6 * moved
    bound = read_user_weights(tmp_path / "forgot" / USER_WEIGHTS_FILE)
    assert sorted(set(range(1797)) - set(bound.sample_ids)) == sorted(
        set(range(0, 1797, 5)) | set(FORGET))  # bound to D_r: the test split and the forgotten ids are out
    record = json.loads((tmp_path / "forgot" / "removal.json").read_text())
    assert record["n_after"] == 1437 - len(FORGET) and record["retain_gradient_norm_after"] < 1e-10


def test_core_data_sharing_personal_samples_is_refused(tmp_path):
    config = yaml.safe_load(EXAMPLE.read_text())
    config["mixed_linear"]["core_data"] = {"source": "digits", "options": {}, "split": "train"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "model"
    result = CliRunner().invoke(train_command, [str(tmp_path / "bad.yaml"), "--output", str(out)])
    assert result.exit_code != 0
    assert "mixed_linear.core_data" in result.output and "1437 samples" in result.output
    assert not out.exists()  # refused before anything was written


def test_core_fitted_on_public_data_then_user_weights(tmp_path):
    """A core fitted on a declared public split (here digits' test split, disjoint from the train
    split), then exact user weights on the personal train split."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["model"]["options"]["hidden"] = [16]
    config["recipe"] = {"optimizer": "lbfgs", "weight_decay": 0.001, "max_steps": 20, "tolerance": 1e-6, "seed": 0}
    config["mixed_linear"]["core_data"] = {"source": "digits", "options": {}, "split": "test"}
    config["data"]["eval_split"] = None
    (tmp_path / "public.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "model"
    result = CliRunner().invoke(train_command, [str(tmp_path / "public.yaml"), "--output", str(out)])
    assert result.exit_code == 0, result.output
    core_record = read_card(out).training.extra["mixed_linear"]["core"]
    assert core_record["n"] == 360 and core_record["source"]["split"] == "test"
    exact = _exact_user_weights(out, [])
    assert float(torch.linalg.vector_norm(_user(out) - exact)) <= 1e-8 * float(torch.linalg.vector_norm(exact))
