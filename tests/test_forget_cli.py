"""`unlearn forget` end to end, and its refusals of bad input (nothing written on error)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from jobs.cli import cli
from pipeline.data import load_source
from pipeline.models import build
from pipeline.models.card import DataRef, ModelCard, TrainingRecord, write_model_dir
from pipeline.training import fit_lbfgs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    train = load_source("digits")["train"]
    torch.manual_seed(0)
    model, task = build("linear", {})
    fit_lbfgs(model, task, train, 0.01, tolerance=1e-6, max_steps=30)
    out = tmp_path_factory.mktemp("models") / "digits-linear"
    card = ModelCard(preset="linear", options={}, data=DataRef(source="digits"),
                     training=TrainingRecord(weight_decay=0.01, n=len(train)))
    write_model_dir(out, model.state_dict(), card)
    return out


def write_config(tmp_path: Path, model_dir: Path, **overrides) -> Path:
    config = {
        "model": str(model_dir),
        "forget": {"sample_ids": [1, 2, 3]},
        "method": {"name": "lfoci-newton", "settings": {"selection": "all"}},
        "output": str(tmp_path / "out"),
    }
    for key, value in overrides.items():
        config[key] = value
    path = tmp_path / "forget.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _reject_non_json(constant: str):
    raise AssertionError(f"removal.json holds {constant}, which is not JSON")


def invoke(path: Path, *extra: str):
    return CliRunner().invoke(cli, ["forget", "--config", str(path), *extra])


def test_forget_writes_model_and_record(tmp_path, model_dir):
    result = invoke(write_config(tmp_path, model_dir))
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    text = (out / "removal.json").read_text()
    record = json.loads(text, parse_constant=_reject_non_json)  # strict JSON: no Infinity / NaN
    assert record["settings"]["epsilon"] is None  # epsilon = infinity (no noise) is written as null
    card = json.loads((out / "model.json").read_text())
    assert record["sample_ids"] == [1, 2, 3] and record["n_after"] == record["n_before"] - 3
    assert card["training"]["removed_ids"] == [1, 2, 3] and card["training"]["n"] == record["n_after"]
    new = load_file(out / "model.safetensors")
    old = load_file(model_dir / "model.safetensors")
    assert not torch.equal(new["1.weight"], old["1.weight"])
    assert set(record["timings"]) >= {"gradients", "curvature_and_solve", "verify"}
    # A second removal from the new directory continues from the updated training set.
    second = write_config(tmp_path, out, forget={"sample_ids": [2]}, output=str(tmp_path / "out2"))
    result = invoke(second)
    assert result.exit_code != 0 and "not in the training set" in result.output


def test_help_lists_forget():
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "forget" in out.stdout
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "forget", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "--config" in out.stdout


BAD_INPUTS = {
    "unknown id": (dict(forget={"sample_ids": [0, 99999]}), "forget.sample_ids has sample ids not in the training set"),
    "duplicate id": (dict(forget={"sample_ids": [1, 1]}), "duplicate"),
    "empty forget set": (dict(forget={"sample_ids": []}), "empty"),
    "epsilon zero": (dict(method={"name": "lfoci-newton", "settings": {"selection": "all", "epsilon": 0}}), "epsilon"),
    "epsilon negative": (dict(method={"name": "lfoci-newton", "settings": {"epsilon": -1}}), "epsilon"),
    "delta one": (dict(method={"name": "lfoci-newton", "settings": {"delta": 1.0}}), "delta"),
    "delta zero": (dict(method={"name": "lfoci-newton", "settings": {"delta": 0.0}}), "delta"),
    "unknown method": (dict(method={"name": "magic"}), "unknown"),
    "unknown setting": (dict(method={"name": "lfoci-newton", "settings": {"sigma_typo": 1}}), "sigma_typo"),
    "unknown field": (dict(extra_field=1), "extra_field"),
    "missing model": (dict(model="/nonexistent/model"), "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_and_nothing_written(tmp_path, model_dir, case):
    overrides, message = BAD_INPUTS[case]
    result = invoke(write_config(tmp_path, model_dir, **overrides))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["forget.yaml"]


def test_removing_every_sample_is_refused(tmp_path, model_dir):
    n = json.loads((model_dir / "model.json").read_text())["training"]["n"]
    ids = load_source("digits")["train"].sample_ids.tolist()
    assert len(ids) == n
    result = invoke(write_config(tmp_path, model_dir, forget={"sample_ids": ids}))
    assert result.exit_code == 2 and "all" in result.output and "retrain" in result.output
    assert not (tmp_path / "out").exists()


def test_nan_gradient_is_refused(tmp_path, model_dir):
    broken = tmp_path / "broken"
    state = load_file(model_dir / "model.safetensors")
    state["1.weight"][0, 0] = float("nan")
    card = ModelCard.model_validate_json((model_dir / "model.json").read_text())
    write_model_dir(broken, state, card)
    result = invoke(write_config(tmp_path, broken))
    assert result.exit_code == 2 and "NaN or infinite" in result.output
    assert not (tmp_path / "out").exists()


def test_mismatched_checkpoint_is_refused(tmp_path, model_dir):
    wrong = tmp_path / "wrong"
    state = load_file(model_dir / "model.safetensors")
    state["extra.weight"] = torch.zeros(2)
    del state["1.bias"]
    card = ModelCard.model_validate_json((model_dir / "model.json").read_text())
    write_model_dir(wrong, state, card)
    result = invoke(write_config(tmp_path, wrong))
    assert result.exit_code == 2
    assert "missing keys ['1.bias']" in result.output and "unexpected keys ['extra.weight']" in result.output
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten(tmp_path, model_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    result = invoke(write_config(tmp_path, model_dir))
    assert result.exit_code == 2 and "already exists" in result.output
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def _mixed_linear_model_dir(tmp_path: Path, weight_decay: float = 0.01):
    """A float64 MLP model directory with Mixed-Linear user weights trained on its whole
    training set with ``weight_decay`` (and bound to it)."""
    from pipeline.linearized import LinearizedModel
    from pipeline.methods.mixed_linear import USER_WEIGHTS_FILE, UserWeights, save_user_weights, train_user_weights
    from pipeline.methods.mixed_linear import user_block, user_state

    train = load_source("digits", {"dtype": "float64"})["train"]
    torch.manual_seed(0)
    model, task = build("mlp", {"hidden": [16], "num_classes": 10})
    model = model.double()
    fit_lbfgs(model, task, train, 0.01, tolerance=1e-6, max_steps=10)
    core = tmp_path / "core"
    card = ModelCard(preset="mlp", options={"hidden": [16]}, data=DataRef(source="digits", options={"dtype": "float64"}),
                     training=TrainingRecord(weight_decay=0.01, n=len(train)))
    write_model_dir(core, model.state_dict(), card)
    block = user_block(model, last_modules=1)
    lin = LinearizedModel(model, task, block)
    w_u = train_user_weights(lin, train, weight_decay).user_weights
    save_user_weights(core / USER_WEIGHTS_FILE, UserWeights(user_state(block, model, w_u), weight_decay,
                                                            train.sample_ids.tolist()))
    return core, model, block, lin, train


def test_forget_mixed_linear_from_the_cli_matches_retraining_the_user_weights(tmp_path):
    """`unlearn forget --method mixed-linear` on a model directory with user weights:
    the written user weights equal those trained on the retained data (float64 model), and
    they are bound to the retained ids: forgetting an already forgotten id is refused."""
    from pipeline.methods.mixed_linear import read_user_weights, train_user_weights, user_state

    core, model, block, lin, train = _mixed_linear_model_dir(tmp_path)
    forget_ids = [6, 17, 41]
    path = write_config(tmp_path, core, forget={"sample_ids": forget_ids},
                        method={"name": "lfoci-newton", "per_method": {"mixed-linear": {"cg_rtol": 1e-12}}})
    result = invoke(path, "--method", "mixed-linear")
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "out" / "user_weights.safetensors")
    retain = train.without(train.positions_of(forget_ids))
    expected = user_state(block, model, train_user_weights(lin, retain, 0.01, rtol=1e-12).user_weights)
    for name, value in expected.items():
        rel = float(torch.linalg.vector_norm(written[name] - value) / torch.linalg.vector_norm(value))
        assert rel <= 1e-6, (name, rel)
    bound = read_user_weights(tmp_path / "out" / "user_weights.safetensors")
    assert bound.weight_decay == 0.01 and sorted(bound.sample_ids) == sorted(retain.sample_ids.tolist())
    # The core weights are untouched.
    new_core = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in model.state_dict().items():
        assert torch.equal(new_core[name], value)


def test_forget_mixed_linear_refuses_user_weights_of_another_lambda(tmp_path):
    """User weights trained with lambda 0.05 on a model whose card says 0.01: refused, nothing written."""
    core, *_ = _mixed_linear_model_dir(tmp_path, weight_decay=0.05)
    path = write_config(tmp_path, core, forget={"sample_ids": [6]}, method={"name": "mixed-linear"})
    result = invoke(path)
    assert result.exit_code == 2 and "weight decay 0.05" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_forget_mixed_linear_refuses_user_weights_of_other_data(tmp_path):
    """User weights trained on the whole split, but the model's training set has lost a sample
    since (its card lists a removed id): the weights do not belong to this data; refused."""
    core, *_ = _mixed_linear_model_dir(tmp_path)
    card = json.loads((core / "model.json").read_text())
    card["training"]["removed_ids"] = [3]
    card["training"]["n"] -= 1
    (core / "model.json").write_text(json.dumps(card))
    path = write_config(tmp_path, core, forget={"sample_ids": [6]}, method={"name": "mixed-linear"})
    result = invoke(path)
    assert result.exit_code == 2 and "trained on other data" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_forget_mixed_linear_refuses_unbound_user_weights(tmp_path):
    """A user-weights file that does not say which lambda and data it belongs to is refused."""
    from pipeline.checkpoint import save_safetensors

    core, *_ = _mixed_linear_model_dir(tmp_path)
    save_safetensors(load_file(core / "user_weights.safetensors"), core / "user_weights.safetensors")
    result = invoke(write_config(tmp_path, core, forget={"sample_ids": [6]}, method={"name": "mixed-linear"}))
    assert result.exit_code == 2 and "does not say which lambda and data" in result.output, result.output


def test_bare_method_name_loads_its_config_file(tmp_path, model_dir):
    """`method: lfoci-newton` loads configs/methods/lfoci-newton.yaml; the record's settings are
    exactly that file's (parsed once, kept typed)."""
    from pipeline.config import CONFIGS_DIR
    from pipeline.methods.base import MethodRef

    ref = MethodRef.model_validate("lfoci-newton")
    on_disk = yaml.safe_load((CONFIGS_DIR / "methods" / "lfoci-newton.yaml").read_text())
    assert ref.settings == type(ref.settings).model_validate(on_disk["settings"])
    for name in ("fisher", "ntk", "mixed-linear", "lfoci-newton"):
        assert (CONFIGS_DIR / "methods" / f"{name}.yaml").exists(), name
    # a bare name in a forget config; the file's default (selection lfoci, 1000 perturbations) runs
    ids_config = write_config(tmp_path, model_dir, method="fisher")
    result = invoke(ids_config)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "removal.json").read_text())
    assert record["method"] == "fisher" and record["settings"]["tradeoff"] == 1.0e-4


def test_deeply_nested_config_is_refused_cleanly(tmp_path, model_dir):
    """A YAML bomb of nesting gets a clear error, not a RecursionError traceback."""
    path = tmp_path / "forget.yaml"
    path.write_text("model: x\nforget: " + "[" * 5000 + "]" * 5000 + "\n")
    result = invoke(path)
    assert result.exit_code == 2 and "nests" in result.output and "Traceback" not in result.output, result.output
    path.write_text("model: x\nforget: " + "[" * 80 + "]" * 80 + "\n")
    result = invoke(path)
    assert result.exit_code == 2 and "nests more than 64 levels" in result.output, result.output
