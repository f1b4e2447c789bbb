"""The removal interface every method implements, and the registry of methods.

A method receives a ``RemovalProblem`` (a model trained to a (near) optimum of
    L_D(w) = (1/n) sum_{z in D} loss(w, z) + (lambda/2) ||w||^2
on the training set D, and the positions of the samples U to forget) and returns a
``RemovalOutcome``: the new parameter values and a JSON-ready record of what it did.
Methods are looked up by name (``METHODS["lfoci-newton"]``), never by if/elif chains; each
has a pydantic ``Settings`` model that the YAML configs mirror field for field.
"""
from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, model_validator
from torch import Tensor, nn

from pipeline.data.sampleset import SampleIdError, SampleSet
from pipeline.privacy.release import PrivacyRelease
from pipeline.registry import Registry
from pipeline.tasks import Batch, PerturbOptions, Task

if TYPE_CHECKING:
    from pipeline.curvature import LinearOperator
    from pipeline.param_block import ParamBlock
    from pipeline.probe import ProbeResult

__all__ = [
    "CurvatureFactory", "METHODS", "MethodRef", "MethodSettings", "PerturbOptions", "ProbeRunner", "RandomStream",
    "RemovalMethod", "RemovalOutcome", "RemovalProblem", "StageHook", "get_method", "parse_settings", "register_method",
    "stream_seed",
]


class ProbeRunner(Protocol):
    """Runs the probe: ``perturbations`` perturbed forward passes of the forget batch, one
    scalar per slice per perturbation (``pipeline.methods.block_choice.local_probe``, i.e.
    ``pipeline.probe.run_probe``, in this process; ``cluster.probe_pool.RayProbeRunner`` on Ray
    workers). The result is the same either way."""

    def __call__(
        self, model: nn.Module, task: Task, forget: Batch, *, seed: int, perturbations: int,
        pass_size: int, perturb_options: PerturbOptions,
    ) -> "ProbeResult": ...


class CurvatureFactory(Protocol):
    """Builds the restricted Hessian H_P(data) (+ lambda I) as a linear operator
    (``pipeline.curvature.BlockHessian`` in this process; ``cluster.curvature_pool.
    RayCurvatureFactory`` on Ray workers)."""

    def __call__(
        self, model: nn.Module, task: Task, data: SampleSet, block: "ParamBlock", weight_decay: float, *,
        reduction: str = "mean", batch_size: int = 1024,
    ) -> "LinearOperator": ...


class RandomStream(IntEnum):
    """The named, seeded random streams of a removal (reproducible parts only).

    Privacy noise is NOT among them: it is drawn from the OS CSPRNG
    (``pipeline.privacy.noise.secret_standard_normal``) and no seed regenerates it."""

    PROBE = 1                # perturbations of the forget samples
    CURVATURE_SUBSAMPLE = 2  # training samples the curvature is estimated on
    FISHER_LABELS = 6        # labels sampled from the model for the predictive Fisher
    SELECTION_TIES = 7       # L-CODEC tie-breaking jitter


MAX_SEED = 2**63 - 1


