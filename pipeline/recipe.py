"""Training recipes: how a preset is initialised and fitted, reproducibly, so that the Retrain
baseline can repeat the exact recipe from the exact same start on the retained data.

Objective (``pipeline.training``): L_D(w) = (1/n) sum_i loss(w, z_i) + (lambda/2) ||w||^2 over
the trainable parameters. Optimisers are looked up in ``OPTIMIZERS`` by name:
  lbfgs  full-batch L-BFGS to a tight optimum (``max_steps``, ``tolerance``): convex models
         and the exactness oracles;
  sgd    mini-batch SGD with momentum and cosine decay (``epochs``, ``lr``, ``batch_size``).
Initialisation: ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` (the caller's
global RNG is untouched), the preset builds its module, then an optional init checkpoint is
loaded (``pipeline.models.loading.load_checkpoint``; ``scope: backbone`` keeps the fresh head).
Dropout draws during SGD come from the same forked, seeded RNG.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from pipeline.data.sampleset import SampleSet
from pipeline.tasks import Task

if TYPE_CHECKING:
    from pipeline.trajectory import Trajectory, TrajectoryRecorder
    from pipeline.models.card import ModelCard
from pipeline.training import FitReport, fit_lbfgs, fit_sgd


class Recipe(BaseModel):
    """How to fit: optimiser and its hyper-parameters, weight decay lambda, seed."""

    model_config = ConfigDict(extra="forbid")
    optimizer: str = "lbfgs"
    epochs: int = Field(0, ge=0)
    lr: float = Field(0.0, ge=0)
    batch_size: int = Field(0, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    seed: int = 0
    max_steps: int = Field(200, gt=0)
    tolerance: float = Field(1e-8, gt=0)
    report_samples: int | None = Field(
        None, gt=0, description="sgd: measure the final objective and gradient norm on a seeded subsample of this many "
                                "training samples (null: all of them; on a large set that costs about a third of an epoch)")
    trajectory_checkpoints: int = Field(
        16, ge=0, description="sgd: keep the weights at most this many times along the run (every ceil(epochs / this) "
                              "epochs and the last; pipeline.trajectory, read by trajectory-refit; each holds the "
                              "trainable parameters once); 0 = none")

    @field_validator("optimizer")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in OPTIMIZERS:
            raise ValueError(f"recipe.optimizer '{value}' is unknown; choose one of {sorted(OPTIMIZERS)}")
        return value


class InitSpec(BaseModel):
    """Where training starts: the preset's seeded initialisation, then an optional checkpoint."""

    model_config = ConfigDict(extra="forbid")
    checkpoint: str | None = None
    layout: str = "auto"
    scope: Literal["full", "backbone"] = "full"


FitFn = Callable[..., FitReport]


def _fit_lbfgs(model: nn.Module, task: Task, data: SampleSet, recipe: Recipe, recorder: Any = None,
               start_epoch: int = 0) -> FitReport:
    if start_epoch:
        raise ValueError("recipe: optimizer 'lbfgs' has no epochs to start from (start_epoch is for 'sgd')")
    model.eval()  # full-batch: deterministic forward (no dropout, BN running statistics)
    return fit_lbfgs(model, task, data, recipe.weight_decay, max_steps=recipe.max_steps,
                     tolerance=recipe.tolerance, batch_size=recipe.batch_size or 4096)


def _fit_sgd(model: nn.Module, task: Task, data: SampleSet, recipe: Recipe, recorder: Any = None,
             start_epoch: int = 0) -> FitReport:
    if recipe.epochs < 1 or recipe.lr <= 0 or recipe.batch_size < 1:
        raise ValueError("recipe: optimizer 'sgd' needs epochs >= 1, lr > 0 and batch_size >= 1")
    if recorder is not None and start_epoch:
        raise ValueError("a trajectory is recorded from a run's start: no recorder with start_epoch > 0")
    return fit_sgd(model, task, data, recipe.weight_decay, epochs=recipe.epochs, lr=recipe.lr,
                   batch_size=recipe.batch_size, momentum=recipe.momentum, seed=recipe.seed,
                   report_samples=recipe.report_samples, callback=None if recorder is None else recorder.callback(),
                   start_epoch=start_epoch)


OPTIMIZERS: dict[str, FitFn] = {"lbfgs": _fit_lbfgs, "sgd": _fit_sgd}


