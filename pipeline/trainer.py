"""Train or fine-tune a preset on a dataset and write a model directory (``unlearn train``,
benchmarks and tests all use ``run_training``).

Config (YAML, validated; unknown fields are errors):

    model:
      preset: text                       # a registered preset (pipeline.models)
      options: {model_path: all-MiniLM-L6-v2, num_labels: 8, train_last_layers: 1}
      init: {checkpoint: null, layout: auto, scope: full}   # optional start checkpoint
    data:
      source: reuters-r8                 # a registered source (pipeline.data)
      options: {max_length: 128, per_class: 60}
      split: train                       # trained on
      eval_split: test                   # reported (accuracy) after training; null to skip
    recipe: {optimizer: sgd, epochs: 4, lr: 0.05, batch_size: 32, weight_decay: 1e-4, seed: 0}
    output: runs/models/minilm-r8
    mixed_linear:                        # optional: a Mixed-Linear model (pipeline/mixed_linear_training.py)
      core_data: null                    # public data the core is fitted on (null: the preset's own start)
      user_last_modules: 1

With ``mixed_linear`` the personal ``data`` trains only the linearised user weights (exactly,
by one CG-solved Newton step of their quadratic objective with lambda = recipe.weight_decay);
the core is the preset's initial weights, fitted with the recipe on ``core_data`` when given
(which must share no sample with ``data``). The directory also holds
``user_weights.safetensors``, so ``unlearn forget --method mixed-linear`` forgets exactly.

The model directory (``model.safetensors`` + ``model.json``) records the preset and options,
the data reference, n, lambda, the whole recipe, the init spec and the seeds, so a removal can
rebuild the training set by id and the Retrain baseline can repeat the recipe exactly. An SGD
recipe also leaves ``trajectory.safetensors``: the weights at up to ``recipe.trajectory_checkpoints``
(16) epoch boundaries and the rates between them (``pipeline.trajectory``; trajectory-refit reads it;
``trajectory_checkpoints: 0`` writes none).
Bad input raises ``TrainingError`` (a ``ValueError``) naming the field.
"""
from __future__ import annotations

import platform
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.config import referenced
from pipeline.evaluate.classification import task_accuracy
from pipeline.methods.mixed_linear import USER_WEIGHTS_FILE, save_user_weights
from pipeline.trajectory import TRAJECTORY_FILE, save_trajectory
from pipeline.mixed_linear_training import MixedLinearTraining, fit_user_weights, shared_ids
from pipeline.models.card import DataRef, ModelCard, TrainingRecord, write_model_dir
from pipeline.progress import Steps
from pipeline.recipe import InitSpec, Recipe, initial_model, train


class TrainingError(ValueError):
    """A training run cannot start as configured; the message names the field and the fix."""


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    preset: str
    options: dict[str, Any] = Field(default_factory=dict)
    init: InitSpec = Field(default_factory=InitSpec)
    dtype: Literal["float32", "float64"] = Field(
        "float32", description="parameter dtype while training (float64: exactness oracles); the data is cast to it")


class DataSpec(BaseModel):
    """The training data; a bare name refers to configs/data/<name>.yaml."""

    model_config = ConfigDict(extra="forbid")
    source: str
    options: dict[str, Any] = Field(default_factory=dict)
    split: str = "train"
    eval_split: str | None = "test"

    @model_validator(mode="before")
    @classmethod
    def _reference(cls, raw: Any) -> Any:
        return referenced("data", raw)


class MixedLinearSection(MixedLinearTraining):
    """``mixed_linear`` in a train config: the user block and solver, and where the core comes from."""

    core_data: DataSpec | None = Field(
        None, description="public data (no sample of `data`) the core is fitted on with the recipe; "
                          "null: the core is the preset's initial weights (its pre-trained checkpoint or seeded init)")


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelSpec
    data: DataSpec
    recipe: Recipe
    mixed_linear: MixedLinearSection | None = None
    output: str | None = None


def run_training(config: TrainConfig, output: str | Path | None = None) -> dict[str, Any]:
    """Train per ``config`` and write the model directory; returns a JSON-ready summary."""
    from pipeline.data import load_source
    from pipeline.models import get_preset

    try:
        get_preset(config.model.preset)  # unknown preset -> clear error before loading data
    except ValueError as err:
        raise TrainingError(f"model.preset: {err}") from None
    if output is None and not config.output:
        raise TrainingError("output: give an output directory: 'output' in the config or --output")
    out_dir = Path(output or config.output or "")
    with Steps(["data", "fit", "accuracy", "write"], "train") as steps:
        return _run_training(config, out_dir, load_source, steps)


def _load_splits(spec: DataSpec, field: str, load_source: Any) -> dict[str, Any]:
    """The splits of ``spec``'s source, checked to hold ``spec.split``; errors name ``field``."""
    try:
        splits = load_source(spec.source, spec.options)
    except (ValueError, TypeError) as err:
        raise TrainingError(f"{field}.source / {field}.options: {err}") from None
    if spec.split not in splits:
        raise TrainingError(f"{field}.split: '{spec.split}' is not a split of '{spec.source}' (has {sorted(splits)})")
    return splits