def stream_seed(seed: int, stream: "RandomStream | int") -> int:
    """A 63-bit generator seed for (seed, stream), hashed so that any seed in [0, 2^63) works
    (no overflow, no two (seed, stream) pairs that collide by arithmetic)."""
    if not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2^63 - 1], got {seed}")
    digest = hashlib.sha256(f"{int(seed)}:{int(stream)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


class StageHook(Protocol):
    """Told when each stage of a removal starts and ends (timing, progress display)."""

    def started(self, stage: str) -> None: ...

    def finished(self, stage: str, seconds: float) -> None: ...


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
    # Told of every stage's start and end (bench/ times the real methods through it).
    stage_hook: "StageHook | None" = None
    # Working memory a stage may use (pipeline.memory.MemoryBudget); None = the scoped / auto
    # budget. ``pipeline.removal.remove`` scopes it (``memory.use_budget``) around the method, so
    # every pass of the method (gradients, Hessian columns, probe, line search) sizes its
    # chunks from it without being handed it.
    memory_budget: Any = None

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

    def generator(self, stream: RandomStream) -> torch.Generator:
        """A CPU generator for one named random stream of this removal (seed, stream)."""
        g = torch.Generator(device="cpu")
        g.manual_seed(stream_seed(self.seed, stream))
        return g

    @contextmanager
    def stage(self, name: str, timings: dict[str, float] | None = None) -> Iterator[None]:
        """Time one stage: adds its seconds to ``timings[name]`` and tells ``stage_hook``."""
        if self.stage_hook is not None:
            self.stage_hook.started(name)
        t = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t
            if timings is not None:
                timings[name] = timings.get(name, 0.0) + seconds
            if self.stage_hook is not None:
                self.stage_hook.finished(name, seconds)


@dataclass
class RemovalOutcome:
    new_parameters: dict[str, Tensor]
    record: dict[str, Any]
    # What noise was added and what it may claim; the record carries it as record["release"].
    release: PrivacyRelease = field(default_factory=PrivacyRelease.non_private)


class RemovalMethod(ABC):
    name: ClassVar[str]
    Settings: ClassVar[type[MethodSettings]]

    @abstractmethod
    def run(self, problem: RemovalProblem, settings: MethodSettings) -> RemovalOutcome: ...


METHODS: Registry[type[RemovalMethod]] = Registry("method", builtins="pipeline.methods")


def register_method(cls: type[RemovalMethod]) -> type[RemovalMethod]:
    return METHODS.add(cls.name, cls)


def get_method(name: str) -> RemovalMethod:
    return METHODS.get_known(name)()


def parse_settings(name: str, raw: "MethodSettings | Mapping[str, Any] | None") -> MethodSettings:
    """The method's typed settings: an already parsed ``Settings`` is used as it is."""
    impl = get_method(name)
    if isinstance(raw, MethodSettings):
        if not isinstance(raw, impl.Settings):
            raise ValueError(f"settings of type {type(raw).__name__} do not belong to method '{name}'")
        return raw
    return impl.Settings.model_validate(dict(raw or {}))


def method_config_path(name: str) -> "Path":
    """``configs/methods/<name>.yaml``: the method's settings file that a bare name refers to."""
    from pipeline.config import CONFIGS_DIR

    return CONFIGS_DIR / "methods" / f"{name}.yaml"


class MethodRef(BaseModel):
    """A removal method and its parsed, typed settings, as written in a config:

        method: fisher                                   # bare name: configs/methods/fisher.yaml
        method: {name: lfoci-newton, settings: {epsilon: 1.0}}

    The settings are parsed once, here, into the method's ``Settings`` and kept (never dropped
    and re-parsed); errors name the field (``method.settings.<field>``)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("lfoci-newton", description="a registered removal method")
    settings: SerializeAsAny[MethodSettings] = Field(
        default_factory=MethodSettings, description="the method's settings (its Settings fields)")

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, raw: Any) -> Any:
        if raw is None:
            raw = {}
        if isinstance(raw, str):
            raw = cls._from_file(raw)
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        name = raw.setdefault("name", "lfoci-newton")
        impl = get_method(str(name))  # ValueError listing the known methods
        settings = raw.get("settings")
        if not isinstance(settings, impl.Settings):
            try:
                raw["settings"] = parse_settings(str(name), settings)
            except ValidationError as err:
                from pipeline.config import format_errors

                raise ValueError(f"settings of method '{name}' are invalid: "
                                 + "; ".join(format_errors(err, impl.Settings, prefix="settings."))) from None
        return raw

    @staticmethod
    def _from_file(name: str) -> dict[str, Any]:
        from pipeline.config import referenced

        get_method(name)  # unknown names fail with the list of methods, before any file is read
        if not method_config_path(name).exists():
            return {"name": name}
        raw = referenced("methods", name)
        if raw.get("name", name) != name:
            raise ValueError(f"{method_config_path(name)} configures method '{raw.get('name')}', not '{name}'")
        return {"name": name, "settings": raw.get("settings") or {}}

    @model_validator(mode="after")
    def _typed(self) -> "MethodRef":
        parse_settings(self.name, self.settings)  # the settings belong to this method
        return self
