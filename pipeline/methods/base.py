"""The removal interface every method implements, and the registry of methods.

A method receives a ``RemovalProblem`` (a model trained to a (near) optimum of
    L_D(w) = (1/n) sum_{z in D} loss(w, z) + (lambda/2) ||w||^2
on the training set D, and the positions of the samples U to forget) and returns a
``RemovalOutcome``: the new parameter values and a JSON-ready record of what it did.
Methods are looked up by name (``METHODS["lfoci-newton"]``), never by if/elif chains; each
has a pydantic ``Settings`` model that the YAML configs mirror field for field.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from pipeline.data.sampleset import SampleIdError, SampleSet
from pipeline.tasks import Task


# (model, task, forget batch, seed, perturbations, pass_size, perturb options) -> ProbeResult
ProbeRunner = Callable[..., Any]
# (model, task, data, block, weight_decay, reduction=..., batch_size=...) -> LinearOperator
CurvatureFactory = Callable[..., Any]


class MethodSettings(BaseModel):
    """Base of every method's settings: unknown fields are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class RemovalProblem:
    model: nn.Module
    task: Task
    train: SampleSet
    forget_positions: Tensor
    weight_decay: float
    seed: int = 0
    batch_size: int = 1024
    extras: dict[str, Any] = field(default_factory=dict)
    # How the distributed parts run; None = in this process. cluster/ supplies Ray versions.
    probe_runner: "ProbeRunner | None" = None
    curvature_factory: "CurvatureFactory | None" = None

    def __post_init__(self) -> None:
        self.forget_positions = torch.as_tensor(self.forget_positions, dtype=torch.long)
        if self.forget_positions.numel() == 0:
            raise SampleIdError("forget set is empty: name at least one sample id to remove")
        if self.m >= self.n:
            raise SampleIdError(
                f"the forget set removes all {self.n} training samples; nothing would remain to "
                "define the model: retrain from scratch instead"
            )
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")

    @property
    def n(self) -> int:
        return len(self.train)

    @property
    def m(self) -> int:
        return int(self.forget_positions.numel())

    @property
    def forget(self) -> SampleSet:
        return self.train.take(self.forget_positions)

    @property
    def retain(self) -> SampleSet:
        return self.train.without(self.forget_positions)

    def generator(self, stream: int = 0) -> torch.Generator:
        """A CPU generator for one named random stream of this removal (seed, stream)."""
        g = torch.Generator(device="cpu")
        g.manual_seed(self.seed * 1_000_003 + stream)
        return g


@dataclass
class RemovalOutcome:
    new_parameters: dict[str, Tensor]
    record: dict[str, Any]


class RemovalMethod(ABC):
    name: ClassVar[str]
    Settings: ClassVar[type[MethodSettings]]

    @abstractmethod
    def run(self, problem: RemovalProblem, settings: MethodSettings) -> RemovalOutcome: ...


METHODS: dict[str, type[RemovalMethod]] = {}


def register_method(cls: type[RemovalMethod]) -> type[RemovalMethod]:
    if cls.name in METHODS:
        raise ValueError(f"method '{cls.name}' registered twice")
    METHODS[cls.name] = cls
    return cls


def get_method(name: str) -> RemovalMethod:
    import pipeline.methods  # noqa: F401  (registers the built-in methods)

    if name not in METHODS:
        raise ValueError(f"method '{name}' is unknown; choose one of {sorted(METHODS)}")
    return METHODS[name]()


def parse_settings(name: str, raw: dict[str, Any] | None) -> MethodSettings:
    method = get_method(name)
    return method.Settings.model_validate(raw or {})
