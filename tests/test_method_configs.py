"""Every file in configs/methods/ loads, names a registered method, and runs as written (issue 24).

A file named after its method mirrors that method's Settings field for field at their defaults; any
other file is a variant: its method and the settings it changes. Each runs through
``pipeline.removal.remove`` (the path of ``unlearn forget --method <file>``) on a small model
directory trained by the real ``unlearn train`` code path, through the method's preparation seam.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import CONFIGS_DIR
from pipeline.methods import METHODS, get_method
from pipeline.methods.base import MethodRef, method_variants

FILES = method_variants()
MLP = {"in_features": 64, "hidden": [16], "num_classes": 10}


def test_every_registered_method_has_its_file_and_no_file_is_orphaned():
    assert set(METHODS) <= set(FILES)
    assert {"newton-head", "newton-head-gn"} <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_file_names_its_method_and_only_its_fields(name: str):
    raw = yaml.safe_load((CONFIGS_DIR / "methods" / f"{name}.yaml").read_text())
    assert set(raw) == {"method", "settings"}
    ref = MethodRef.model_validate(name)
    assert ref.method == raw["method"] and ref.name == name
    settings_cls = get_method(ref.method).Settings
    fields = set(raw["settings"])
    assert fields <= set(settings_cls.model_fields), sorted(fields - set(settings_cls.model_fields))
    if name == ref.method:  # the method's own file: every field, at its default
        assert fields == set(settings_cls.model_fields)
        assert settings_cls.model_validate(raw["settings"]) == settings_cls()
    else:  # a variant: the settings it changes or pins (a bench row's, a demo's)
        assert fields


def test_a_variant_setting_given_inline_overrides_the_file():
    ref = MethodRef.model_validate({"name": "newton-head", "settings": {"newton_rtol": 1e-5}})
    assert ref.method == "decision-layer-newton" and ref.settings.newton_rtol == 1e-5
    assert ref.settings.curvature_samples == 16384  # from the file
    with pytest.raises(ValueError, match="unknown; choose a registered method"):
        MethodRef.model_validate("no-such-method")
    with pytest.raises(ValueError, match="settings.newton_rtol"):
        MethodRef.model_validate({"name": "newton-head", "settings": {"newton_rtol": -1}})


def test_an_inline_section_keeps_the_variants_other_fields_of_it():
    """lfoci-newton-replay-1024 sets gauss_newton.emptied_class_samples; an inline gauss_newton section overrides
    the fields it names and keeps that one (a shallow merge would put the default 256 back)."""
    ref = MethodRef.model_validate({"name": "lfoci-newton-replay-1024",
                                    "settings": {"gauss_newton": {"curvature_samples": 128}, "damping": 0.01}})
    assert ref.method == "lfoci-newton" and ref.settings.damping == 0.01
    assert ref.settings.gauss_newton.curvature_samples == 128 and ref.settings.gauss_newton.emptied_class_samples == 1024
    assert MethodRef.model_validate("lfoci-newton").settings.gauss_newton.emptied_class_samples == 256


@pytest.fixture(scope="module")
def mlp_dir(trained_model_dir) -> Path:
    return trained_model_dir("mlp", MLP, steps=60)


@pytest.fixture(scope="module")
def sgd_dir(trained_model_dir) -> Path:
    """Trained by an SGD recipe: `unlearn train` records its trajectory (trajectory-refit reads it)."""
    return trained_model_dir("mlp", MLP, recipe={"optimizer": "sgd", "epochs": 2, "lr": 0.05, "batch_size": 64,
                                                 "momentum": 0.9, "weight_decay": 1e-3, "seed": 0})


@pytest.fixture(scope="module")
def mixed_linear_dir(tmp_path_factory) -> Path:
    from click.testing import CliRunner

    from jobs.train import command as train_command

    out = tmp_path_factory.mktemp("ml") / "model"
    example = CONFIGS_DIR / "models" / "mixed-linear-digits.yaml"
    result = CliRunner().invoke(train_command, [str(example), "--output", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("name", FILES)
def test_file_runs_as_written(name: str, mlp_dir: Path, mixed_linear_dir: Path, sgd_dir: Path):
    from pipeline.models.card import load_model_dir, read_card
    from pipeline.removal import remove, training_set

    ref = MethodRef.model_validate(name)
    reads_recorded_run = ref.method == "trajectory-refit" or bool(getattr(ref.settings, "prefix_pushes_scale", 0))
    model_dir = mixed_linear_dir if ref.method == "mixed-linear" else sgd_dir if reads_recorded_run else mlp_dir
    ids = training_set(read_card(model_dir)).sample_ids[:6].tolist()
    run = remove(model_dir, ids, method=name, seed=0, batch_size=512)
    assert run.record["method"] == ref.method
    assert run.record.get("variant", ref.method) == name
    assert run.record["preparation"]["built_for_this_request"] and run.record["removal_seconds"] > 0
    assert all(bool(torch.isfinite(v).all()) for v in run.new_state.values())
    model, _, _ = load_model_dir(model_dir)
    before = model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], run.new_state[k])]
    if ref.method == "mixed-linear":  # the core stays; the user weights move
        assert not moved and run.user_weights is not None
    else:
        assert moved, f"{name} moved no parameter"
    assert run.card.training.n == read_card(model_dir).training.n - len(ids)
