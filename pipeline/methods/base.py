"""The method interface: a preparation per model version, and a removal that takes it.

A method is two calls:
    prepare(trained, settings) -> Prepared      once per model version: what does not depend on
                                                the samples removed (curvature, cached inputs,
                                                gradients), bound to exactly the weights, buffers,
                                                data ids, weight decay, loss options and settings
                                                it was built from (``pipeline.prepared``)
    remove(problem, settings, prepared) -> RemovalOutcome
for a model trained to (or towards) an optimum of
    L_D(w) = (1/n) sum_{z in D} loss(w, z) + (lambda/2) ||w||^2
and the positions of the samples U to forget. ``run_removal`` is the one seam every caller goes
through (``unlearn forget``, ``unlearn eval``, campaigns, the stream service, benchmarks, tests):
it checks that a prepared state holds (else prepares anew and says so), applies the eval-mode
guard once around preparation and removal, and records the preparation's seconds apart from the
removal's. Methods are looked up by name in one registry (``METHODS``); each has a pydantic
``Settings`` holding only the fields it reads. A variant of a method (which parameters, which
solver, which target) is a file in configs/methods/ that names its method and settings
(``MethodRef``), never a flag inside another method.
"""
from __future__ import annotations

import hashlib
import math
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, model_validator
from torch import Tensor, nn

from pipeline.data.sampleset import SampleIdError, SampleSet
from pipeline.eval_mode import eval_mode_restored
from pipeline.prepared import Binding, NothingPrepared, Prepared
from pipeline.privacy.release import PrivacyRelease
from pipeline.registry import Registry
from pipeline.tasks import Batch, PerturbOptions, Task

if TYPE_CHECKING:
    from pipeline.curvature.operators import LinearOperator
    from pipeline.models.card import ModelCard
    from pipeline.param_block import ParamBlock
    from pipeline.probe import ProbeResult

