"""Apply one removal to a model directory, in memory: the wiring between a model card, its
training data and a registered method. ``unlearn forget``, campaigns, the stream service,
the evaluation protocol, benchmarks and tests all call ``remove``; nothing is written here.

Sample ids keep one name from the request file to the record: ``sample_ids``. An unknown id
is a ``SampleIdError`` quoting the field the caller says the user wrote (``field``, e.g.
``forget.sample_ids``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.data import SampleSet, load_source
from pipeline.methods.base import (
    CurvatureFactory, MethodSettings, ProbeRunner, RemovalProblem, StageHook, get_method, parse_settings,
)
from pipeline.methods.mixed_linear import USER_WEIGHT_PREFIX, USER_WEIGHTS_FILE, UserWeights, read_user_weights
from pipeline.models.card import ModelCard, load_model_dir

__all__ = ["RemovalRun", "USER_WEIGHTS_FILE", "remove", "training_set"]


@dataclass
class RemovalRun:
    new_state: dict[str, Tensor]
    card: ModelCard
    record: dict[str, Any]
    user_weights: UserWeights | None = None  # for Mixed-Linear models: the new w_u, bound to D_r


def training_set(card: ModelCard, model: nn.Module | None = None) -> SampleSet:
    """The model's current training set: the card's data split minus samples already removed;
    given the ``model``, its floating columns in the model's dtype (a float64 model, trained with
    ``model.dtype: float64``, sees float64 data)."""
    splits = load_source(card.data.source, card.data.options)
    if card.data.split not in splits:
        raise ValueError(f"data split '{card.data.split}' not in source '{card.data.source}' (has {sorted(splits)})")
    full = splits[card.data.split]
    if card.training.removed_ids:
        full = full.without(full.positions_of(card.training.removed_ids, field="model card training.removed_ids"))
    if len(full) != card.training.n:
        raise ValueError(
            f"the model card says n={card.training.n} training samples but the data gives {len(full)}; "
            "the card and the dataset do not belong together"
        )
    dtype = None if model is None else next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return full if dtype is None else full.astype(dtype)


def remove(
    model_dir: str | Path,
    sample_ids: Sequence[int],
    *,
    method: str = "lfoci-newton",
    settings: MethodSettings | Mapping[str, Any] | None = None,
    seed: int = 0,
    device: str = "cpu",
    batch_size: int = 1024,
    probe_runner: ProbeRunner | None = None,
    curvature_factory: CurvatureFactory | None = None,
    stage_hook: StageHook | None = None,
    field: str = "sample_ids",
    memory_budget: "memory.MemoryBudget | str | int | None" = "auto",
) -> RemovalRun:
    """Remove ``sample_ids`` from the model in ``model_dir``; nothing is written.

    ``probe_runner`` / ``curvature_factory``: how the probe and the training-set curvature run
    (default: in this process; ``cluster`` supplies Ray versions built on the same directory).
    ``stage_hook`` is told when each stage of the method starts and ends. ``field`` names the
    ids in error messages the way the user wrote them (e.g. ``forget.sample_ids``).

    ``memory_budget`` ("auto", "8GiB", bytes): the working memory each stage of the method may
    use on top of the loaded model and data (``pipeline.memory``); chunks (samples per batch,
    Hessian columns per pass, perturbations per pass) shrink to fit it, and a budget that cannot
    hold one chunk raises ``MemoryBudgetError`` before that stage allocates anything."""
    started = time.perf_counter()
    impl = get_method(method)
    parsed = parse_settings(method, settings)
    budget = memory.MemoryBudget.from_setting(memory_budget, device)
    model, task, card = load_model_dir(model_dir)
    train = training_set(card, model)
    ids = [int(i) for i in sample_ids]
    positions = train.positions_of(ids, field=field)
    model.to(device)
    extras: dict[str, Any] = {}
    user_file = Path(model_dir) / USER_WEIGHTS_FILE
    if user_file.exists():
        extras["user_weights"] = read_user_weights(user_file)
    problem = RemovalProblem(
        model=model, task=task, train=train.to(device), forget_positions=positions,
        weight_decay=card.training.weight_decay, seed=seed, batch_size=batch_size,
        probe_runner=probe_runner, curvature_factory=curvature_factory, extras=extras, stage_hook=stage_hook,
        memory_budget=budget,
    )
    with memory.use_budget(budget):
        memory.check_one_sample(model, task, problem.train, budget)
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
    new_card.training.removed_ids = sorted(set(card.training.removed_ids) | set(ids))
    new_card.training.n = card.training.n - len(ids)
    record = {
        "method": method,
        "settings": parsed.model_dump(mode="json"),
        "seed": seed,
        "memory_budget": budget.describe(),
        "sample_ids": ids,
        "n_before": card.training.n,
        "n_after": new_card.training.n,
        **outcome.record,
        "release": outcome.release.model_dump(mode="json"),
        "wall_seconds": time.perf_counter() - started,
    }
    user_weights = None
    if user:
        user_weights = UserWeights(user, weight_decay=card.training.weight_decay,
                                   sample_ids=problem.retain.sample_ids.tolist())
    return RemovalRun(state, new_card, record, user_weights=user_weights)
