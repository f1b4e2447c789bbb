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

The model directory (``model.safetensors`` + ``model.json``) records the preset and options,
the data reference, n, lambda, the whole recipe, the init spec and the seeds, so a removal can
rebuild the training set by id and the Retrain baseline can repeat the recipe exactly.
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
from pipeline.models.card import DataRef, ModelCard, TrainingRecord, write_model_dir
from pipeline.progress import Steps
from pipeline.recipe import InitSpec, Recipe, train


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


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelSpec
    data: DataSpec
    recipe: Recipe
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


def _run_training(config: TrainConfig, out_dir: Path, load_source: Any, steps: Steps) -> dict[str, Any]:
    with steps.step(f"data ({config.data.source})"):
        try:
            splits = load_source(config.data.source, config.data.options)
        except (ValueError, TypeError) as err:
            raise TrainingError(f"data.source / data.options: {err}") from None
        if config.data.split not in splits:
            raise TrainingError(f"data.split: '{config.data.split}' is not a split of '{config.data.source}' "
                                f"(has {sorted(splits)})")
        dtype = getattr(torch, config.model.dtype)
        data = splits[config.data.split].astype(dtype)
    with steps.step(f"fit ({config.recipe.optimizer}, n={len(data)})"):
        result = train(config.model.preset, config.model.options, data, config.recipe, config.model.init,
                       dtype=dtype)
    state = {k: v.detach().cpu() for k, v in result.model.state_dict().items()}
    trainable = sum(p.numel() for p in result.model.parameters() if p.requires_grad)
    with steps.step("accuracy"):
        summary: dict[str, Any] = {
            "output": str(out_dir), "n": len(data), "train_seconds": round(result.seconds, 3),
            "final_objective": result.fit.final_objective, "gradient_norm": result.fit.gradient_norm,
            "steps": result.fit.steps, "trainable_parameters": int(trainable),
            "parameters": int(sum(p.numel() for p in result.model.parameters())),
            "train_accuracy": task_accuracy(result.model, result.task, data),
        }
        if config.data.eval_split and config.data.eval_split in splits:
            summary[f"{config.data.eval_split}_accuracy"] = task_accuracy(
                result.model, result.task, splits[config.data.eval_split].astype(dtype))
    recipe = config.recipe
    card = ModelCard(
        preset=config.model.preset, options=config.model.options,
        data=DataRef(source=config.data.source, options=config.data.options, split=config.data.split),
        training=TrainingRecord(
            weight_decay=recipe.weight_decay, n=len(data), epochs=recipe.epochs, lr=recipe.lr,
            batch_size=recipe.batch_size, optimizer=recipe.optimizer, seed=recipe.seed,
            extra={
                "recipe": recipe.model_dump(), "init": config.model.init.model_dump(), "dtype": config.model.dtype,
                "init_report": result.init_report, "eval_split": config.data.eval_split,
                "fit": {k: summary[k] for k in ("final_objective", "gradient_norm", "steps", "train_seconds")},
                "metrics": {k: v for k, v in summary.items() if k.endswith("_accuracy")},
                "seeds": {"init": recipe.seed, "shuffle": recipe.seed, "dropout": recipe.seed},
                "torch": torch.__version__, "python": platform.python_version(),
            },
        ),
    )
    with steps.step("write"):
        summary["sha256"] = write_model_dir(out_dir, state, card)
    return summary


