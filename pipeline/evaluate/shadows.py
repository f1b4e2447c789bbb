"""A U-LiRA shadow pair's original (Hayes et al. 2024): the model's own recipe (``pipeline.recipe``: optimiser,
hyper-parameters, initialisation and init checkpoint) run on D from its start with another seed, written as a model
directory with its recorded run, as ``unlearn train`` writes it, so that a method removes from it as from the model
itself. The pair's other side is the Retrain baseline at the same seed (``pipeline.evaluate.baselines.retrain``).

Cache: under ``cache_dir`` (kind "original"), keyed like the baselines by the model's card and the seed; the
shadow's card names that key (``shadow_of``) and records its own fit, so what is cached from a shadow (its
fine-tune) is keyed by the shadow it came from. Built once across processes sharing ``cache_dir``
(``pipeline.cache_entry.building``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.cache_entry import building
from pipeline.checkpoint import atomic_write_bytes
from pipeline.data.sampleset import SampleSet
from pipeline.evaluate.baselines import RECORD_FILE, cache_key
from pipeline.models.card import ModelCard, write_model_dir
from pipeline.recipe import init_of, recipe_of, train
from pipeline.trajectory import TRAJECTORY_FILE, save_trajectory, without_trajectory_reference


def card_at_seed(card: ModelCard, seed: int) -> ModelCard:
    """``card`` as if its recipe had run with ``seed`` (init, shuffling and dropout): the card of a shadow original,
    before its own fit is recorded. The reference to a recorded run is dropped (a shadow keeps its own beside it), and
    so are the fit's and the metrics' records, which were the model's."""
    recipe = recipe_of(card).model_copy(update={"seed": int(seed)})
    extra = {k: v for k, v in without_trajectory_reference(card).training.extra.items() if k not in ("fit", "metrics")}
    extra.update({"recipe": recipe.model_dump(mode="json"),
                  "seeds": {"init": int(seed), "shuffle": int(seed), "dropout": int(seed)}})
    return card.model_copy(update={"training": card.training.model_copy(update={"seed": int(seed), "extra": extra})})


def original_at_seed(card: ModelCard, data: SampleSet, seed: int, directory: str | Path, *,
                     cache_dir: str | Path | None = None) -> tuple[Path, float, bool]:
    """The card's recipe run on ``data`` (the model's training set D) from its start with ``seed``, in the card's
    dtype, written to ``cache_dir`` (where given; a hit skips training) or ``directory``. Returns (the directory,
    the training's seconds, whether it was cached)."""
    key = cache_key(card, [], "original", {"seed": int(seed)})
    if cache_dir is None:
        target = Path(directory)
        seconds = _train_into(target, card, data, seed, key)
        return target, seconds, False
    target = Path(cache_dir) / f"original-{key[:20]}"

    with building(target, RECORD_FILE) as staging:   # once across processes sharing cache_dir
        if staging is None:   # cached
            return target, float(json.loads((target / RECORD_FILE).read_text())["seconds"]), True
        seconds = _train_into(staging, card, data, seed, key)
    return target, seconds, False


def _train_into(folder: Path, card: ModelCard, data: SampleSet, seed: int, key: str) -> float:
    """Train the shadow original at ``seed`` into ``folder`` (its recorded run, the model, the record last);
    returns the training's seconds."""
    shadow = card_at_seed(card, seed)
    result = train(card.preset, card.options, data, recipe_of(shadow), init_of(shadow),
                   dtype=getattr(torch, str(card.training.extra.get("dtype", "float32"))))
    fit = {"final_objective": result.fit.final_objective, "gradient_norm": result.fit.gradient_norm,
           "steps": result.fit.steps, "train_seconds": round(result.seconds, 3)}
    shadow.training.extra.update({"fit": fit, "shadow_of": key})
    folder.mkdir(parents=True, exist_ok=True)
    if result.trajectory is not None:
        save_trajectory(folder / TRAJECTORY_FILE, result.trajectory)
    write_model_dir(folder, {k: v.detach().cpu() for k, v in result.model.state_dict().items()}, shadow)
    atomic_write_bytes(folder / RECORD_FILE, json.dumps({"kind": "original", "key": key,
                                                         "seconds": result.seconds}).encode())
    return result.seconds
