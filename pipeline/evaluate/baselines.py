"""The two baselines every removal is judged against, cached per forget set.

  Retrain    the model's own recipe (``pipeline.recipe``: same optimiser, hyper-parameters,
             seed, initialisation and init checkpoint) run from the same start on D_r = D \\ D_f.
             The gold standard: the distribution unlearning should reproduce.
  Fine-tune  ("FT", Warnecke et al. 2023; Jia et al. 2023): continue training the original
             weights on D_r for a few epochs of SGD (catastrophic forgetting of D_f); cheap,
             no guarantee.

Cache: one model directory per (kind, key) under ``cache_dir``, key = sha256 of the canonical
JSON of {model card, sorted forget ids, recipe, baseline settings}; a hit skips training. The
cached card records n = |D_r| and the removed ids, like a removal would. Each entry is built once
across processes sharing ``cache_dir`` (``pipeline.cache_entry.building``): one trains, the others
wait and read it.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pipeline.cache_entry import building
from pipeline.checkpoint import atomic_write_bytes
from pipeline.data.sampleset import SampleSet
from pipeline.models.card import ModelCard, load_model_dir, write_model_dir
from pipeline.recipe import Recipe, fit, init_of, initial_model, recipe_of
from pipeline.tasks import Task
from pipeline.trajectory import without_trajectory_reference

RECORD_FILE = "baseline.json"


class FineTuneSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: int = Field(2, ge=1)
    lr: float | None = Field(None, gt=0, description="default: the recipe's lr (0.01 for L-BFGS recipes)")
    batch_size: int | None = Field(None, ge=1, description="default: the recipe's batch size (128 for full batch)")
    momentum: float = Field(0.9, ge=0, lt=1)


def cache_key(card: ModelCard, forget_ids: list[int], kind: str, settings: dict[str, Any]) -> str:
    payload = {
        "card": card.model_dump(mode="json"), "forget_ids": sorted(int(i) for i in forget_ids),
        "recipe": recipe_of(card).model_dump(mode="json"), "kind": kind, "settings": settings,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def baseline_card(card: ModelCard, forget_ids: list[int], kind: str, seconds: float, extra: dict[str, Any]) -> ModelCard:
    new = card.model_copy(deep=True)
    new.training.removed_ids = sorted(set(card.training.removed_ids) | {int(i) for i in forget_ids})
    new.training.n = card.training.n - len(forget_ids)
    new.training.extra = {**new.training.extra, "baseline": {"kind": kind, "seconds": seconds, **extra}}
    return new


@dataclass
class Baseline:
    kind: str
    model: nn.Module
    task: Task
    card: ModelCard
    seconds: float
    cached: bool
    directory: Path | None


def _cached(kind: str, key: str, cache_dir: str | Path | None) -> tuple[Path | None, Baseline | None]:
    if cache_dir is None:
        return None, None
    directory = Path(cache_dir) / f"{kind}-{key[:20]}"
    record = directory / RECORD_FILE
    if record.exists():
        model, task, card = load_model_dir(directory)
        model.eval()
        info = json.loads(record.read_text())
        return directory, Baseline(kind, model, task, card, float(info["seconds"]), True, directory)
    return directory, None


def _store(directory: Path, kind: str, key: str, model: nn.Module, card: ModelCard, seconds: float) -> None:
    card = without_trajectory_reference(card)  # the recorded run it may refer to is not this model's
    write_model_dir(directory, {k: v.detach().cpu() for k, v in model.state_dict().items()}, card)
    atomic_write_bytes(directory / RECORD_FILE, json.dumps({"kind": kind, "key": key, "seconds": seconds}).encode())


def _built_once(kind: str, key: str, cache_dir: str | Path | None, make: Callable[[], Baseline]) -> Baseline:
    """The cached baseline (kind, key), else ``make()``'s, stored under ``cache_dir`` where given. Where another
    process shares ``cache_dir``, one makes it and the others wait for it and read it."""
    directory, hit = _cached(kind, key, cache_dir)
    if hit is not None:
        return hit
    if directory is None:
        return make()
    with building(directory, RECORD_FILE) as staging:
        if staging is None:
            return _cached(kind, key, cache_dir)[1]
        made = make()
        _store(staging, kind, key, made.model, made.card, made.seconds)
    made.directory = directory
    return made


def retrain(card: ModelCard, retain: SampleSet, forget_ids: list[int], *,
            cache_dir: str | Path | None = None, seed: int | None = None) -> Baseline:
    """Retrain from the recipe's start on D_r (``seed`` overrides the recipe's, for several seeds)."""
    recipe = recipe_of(card)
    if seed is not None:
        recipe = recipe.model_copy(update={"seed": int(seed)})
    settings = {"seed": recipe.seed}
    key = cache_key(card, forget_ids, "retrain", settings)

    def train() -> Baseline:
        started = time.perf_counter()
        model, task, _ = initial_model(card.preset, card.options, seed=recipe.seed, init=init_of(card))
        report = fit(model, task, retain, recipe)
        model.eval()
        seconds = time.perf_counter() - started
        new_card = baseline_card(card, forget_ids, "retrain", seconds,
                                 {"final_objective": report.final_objective, "gradient_norm": report.gradient_norm})
        return Baseline("retrain", model, task, new_card, seconds, False, None)

    return _built_once("retrain", key, cache_dir, train)


def finetune(card: ModelCard, model: nn.Module, task: Task, retain: SampleSet, forget_ids: list[int], *,
             settings: FineTuneSettings | None = None, cache_dir: str | Path | None = None) -> Baseline:
    """A few SGD epochs on D_r from the trained weights (``model`` is copied, not modified)."""
    import copy

    settings = settings or FineTuneSettings()
    recipe = recipe_of(card)
    key = cache_key(card, forget_ids, "finetune", settings.model_dump())
    ft_recipe = Recipe(
        optimizer="sgd", epochs=settings.epochs,
        lr=settings.lr or (recipe.lr if recipe.optimizer == "sgd" and recipe.lr > 0 else 0.01),
        batch_size=settings.batch_size or (recipe.batch_size if recipe.batch_size > 0 else 128),
        weight_decay=recipe.weight_decay, momentum=settings.momentum, seed=recipe.seed,
    )

    def tune() -> Baseline:
        started = time.perf_counter()
        tuned = copy.deepcopy(model)
        report = fit(tuned, task, retain, ft_recipe)
        tuned.eval()
        seconds = time.perf_counter() - started
        new_card = baseline_card(card, forget_ids, "finetune", seconds,
                                 {"recipe": ft_recipe.model_dump(), "final_objective": report.final_objective})
        return Baseline("finetune", tuned, task, new_card, seconds, False, None)

    return _built_once("finetune", key, cache_dir, tune)


BASELINES: dict[str, Callable[..., Baseline]] = {"retrain": retrain, "finetune": finetune}
