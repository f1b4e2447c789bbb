"""Model presets: architecture + task (input format, loss) + default hyper-parameters.

Presets are looked up by name in ``PRESETS``; each builds an ``nn.Module`` and its ``Task``
from keyword options. Any user module works with the removal methods too: a preset only
bundles the usual choices for a model family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from pipeline.registry import Registry

from pipeline.tasks import Task


@dataclass(frozen=True)
class Preset:
    name: str
    build: Callable[..., nn.Module]
    make_task: Callable[..., Task]
    defaults: dict[str, Any] = field(default_factory=dict)
    description: str = ""


PRESETS: Registry[Preset] = Registry("model preset", builtins="pipeline.models")


def register_preset(preset: Preset) -> Preset:
    return PRESETS.add(preset.name, preset)


def get_preset(name: str) -> Preset:
    return PRESETS.get_known(name)


def build(name: str, options: dict[str, Any] | None = None) -> tuple[nn.Module, Task]:
    """Build (module, task) for a preset; options go to both builders (each takes what it knows)."""
    preset = get_preset(name)
    opts = dict(options or {})
    try:
        module = preset.build(**opts)
    except TypeError as err:
        raise ValueError(f"model.options for preset '{name}' are invalid: {err}") from err
    return module, preset.make_task(**opts)
