"""A model directory: ``model.safetensors`` plus ``model.json`` (the model card).

The card records what removal needs besides the weights: the preset and its options, the
dataset the model was trained on (source, options, the sample ids of its training set), the
weight decay lambda of the objective mean-loss + (lambda/2)||w||^2, the recipe and seeds.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.checkpoint import atomic_write_bytes, load_into, read_state_dict, save_safetensors

WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "model.json"


class DataRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    options: dict[str, Any] = Field(default_factory=dict)
    split: str = "train"


class TrainingRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_decay: float = Field(ge=0)
    n: int = Field(gt=0)
    epochs: int = 0
    lr: float = 0.0
    batch_size: int = 0
    optimizer: str = "lbfgs"
    seed: int = 0
    removed_ids: list[int] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict)


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="forbid")
    preset: str
    options: dict[str, Any] = Field(default_factory=dict)
    data: DataRef
    training: TrainingRecord


def write_model_dir(directory: str | Path, state: dict, card: ModelCard) -> str:
    """Write weights then card, each atomically. Returns the weights' sha256."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    digest = save_safetensors(state, directory / WEIGHTS_FILE)
    atomic_write_bytes(directory / CARD_FILE, card.model_dump_json(indent=2).encode())
    return digest


def read_card(directory: str | Path) -> ModelCard:
    path = Path(directory) / CARD_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: a model directory needs {CARD_FILE}")
    return ModelCard.model_validate(json.loads(path.read_text()))


def load_model_dir(directory: str | Path):
    """Build the preset from the card and load the weights strictly. Returns (module, task, card)."""
    from pipeline.models.registry import build

    card = read_card(directory)
    module, task = build(card.preset, card.options)
    state = read_state_dict(Path(directory) / WEIGHTS_FILE)
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(dtypes) == 1:  # keep the checkpoint's precision (e.g. float64 oracle models)
        module.to(dtypes.pop())
    load_into(module, state, source=str(Path(directory) / WEIGHTS_FILE))
    return module, task, card
