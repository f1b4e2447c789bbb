"""``unlearn train CONFIG.yaml``: train or fine-tune a preset on a dataset, write a model directory.

The config (``TrainConfig``) and the run (``run_training``) are ``pipeline.trainer``; this
module reads the YAML through ``pipeline.config`` and reports errors as a message + exit 1.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from jobs.usererrors import user_errors
from pipeline.config import load_config
from pipeline.trainer import TrainConfig, run_training


@click.command("train")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--output", "-o", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="model directory to write (overrides 'output' in the config)")
@click.option("--seed", type=int, default=None, help="override recipe.seed")
@user_errors
def command(config: Path, output: Path | None, seed: int | None) -> None:
    """Train or fine-tune a model preset on a dataset (CONFIG: YAML) and write a model directory."""
    cfg = load_config(TrainConfig, config, "train config")
    if seed is not None:
        cfg = cfg.model_copy(update={"recipe": cfg.recipe.model_copy(update={"seed": seed})})
    summary = run_training(cfg, output)
    click.echo(json.dumps(summary, indent=2))
