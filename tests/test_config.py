"""The one config path (pipeline.config): references into the configs tree, the error
formatter, and the loader's limits."""
from __future__ import annotations

import json

import pytest
import yaml

from pipeline.config import CONFIGS_DIR, ConfigError, load_config, load_yaml, parse_json, referenced


def test_every_reference_kind_resolves_from_the_configs_tree():
    """configs/ mirrors what can be referenced: methods, data, cluster (and models are train configs)."""
    from jobs.specs import RaySpec
    from pipeline.methods.base import MethodRef
    from pipeline.trainer import DataSpec, TrainConfig

    assert DataSpec.model_validate("digits") == DataSpec(source="digits")
    assert RaySpec.model_validate("local-2").workers == 2
    assert MethodRef.model_validate("lfoci-newton").settings.perturbations == 1000
    for path in sorted((CONFIGS_DIR / "models").glob("*.yaml")):
        load_config(TrainConfig, path)  # every model config is a valid train config
    with pytest.raises(ValueError, match="names no data config"):
        DataSpec.model_validate("no-such-data")


def test_method_settings_are_parsed_once_and_kept():
    from pipeline.methods.base import MethodRef
    from pipeline.methods.fisher_scrub import FisherScrubSettings

    ref = MethodRef.model_validate({"name": "fisher", "settings": {"tradeoff": 0.5}})
    assert isinstance(ref.settings, FisherScrubSettings) and ref.settings.tradeoff == 0.5
    assert ref.model_dump()["settings"]["tradeoff"] == 0.5  # dumped as the method's type, not the base
    with pytest.raises(ValueError, match=r"settings\.tradeof: unknown field"):
        MethodRef.model_validate({"name": "fisher", "settings": {"tradeof": 0.5}})


def test_errors_name_the_field_and_the_file(tmp_path):
    from pipeline.trainer import TrainConfig

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "linear", "bogus": 1}, "data": "digits", "recipe": {}}))
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path, "train config")
    assert str(path) in str(err.value) and "model.bogus: unknown field; remove it" in str(err.value)
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_yaml(path)


def test_deep_nesting_is_a_clear_error_not_a_recursion_error(tmp_path):
    deep_json = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ConfigError, match="nests too deeply"):
        parse_json(deep_json, "request line 1")
    with pytest.raises(ConfigError, match="nests more than 64 levels"):
        parse_json("[" * 70 + "]" * 70, "request line 1")
    assert parse_json(json.dumps({"a": [[1]]}), "x") == {"a": [[1]]}
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(ConfigError, match="nests"):
        load_yaml(path)


def test_reference_leaves_inline_values_alone():
    assert referenced("data", {"source": "digits"}) == {"source": "digits"}