def initial_model(
    preset: str, options: dict[str, Any], *, seed: int, init: InitSpec | None = None,
) -> tuple[nn.Module, Task, dict[str, Any]]:
    """(module, task, load report) at the recipe's start: seeded build + optional checkpoint."""
    from pipeline.models import build, load_checkpoint

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module, task = build(preset, options)
    report: dict[str, Any] = {}
    if init is not None and init.checkpoint:
        report = load_checkpoint(module, preset, init.checkpoint, layout=init.layout, scope=init.scope).as_dict()
    return module, task, report


def recipe_of(card: "ModelCard") -> Recipe:
    """The recipe recorded by ``unlearn train`` (or rebuilt from the card's training fields)."""
    raw = card.training.extra.get("recipe")
    if raw:
        return Recipe.model_validate(raw)
    t = card.training
    return Recipe(optimizer=t.optimizer, epochs=t.epochs, lr=t.lr, batch_size=t.batch_size,
                  weight_decay=t.weight_decay, seed=t.seed)


def init_of(card: "ModelCard") -> InitSpec:
    """Where the card's training started: its init checkpoint, if any."""
    return InitSpec.model_validate(card.training.extra.get("init") or {})


def start_weights(card: "ModelCard") -> dict[str, torch.Tensor]:
    """w_init: the state the card's recipe started training from (the seeded initialisation plus
    the init checkpoint), on the CPU."""
    start, _, _ = initial_model(card.preset, card.options, seed=recipe_of(card).seed, init=init_of(card))
    return {k: v.detach().cpu() for k, v in start.state_dict().items()}


def fit(model: nn.Module, task: Task, data: SampleSet, recipe: Recipe,
        recorder: "TrajectoryRecorder | None" = None, start_epoch: int = 0) -> FitReport:
    """Fit in place with the recipe's optimiser; every random draw from the recipe's seed.

    Frozen layers in front (``requires_grad`` False, e.g. a text encoder's lower layers) whose
    forward pass draws nothing at random in train mode (no dropout with p > 0, no batch-norm
    statistics) compute the same outputs at every step: they run once over ``data``
    (``pipeline.frozen_prefix``) and the optimiser fits the trainable suffix over their cached
    outputs, the same objective and the same steps at a fraction of the cost. ``recorder``: collects an SGD
    run's epoch checkpoints (``pipeline.trajectory``; the full model's parameter names). ``start_epoch`` (SGD): the
    recipe's epochs from that one on, from the weights the model holds (``pipeline.training.fit_sgd``; dropout draws
    start from the seed)."""
    from pipeline.frozen_prefix import cache_frozen_prefix, deterministic_prefix
    from pipeline.param_block import ParamBlock

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        prefix = None
        if trainable and len(trainable) < len(list(model.parameters())):
            block = ParamBlock.from_rows(model, {name: None for name in trainable})
            if deterministic_prefix(model, task, block):
                was = model.training
                model.eval()
                prefix = cache_frozen_prefix(model, task, data, block, recipe.batch_size or 256)
                model.train(was)
        if prefix is None:
            return OPTIMIZERS[recipe.optimizer](model, task, data, recipe, recorder, start_epoch)
        return OPTIMIZERS[recipe.optimizer](prefix.suffix, prefix.task, prefix.train, recipe, recorder, start_epoch)


@dataclass
class TrainResult:
    model: nn.Module
    task: Task
    fit: FitReport
    init_report: dict[str, Any]
    seconds: float
    trajectory: "Trajectory | None" = None  # an SGD recipe's epoch checkpoints (pipeline.trajectory)


def train(
    preset: str, options: dict[str, Any], data: SampleSet, recipe: Recipe, init: InitSpec | None = None,
    dtype: torch.dtype = torch.float32,
) -> TrainResult:
    """Build at the recipe's start, in ``dtype``, and fit on ``data`` (its floating columns
    cast to ``dtype``)."""
    import time

    started = time.perf_counter()
    model, task, report = initial_model(preset, options, seed=recipe.seed, init=init)
    model = model.to(dtype)
    recorder = None
    if recipe.optimizer == "sgd" and recipe.trajectory_checkpoints > 0:
        from pipeline.trajectory import TrajectoryRecorder

        recorder = TrajectoryRecorder(model, recipe)
    result = fit(model, task, data.astype(dtype), recipe, recorder)
    model.eval()
    return TrainResult(model, task, result, report, time.perf_counter() - started,
                       None if recorder is None else recorder.trajectory(len(data)))
