"""Model presets: architecture + task (input format, loss) + default hyper-parameters.

Presets are looked up by name in ``PRESETS``; each builds an ``nn.Module`` and its ``Task``
from keyword options. Any user module works with the removal methods too: a preset only
bundles the usual choices for a model family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from pipeline.tasks import Task


@dataclass(frozen=True)
class Preset:
    name: str
    build: Callable[..., nn.Module]
    make_task: Callable[..., Task]
    defaults: dict[str, Any] = field(default_factory=dict)
    description: str = ""


PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    if preset.name in PRESETS:
        raise ValueError(f"preset '{preset.name}' registered twice")
    PRESETS[preset.name] = preset
    return preset


def get_preset(name: str) -> Preset:
    import pipeline.models  # noqa: F401  (registers the built-in presets)

    if name not in PRESETS:
        raise ValueError(f"model preset '{name}' is unknown; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def build(name: str, options: dict[str, Any] | None = None) -> tuple[nn.Module, Task]:
    """Build (module, task) for a preset; options go to both builders (each takes what it knows)."""
    preset = get_preset(name)
    opts = dict(options or {})
    try:
        module = preset.build(**opts)
    except TypeError as err:
        raise ValueError(f"model.options for preset '{name}' are invalid: {err}") from err
    return module, preset.make_task(**opts)
