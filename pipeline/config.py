"""The one way a YAML / JSON config becomes a validated pydantic object.

  ``load_yaml``      read a YAML mapping (UTF-8, nesting at most ``MAX_DEPTH`` levels)
  ``parse_json``     parse JSON text with the same nesting limit
  ``format_errors``  one line per pydantic error: the field path as the user wrote it, what is
                     wrong, and how to fix it (allowed fields for unknown ones, the field's
                     description for missing / invalid ones)
  ``parse``          validate a mapping into a model, ``ConfigError`` on failure
  ``load_config``    ``load_yaml`` + ``parse`` (+ relative paths made relative to the file)

Every problem is a ``ConfigError`` (a ``ValueError``) whose message names the file, the field
and the fix; the command line turns it into an error message and a non-zero exit.
``CONFIGS_DIR`` is the tree that references are resolved in (``referenced``: ``method: fisher``
-> configs/methods/fisher.yaml, ``data: digits`` -> configs/data/digits.yaml, ``ray: local-2``
-> configs/cluster/local-2.yaml); set ``UNLEARN_CONFIGS`` to use another one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

#: Deepest nesting of mappings / lists accepted in a config or request file. Real configs
#: use fewer than 10 levels; the limit keeps a hostile file from exhausting the stack.
MAX_DEPTH = 64

CONFIGS_DIR = Path(os.environ.get("UNLEARN_CONFIGS") or Path(__file__).resolve().parents[1] / "configs")


class ConfigError(ValueError):
    """A config file is missing, malformed or invalid; the message says where and what to fix."""


def check_depth(obj: Any, source: str, limit: int = MAX_DEPTH) -> None:
    """Raise ``ConfigError`` when ``obj`` nests mappings / lists deeper than ``limit``
    (iteratively: no recursion on the input)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise ConfigError(f"{source} nests more than {limit} levels deep; flatten it (real configs need far fewer)")
        stack.extend((child, depth + 1) for child in children)


def _too_deep(source: str) -> ConfigError:
    return ConfigError(f"{source} nests too deeply to parse (limit {MAX_DEPTH} levels); flatten it")


def parse_json(text: str, source: str) -> Any:
    """``json.loads`` with the nesting limit; ``json.JSONDecodeError`` passes through."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise _too_deep(source) from None
    check_depth(obj, source)
    return obj


def load_yaml(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A YAML file's top-level mapping; ``ConfigError`` naming the file, line and column."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{what} {path} is not valid YAML{at}: {problem}; fix the syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    except RecursionError:
        raise _too_deep(f"{what} {path}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path} must be a YAML mapping of fields (got {type(raw).__name__})")
    check_depth(raw, f"{what} {path}")
    return raw


# -- error messages ---------------------------------------------------------------------------
def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _walk(cls: type[BaseModel] | None, loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, Any]:
    """(the model class reached by ``loc``, the FieldInfo of its last named part)."""
    owner: type[BaseModel] | None = cls
    info = None
    for part in loc:
        if isinstance(part, int):
            continue
        if owner is None or part not in owner.model_fields:
            return None, None
        info = owner.model_fields[part]
        owner = _submodel(info.annotation)
    return owner, info


def format_errors(err: ValidationError, cls: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """One line per error: ``prefix`` + the field path, what is wrong, and how to fix it."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = prefix + (".".join(str(p) for p in loc) or "(top level)")
        if e["type"] == "extra_forbidden":
            owner, _ = _walk(cls, loc[:-1])
            allowed = sorted(owner.model_fields) if owner is not None else []
            lines.append(f"{where}: unknown field; remove it" + (f" (allowed here: {', '.join(allowed)})" if allowed else ""))
            continue
        _, info = _walk(cls, loc)
        hint = f"; expected: {info.description}" if info is not None and info.description else ""
        if e["type"] == "missing":
            lines.append(f"{where}: required field is missing; add it{hint}")
            continue
        got = e.get("input")
        secret = any("token" in str(part) for part in e["loc"])  # never echo a (short) token back
        shown = f" (got {got!r})" if not isinstance(got, (dict, list)) and got is not None and not secret else ""
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}{shown}{hint}")
    return lines


def describe(err: ValidationError, cls: type[BaseModel] | None, source: str) -> str:
    """The whole message for an invalid config: the source, then one indented line per error."""
    return f"{source} is invalid:\n  - " + "\n  - ".join(format_errors(err, cls))


def parse(model: type[M], raw: Any, source: str) -> M:
    """Validate ``raw`` into ``model``; ``ConfigError`` listing every field to fix."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe(err, model, source)) from None


def resolve_paths(obj: BaseModel, base: Path) -> None:
    """Make every relative ``Path`` field (recursively) relative to ``base``, in place."""
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        if isinstance(value, Path) and not value.is_absolute():
            object.__setattr__(obj, name, (base / value).resolve())
        elif isinstance(value, BaseModel):
            resolve_paths(value, base)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, BaseModel):
                    resolve_paths(item, base)


def referenced(kind: str, raw: Any) -> Any:
    """A config field that may name a file of the configs tree: a bare string ``name`` is
    replaced by the mapping in ``CONFIGS_DIR/<kind>/<name>.yaml`` (``kind``: methods, data,
    cluster, ...); anything else is returned as it is."""
    if not isinstance(raw, str):
        return raw
    path = CONFIGS_DIR / kind / f"{raw}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIGS_DIR / kind).glob("*.yaml"))
        raise ConfigError(f"'{raw}' names no {kind} config ({path} does not exist); known: {known}, "
                          "or write the fields out in place")
    return load_yaml(path, f"{kind} config '{raw}'")


def load_config(model: type[M], path: str | Path, what: str = "config", *, relative_paths: bool = False) -> M:
    """Read and validate a YAML config. ``relative_paths``: relative paths in it become
    relative to the file's folder."""
    path = Path(path)
    config = parse(model, load_yaml(path, what), f"{what} {path}")
    if relative_paths:
        resolve_paths(config, path.parent.resolve())
    return config
