"""Apply one removal to a model directory, in memory: the wiring between a model card, its
training data and a registered method. Used by `unlearn forget`, campaigns and the stream
service alike."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.data import SampleSet, load_source
from pipeline.methods.base import CurvatureFactory, ProbeRunner, RemovalProblem, get_method
from pipeline.checkpoint import read_state_dict
from pipeline.methods.mixed_linear import USER_WEIGHT_PREFIX
from pipeline.models.card import ModelCard, load_model_dir


#: Mixed-Linear models keep their user weights w_u beside the core weights, in this file of
#: the model directory (full parameter shapes, zero outside the user block).
USER_WEIGHTS_FILE = "user_weights.safetensors"


@dataclass
class RemovalRun:
    new_state: dict[str, Tensor]
    card: ModelCard
    record: dict[str, Any]
    user_weights: dict[str, Tensor] | None = None  # for Mixed-Linear models: the new w_u


def training_set(card: ModelCard) -> SampleSet:
    """The model's current training set: the card's data split minus samples already removed."""
    splits = load_source(card.data.source, card.data.options)
    if card.data.split not in splits:
        raise ValueError(f"data split '{card.data.split}' not in source '{card.data.source}' (has {sorted(splits)})")
    full = splits[card.data.split]
    if card.training.removed_ids:
        full = full.without(full.positions_of(card.training.removed_ids, field="removed_ids"))
    if len(full) != card.training.n:
        raise ValueError(
            f"the model card says n={card.training.n} training samples but the data gives {len(full)}; "
            "the card and the dataset do not belong together"
        )
    return full


def remove(
    model_dir: str | Path,
    forget_ids: list[int],
    *,
    method: str = "lfoci-newton",
    settings: dict[str, Any] | None = None,
    seed: int = 0,
    device: str = "cpu",
    batch_size: int = 1024,
    probe_runner: ProbeRunner | None = None,
    curvature_factory: CurvatureFactory | None = None,
) -> RemovalRun:
    """Remove ``forget_ids`` from the model in ``model_dir``; nothing is written.

    ``probe_runner`` / ``curvature_factory``: how the probe and the training-set curvature run
    (default: in this process; ``cluster`` supplies Ray versions built on the same directory)."""
    started = time.perf_counter()
    impl = get_method(method)
    parsed = impl.Settings.model_validate(settings or {})
    model, task, card = load_model_dir(model_dir)
    train = training_set(card)
    positions = train.positions_of(forget_ids, field="forget_ids")
    model.to(device)
    extras: dict[str, Any] = {}
    user_file = Path(model_dir) / USER_WEIGHTS_FILE
    if user_file.exists():
        extras["user_weights"] = read_state_dict(user_file)
    problem = RemovalProblem(
        model=model, task=task, train=train.to(device), forget_positions=positions,
        weight_decay=card.training.weight_decay, seed=seed, batch_size=batch_size,
        probe_runner=probe_runner, curvature_factory=curvature_factory, extras=extras,
    )
    outcome = impl.run(problem, parsed)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    user = {k[len(USER_WEIGHT_PREFIX):]: v.detach().cpu() for k, v in outcome.new_parameters.items()
            if k.startswith(USER_WEIGHT_PREFIX)}
    core = {k: v.detach().cpu() for k, v in outcome.new_parameters.items() if not k.startswith(USER_WEIGHT_PREFIX)}
    unknown = sorted(set(core) - set(state))
    if unknown:
        raise KeyError(f"method '{method}' returned parameters the model does not have: {unknown[:10]}")
    state.update(core)
    for key, value in user.items():
        if not bool(torch.isfinite(value).all()):
            raise FloatingPointError(f"the removal produced non-finite user weights in '{key}'; nothing was written")
    for key, value in state.items():
        if not bool(torch.isfinite(value).all()):
            raise FloatingPointError(f"the removal produced non-finite values in '{key}'; nothing was written")
    new_card = card.model_copy(deep=True)
    new_card.training.removed_ids = sorted(set(card.training.removed_ids) | set(int(i) for i in forget_ids))
    new_card.training.n = card.training.n - len(forget_ids)
    record = {
        "method": method,
        "settings": parsed.model_dump(),
        "seed": seed,
        "forget_ids": [int(i) for i in forget_ids],
        "n_before": card.training.n,
        "n_after": new_card.training.n,
        **outcome.record,
        "wall_seconds": time.perf_counter() - started,
    }
    return RemovalRun(state, new_card, record, user_weights=user or None)