__all__ = [
    "CurvatureFactory", "METHODS", "MethodRef", "MethodSettings", "PerturbOptions", "ProbeRunner", "RandomStream",
    "RemovalMethod", "RemovalOutcome", "RemovalProblem", "StageHook", "TrainedModel", "get_method", "method_variants",
    "parse_settings", "prepare", "register_method", "run_removal", "stream_seed",
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
    (``pipeline.curvature.hessian.BlockHessian`` in this process; ``cluster.curvature_pool.
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
    PROBE_FORGET_SUBSAMPLE = 8  # the forget samples the L-FOCI probe perturbs when they are more than its cap
    GRADIENT_SUBSAMPLE = 9   # training samples a mean gradient is estimated on (lfoci-newton's Gauss-Newton path)


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

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("anchor" in data or "anchor_absent_classes" in data):
            raise ValueError("anchor: this setting was removed (its anchored target over-forgets); the removal's "
                             "point is set by target: retrain (where the card's recipe run on D \\ U lands) or "
                             "target: minimiser (grad L_{D\\U} = 0)")
        return data


@dataclass
class TrainedModel:
    """A trained model and its training set D: what a method prepares from. ``card`` (the model
    card: preset, options, recipe) when the model came from a directory; ``user_weights`` for a
    Mixed-Linear model (its w_u, bound to lambda and D's ids)."""

    model: nn.Module
    task: Task
    train: SampleSet
    weight_decay: float
    batch_size: int = 1024
    card: "ModelCard | None" = None
    user_weights: Any = None
    trajectory: Any = None  # an SGD recipe's recorded epoch checkpoints: pipeline.trajectory.Trajectory
    trajectory_missing: str | None = None  # why ``trajectory`` is None where the card refers to one (gone, changed)


@dataclass
class RemovalProblem:
    model: nn.Module
    task: Task
    train: SampleSet
    forget_positions: Tensor
    weight_decay: float
    seed: int = 0
    batch_size: int = 1024
    card: "ModelCard | None" = None
    user_weights: Any = None  # Mixed-Linear models: pipeline.methods.mixed_linear.UserWeights
    trajectory: Any = None  # the recipe's recorded epoch checkpoints (pipeline.trajectory.Trajectory), if kept
    trajectory_missing: str | None = None  # why it is None where the card refers to one (the file gone or changed)
    # How the distributed parts run; None = in this process. cluster/ supplies Ray versions.
    probe_runner: "ProbeRunner | None" = None
    curvature_factory: "CurvatureFactory | None" = None
    # Told of every stage's start and end (progress bars; bench/ times the real methods through it).
    stage_hook: "StageHook | None" = None

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

    @property
    def trained(self) -> TrainedModel:
        return TrainedModel(self.model, self.task, self.train, self.weight_decay, self.batch_size, self.card,
                            self.user_weights, self.trajectory, self.trajectory_missing)

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
    # the new values of the parameters the removal moved, and of the persistent buffers it re-estimated (batch-norm
    # statistics), by the model's state-dict names
    new_parameters: dict[str, Tensor]
    record: dict[str, Any]
    # What noise was added and what it may claim; the record carries it as record["release"].
    release: PrivacyRelease = field(default_factory=PrivacyRelease.non_private)
    # Mixed-Linear: the new user weights (bound to D \ U); None for every other method
    user_weights: Any = None
    # the prepared state the removal started from (``run_removal`` sets it)
    prepared: Prepared | None = None
    # what the removal computed at its new weights that the next version's prepared state may keep
    # (``Prepared.after_removal`` reads it; never written to the record)
    carried: dict[str, Any] = field(default_factory=dict)


class RemovalMethod(ABC):
    name: ClassVar[str]
    Settings: ClassVar[type[MethodSettings]]
    #: the settings fields the preparation reads (a state prepared under other values of these is
    #: not used); the empty tuple for a method that prepares nothing
    PREPARED_FROM: ClassVar[tuple[str, ...]] = ()

    def prepare(self, trained: TrainedModel, settings: MethodSettings, binding: Binding) -> Prepared:
        """What this method computes once per model version (default: nothing)."""
        return NothingPrepared(binding)

    @abstractmethod
    def remove(self, problem: RemovalProblem, settings: MethodSettings, prepared: Prepared) -> RemovalOutcome: ...

    def binding(self, trained: TrainedModel, settings: MethodSettings) -> Binding:
        """What a state prepared for ``trained`` under ``settings`` is bound to."""
        dumped = settings.model_dump(mode="json")
        return Binding.of(trained.model, trained.task, trained.train, trained.weight_decay, self.name,
                          {k: dumped[k] for k in self.PREPARED_FROM})

    def run(self, problem: RemovalProblem, settings: MethodSettings,
            prepared: Prepared | None = None) -> RemovalOutcome:
        """``run_removal(self, problem, settings, prepared)``."""
        return run_removal(self, problem, settings, prepared)


def prepare(method: RemovalMethod, trained: TrainedModel, settings: MethodSettings,
            prepared: Prepared | None = None) -> tuple[Prepared, str | None]:
    """(state, why it was built now): ``prepared`` itself when it holds for ``trained`` and
    ``settings`` (why = None), else a new one in eval mode, timed (its seconds: the binding's digests
    and the build)."""
    started = time.perf_counter()
    binding = method.binding(trained, settings)
    if prepared is not None and prepared.holds_for(binding):
        return prepared, None
    why = ("no prepared state was given" if prepared is None else
           "the given state was prepared for other " + ", ".join(prepared.binding.differences(binding)))
    with eval_mode_restored(trained.model):
        state = method.prepare(trained, settings, binding)
    state.seconds = time.perf_counter() - started
    return state, why


def run_removal(method: RemovalMethod, problem: RemovalProblem, settings: MethodSettings,
                prepared: Prepared | None = None) -> RemovalOutcome:
    """The one seam: prepare (unless ``prepared`` holds), then remove, both in eval mode (each
    module's mode and every buffer restored afterwards). The record's ``preparation`` gives the
    state's seconds and whether this request built it; ``removal_seconds`` everything else: the check
    that the state holds for this version (its binding's digests) and the removal."""
    started = time.perf_counter()
    state, why = prepare(method, problem.trained, settings, prepared)
    with eval_mode_restored(problem.model):
        outcome = method.remove(problem, settings, state)
    removal_seconds = time.perf_counter() - started - (state.seconds if why is not None else 0.0)
    outcome.prepared = state
    outcome.record["preparation"] = {**state.describe(), "built_for_this_request": why is not None,
                                     **({"why": why} if why else {})}
    outcome.record["removal_seconds"] = removal_seconds
    return outcome


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


def method_config_path(name: str) -> Path:
    """``configs/methods/<name>.yaml``: the variant file a bare name refers to."""
    from pipeline.config import CONFIGS_DIR

    return CONFIGS_DIR / "methods" / f"{name}.yaml"


def method_variants() -> list[str]:
    """Every variant file name in configs/methods/ (without .yaml)."""
    from pipeline.config import CONFIGS_DIR

    return sorted(p.stem for p in (CONFIGS_DIR / "methods").glob("*.yaml"))


def _field_by_field(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s fields in place of its own; a section given in both (a mapping, e.g. lfoci-newton's
    ``gauss_newton``) merged the same way, so an inline section keeps the variant's other fields of it."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _field_by_field(merged[key], value)
        else:
            merged[key] = value
    return merged


def _variant(name: str) -> dict[str, Any]:
    """{method, settings} of the variant file ``name``; a registered method without a file is
    itself with default settings. Unknown names fail listing both."""
    from pipeline.config import referenced

    if not method_config_path(name).exists():
        if get_method_known(name):
            return {"method": name, "settings": {}}
        raise ValueError(f"method '{name}' is unknown; choose a registered method {sorted(METHODS)} or a "
                         f"variant in configs/methods/ {method_variants()}")
    raw = referenced("methods", name)
    if not isinstance(raw, dict) or "method" not in raw:
        raise ValueError(f"{method_config_path(name)} must name its method: `method: <registered method>` "
                         "and `settings: {...}`")
    extra = sorted(set(raw) - {"method", "settings"})
    if extra:
        raise ValueError(f"{method_config_path(name)}: unknown top-level fields {extra}; a variant file has "
                         "`method` and `settings` only")
    get_method(str(raw["method"]))  # ValueError listing the registered methods
    return {"method": str(raw["method"]), "settings": dict(raw.get("settings") or {})}


def get_method_known(name: str) -> bool:
    """True when ``name`` is a registered method (the built-ins imported first)."""
    try:
        METHODS.get_known(name)
    except ValueError:
        return False
    return True


class MethodRef(BaseModel):
    """A removal method, the variant it was named by, and its parsed, typed settings:

        method: newton-head                              # a variant: configs/methods/newton-head.yaml
        method: {name: lfoci-newton, settings: {epsilon: 1.0}}   # a variant or method, settings on top

    ``name`` is what was written (a variant file or a registered method), ``method`` the registered
    method it runs. Settings given here override the variant file's field by field; they are
    parsed once, here, into the method's ``Settings`` and kept (errors name ``settings.<field>``)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("lfoci-newton", description="a variant in configs/methods/ or a registered removal method")
    method: str = Field("", description="the registered method it runs (resolved from name)")
    settings: SerializeAsAny[MethodSettings] = Field(
        default_factory=MethodSettings, description="the method's settings (its Settings fields)")

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, raw: Any) -> Any:
        if raw is None:
            raw = {}
        if isinstance(raw, str):
            raw = {"name": raw}
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        name = str(raw.setdefault("name", "lfoci-newton"))
        variant = _variant(name)
        method = variant["method"]
        if raw.get("method") not in (None, "", method):
            raise ValueError(f"method: '{name}' runs method '{method}', not '{raw['method']}'")
        raw["method"] = method
        impl = get_method(method)
        settings = raw.get("settings")
        if not isinstance(settings, impl.Settings):
            merged = _field_by_field(variant["settings"], dict(settings or {}))
            try:
                raw["settings"] = parse_settings(method, merged)
            except ValidationError as err:
                from pipeline.config import format_errors

                raise ValueError(f"settings of method '{name}' are invalid: "
                                 + "; ".join(format_errors(err, impl.Settings, prefix="settings."))) from None
        return raw

    @model_validator(mode="after")
    def _typed(self) -> "MethodRef":
        parse_settings(self.method, self.settings)  # the settings belong to this method
        return self
