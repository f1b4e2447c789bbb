"""Reading YAML configs into pydantic models with errors that name the field and the fix."""
from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file is missing, malformed or invalid; the message says where and what to fix."""


def describe_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source} is invalid:"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  - {where}: {e['msg']}")
    return "\n".join(lines)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of settings at the top level")
    return raw


def parse(model: type[M], raw: dict, source: str) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, source)) from None


def load_config(model: type[M], path: str | Path) -> M:
    return parse(model, load_yaml(path), str(path))