def _run_training(config: TrainConfig, out_dir: Path, load_source: Any, steps: Steps) -> dict[str, Any]:
    with steps.step(f"data ({config.data.source})"):
        splits = _load_splits(config.data, "data", load_source)
        dtype = getattr(torch, config.model.dtype)
        data = splits[config.data.split].astype(dtype)
    if config.mixed_linear is None:
        with steps.step(f"fit ({config.recipe.optimizer}, n={len(data)})"):
            result = train(config.model.preset, config.model.options, data, config.recipe, config.model.init,
                           dtype=dtype)
        model, task, init_report, seconds = result.model, result.task, result.init_report, result.seconds
        trajectory = result.trajectory
        fit_summary = {"final_objective": result.fit.final_objective, "gradient_norm": result.fit.gradient_norm,
                       "steps": result.fit.steps}
        if result.fit.report_samples is not None:  # measured on a seeded subsample (recipe.report_samples)
            fit_summary["report_samples"] = result.fit.report_samples
        mixed, user = None, None
        accuracy_of = lambda split: task_accuracy(model, task, split)  # noqa: E731
    else:
        trajectory = None
        with steps.step(f"fit (core, then Mixed-Linear user weights on n={len(data)})"):
            model, task, init_report, seconds, mixed, user, accuracy_of = _fit_mixed_linear(
                config, config.mixed_linear, data, dtype, load_source)
        fit_summary = {"final_objective": mixed["objective"], "gradient_norm": mixed["gradient_norm_after"],
                       "steps": mixed["solver"]["iterations"]}
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with steps.step("accuracy"):
        summary: dict[str, Any] = {
            "output": str(out_dir), "n": len(data), "train_seconds": round(seconds, 3), **fit_summary,
            "trainable_parameters": int(trainable),
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "train_accuracy": accuracy_of(data),
        }
        if config.data.eval_split and config.data.eval_split in splits:
            summary[f"{config.data.eval_split}_accuracy"] = accuracy_of(splits[config.data.eval_split].astype(dtype))
    recipe = config.recipe
    card = ModelCard(
        preset=config.model.preset, options=config.model.options,
        data=DataRef(source=config.data.source, options=config.data.options, split=config.data.split),
        training=TrainingRecord(
            weight_decay=recipe.weight_decay, n=len(data), epochs=recipe.epochs, lr=recipe.lr,
            batch_size=recipe.batch_size, optimizer=recipe.optimizer, seed=recipe.seed,
            extra={
                "recipe": recipe.model_dump(), "init": config.model.init.model_dump(), "dtype": config.model.dtype,
                "init_report": init_report, "eval_split": config.data.eval_split,
                "fit": {k: summary[k] for k in ("final_objective", "gradient_norm", "steps", "train_seconds",
                                                "report_samples") if k in summary},
                "metrics": {k: v for k, v in summary.items() if k.endswith("_accuracy")},
                "seeds": {"init": recipe.seed, "shuffle": recipe.seed, "dropout": recipe.seed},
                "torch": torch.__version__, "python": platform.python_version(),
                **({"mixed_linear": mixed} if mixed is not None else {}),
            },
        ),
    )
    with steps.step("write"):
        if user is not None:  # before the card: a directory is a model directory once model.json exists
            out_dir.mkdir(parents=True, exist_ok=True)
            summary["user_weights_sha256"] = save_user_weights(out_dir / USER_WEIGHTS_FILE, user)
        if trajectory is not None:  # the SGD recipe's epoch checkpoints (trajectory-refit removes from them)
            out_dir.mkdir(parents=True, exist_ok=True)
            save_trajectory(out_dir / TRAJECTORY_FILE, trajectory)
            summary["trajectory_checkpoints"] = len(trajectory.checkpoints)
        summary["sha256"] = write_model_dir(out_dir, state, card)
    return summary


def _fit_mixed_linear(config: TrainConfig, spec: MixedLinearSection, data: Any, dtype: torch.dtype,
                      load_source: Any) -> tuple[Any, ...]:
    """Core (initial weights, or fitted on the public ``core_data``), then the exact user weights
    on the personal ``data``. Returns (core, task, init report, seconds, record, UserWeights,
    accuracy function of f_ML)."""
    import time

    started = time.perf_counter()
    core_record: dict[str, Any] = {"source": "initial weights of the preset (trained on no sample of `data`)"}
    if spec.core_data is None:
        core, task, init_report = initial_model(config.model.preset, config.model.options, seed=config.recipe.seed,
                                                init=config.model.init)
        core = core.to(dtype)
    else:
        ref = spec.core_data
        public = _load_splits(ref, "mixed_linear.core_data", load_source)[ref.split].astype(dtype)
        same = (ref.source, ref.split) == (config.data.source, config.data.split)  # ids: rows of one split's file
        overlap = shared_ids(public, data) if same else []
        if overlap:
            raise TrainingError(
                f"mixed_linear.core_data: shares {len(overlap)} samples with data (e.g. ids {overlap[:5]}): the core "
                "must hold no personal data, or forgetting is not exact; choose a disjoint split or subset")
        result = train(config.model.preset, config.model.options, public, config.recipe, config.model.init,
                       dtype=dtype)
        core, task, init_report = result.model, result.task, result.init_report
        core_record = {"source": ref.model_dump(), "n": len(public), "final_objective": result.fit.final_objective,
                       "gradient_norm": result.fit.gradient_norm, "seconds": result.seconds}
    try:
        fit = fit_user_weights(core, task, data, config.recipe.weight_decay, spec)
    except ValueError as err:
        raise TrainingError(str(err)) from None
    record = {**fit.record, "core": core_record}
    return (core, task, init_report, time.perf_counter() - started, record, fit.user,
            lambda split: fit.accuracy(task, split))


