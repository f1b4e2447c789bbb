"""``unlearn train CONFIG.yaml``: train or fine-tune a preset on a dataset, write a model directory.

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
"""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import click
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs.config import describe_validation_error
from pipeline.models.card import DataRef, ModelCard, TrainingRecord, write_model_dir
from pipeline.recipe import InitSpec, Recipe, train


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    preset: str
    options: dict[str, Any] = Field(default_factory=dict)
    init: InitSpec = Field(default_factory=InitSpec)


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    options: dict[str, Any] = Field(default_factory=dict)
    split: str = "train"
    eval_split: str | None = "test"


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelSpec
    data: DataSpec
    recipe: Recipe
    output: str | None = None


def read_config(path: str | Path) -> TrainConfig:
    """Parse and validate a train config; errors name the field."""
    path = Path(path)
    if not path.exists():
        raise click.BadParameter(f"{path} does not exist", param_hint="CONFIG")
    raw = yaml.safe_load(path.read_text()) or {}
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        raise click.BadParameter(describe_validation_error(err, str(path)), param_hint="CONFIG") from err


def accuracy(model: torch.nn.Module, task: Any, data: Any, batch_size: int = 256) -> float:
    """Top-1 accuracy (single-label) or micro-F1 (multi-label), in percent."""
    from pipeline.evaluate.classification import task_accuracy

    return task_accuracy(model, task, data, batch_size=batch_size)


def run_training(config: TrainConfig, output: str | Path | None = None) -> dict[str, Any]:
    """Train per ``config`` and write the model directory; returns a JSON-ready summary."""
    from pipeline.data import load_source
    from pipeline.models import get_preset

    try:
        get_preset(config.model.preset)  # unknown preset -> clear error before loading data
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="model.preset") from err
    if output is None and not config.output:
        raise click.BadParameter("give an output directory: 'output' in the config or --output", param_hint="output")
    out_dir = Path(output or config.output or "")
    try:
        splits = load_source(config.data.source, config.data.options)
    except (ValueError, TypeError) as err:
        raise click.BadParameter(str(err), param_hint="data.source / data.options") from err
    if config.data.split not in splits:
        raise click.BadParameter(f"data.split '{config.data.split}' is not a split of '{config.data.source}' "
                                 f"(has {sorted(splits)})", param_hint="data.split")
    data = splits[config.data.split]
    result = train(config.model.preset, config.model.options, data, config.recipe, config.model.init)
    state = {k: v.detach().cpu() for k, v in result.model.state_dict().items()}
    trainable = sum(p.numel() for p in result.model.parameters() if p.requires_grad)
    summary: dict[str, Any] = {
        "output": str(out_dir), "n": len(data), "train_seconds": round(result.seconds, 3),
        "final_objective": result.fit.final_objective, "gradient_norm": result.fit.gradient_norm,
        "steps": result.fit.steps, "trainable_parameters": int(trainable),
        "parameters": int(sum(p.numel() for p in result.model.parameters())),
        "train_accuracy": accuracy(result.model, result.task, data),
    }
    if config.data.eval_split and config.data.eval_split in splits:
        summary[f"{config.data.eval_split}_accuracy"] = accuracy(result.model, result.task, splits[config.data.eval_split])
    recipe = config.recipe
    card = ModelCard(
        preset=config.model.preset, options=config.model.options,
        data=DataRef(source=config.data.source, options=config.data.options, split=config.data.split),
        training=TrainingRecord(
            weight_decay=recipe.weight_decay, n=len(data), epochs=recipe.epochs, lr=recipe.lr,
            batch_size=recipe.batch_size, optimizer=recipe.optimizer, seed=recipe.seed,
            extra={
                "recipe": recipe.model_dump(), "init": config.model.init.model_dump(),
                "init_report": result.init_report, "eval_split": config.data.eval_split,
                "fit": {k: summary[k] for k in ("final_objective", "gradient_norm", "steps", "train_seconds")},
                "metrics": {k: v for k, v in summary.items() if k.endswith("_accuracy")},
                "seeds": {"init": recipe.seed, "shuffle": recipe.seed, "dropout": recipe.seed},
                "torch": torch.__version__, "python": platform.python_version(),
            },
        ),
    )
    summary["sha256"] = write_model_dir(out_dir, state, card)
    return summary


@click.command("train")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--output", "-o", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="model directory to write (overrides 'output' in the config)")
@click.option("--seed", type=int, default=None, help="override recipe.seed")
def command(config: Path, output: Path | None, seed: int | None) -> None:
    """Train or fine-tune a model preset on a dataset (CONFIG: YAML) and write a model directory."""
    cfg = read_config(config)
    if seed is not None:
        cfg = cfg.model_copy(update={"recipe": cfg.recipe.model_copy(update={"seed": seed})})
    summary = run_training(cfg, output)
    click.echo(json.dumps(summary, indent=2))
