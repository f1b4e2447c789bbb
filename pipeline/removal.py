"""Apply one removal to a model directory, in memory: the wiring between a model card, its
training data and a registered method's two calls (``prepare``, ``remove``; ``pipeline.methods.
base.run_removal``). ``unlearn forget``, ``unlearn eval``, campaigns, the stream service,
benchmarks and tests all call ``remove``; nothing is written here.

A caller that serves several requests on one model keeps the prepared state: ``remove`` takes
``prepared`` (used only where it holds for the model, data and settings; else prepared anew, and
the record says why) and the returned ``RemovalRun`` offers ``next_prepared()``: the state of the
version it made, updated from the removal where the maths allows (``Prepared.after_removal``).

Sample ids keep one name from the request file to the record: ``sample_ids``. An unknown id
is a ``SampleIdError`` quoting the field the caller says the user wrote (``field``, e.g.
``forget.sample_ids``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.data import SampleSet, load_source
from pipeline.methods.base import (
    CurvatureFactory, MethodRef, MethodSettings, ProbeRunner, RemovalMethod, RemovalProblem, StageHook, TrainedModel,
    get_method, run_removal,
)
from pipeline.methods.mixed_linear import USER_WEIGHT_PREFIX, USER_WEIGHTS_FILE, UserWeights, read_user_weights
from pipeline.trajectory import locate_trajectory, read_trajectory
from pipeline.models.card import ModelCard, load_model_dir
from pipeline.prepared import Prepared

__all__ = ["RemovalRun", "USER_WEIGHTS_FILE", "load_trained", "method_ref", "remove", "training_set"]


@dataclass
class RemovalRun:
    new_state: dict[str, Tensor]
    card: ModelCard
    record: dict[str, Any]
    user_weights: UserWeights | None = None  # for Mixed-Linear models: the new w_u, bound to D_r
    prepared: Prepared | None = None         # the state the removal started from
    # what ``next_prepared`` needs: the method, its settings, the new version in memory, the positions of U in D
    method: RemovalMethod | None = field(default=None, repr=False)
    settings: MethodSettings | None = field(default=None, repr=False)
    after: TrainedModel | None = field(default=None, repr=False)
    removed: Tensor | None = field(default=None, repr=False)
    outcome: Any = field(default=None, repr=False)

    def next_prepared(self) -> Prepared | None:
        """The prepared state of the version this removal made, where it can be updated from the
        removal more cheaply than prepared anew (None: prepare anew)."""
        if self.prepared is None or self.method is None or self.after is None or self.settings is None:
            return None
        binding = self.method.binding(self.after, self.settings)
        return self.prepared.after_removal(self.after, self.removed, self.outcome, binding)


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


def load_trained(model_dir: str | Path, *, device: str = "cpu", batch_size: int = 1024) -> TrainedModel:
    """The model of a directory, its card, its current training set (on ``device``) and, for a
    Mixed-Linear model, its user weights."""
    model, task, card = load_model_dir(model_dir)
    train = training_set(card, model)
    model.to(device)
    user_file = Path(model_dir) / USER_WEIGHTS_FILE
    user = read_user_weights(user_file) if user_file.exists() else None
    trajectory_file, missing = locate_trajectory(model_dir, card)  # its own, or the one its card refers to (checked)
    trajectory = read_trajectory(trajectory_file) if trajectory_file is not None else None
    return TrainedModel(model, task, train.to(device), card.training.weight_decay, batch_size, card, user, trajectory,
                        trajectory_missing=missing)


def method_ref(method: "str | MethodRef", settings: MethodSettings | Mapping[str, Any] | None = None) -> MethodRef:
    """The method a name or reference means (a variant in configs/methods/ or a registered method),
    ``settings`` on top of the variant's."""
    if isinstance(method, MethodRef):
        return method if settings is None else MethodRef.model_validate({"name": method.name, "settings": settings})
    if isinstance(settings, MethodSettings):
        return MethodRef.model_validate({"name": method, "settings": settings})
    return MethodRef.model_validate({"name": method, "settings": dict(settings or {})})


def write_returned_buffers(model: nn.Module, returned: Mapping[str, Tensor]) -> None:
    """Writes the buffers among a removal's returned tensors (batch-norm statistics a method re-estimated) into
    ``model``. The seam restores every buffer after ``remove`` (``pipeline.eval_mode``), so the in-memory model
    would otherwise keep the old statistics while the written version holds the new."""
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for key in sorted(returned.keys() & buffers.keys()):
            buffers[key].copy_(returned[key])


def remove(
    model_dir: "str | Path | TrainedModel",
    sample_ids: Sequence[int],
    *,
    method: "str | MethodRef" = "lfoci-newton",
    settings: MethodSettings | Mapping[str, Any] | None = None,
    prepared: Prepared | None = None,
    seed: int = 0,
    device: str = "cpu",
    batch_size: int = 1024,
    probe_runner: ProbeRunner | None = None,
    curvature_factory: CurvatureFactory | None = None,
    stage_hook: StageHook | None = None,
    field: str = "sample_ids",
    memory_budget: "memory.MemoryBudget | str | int | None" = "auto",
) -> RemovalRun:
    """Remove ``sample_ids`` from the model in ``model_dir`` (or an already loaded ``TrainedModel``,
    whose model is then changed in place); nothing is written.

    ``method``: a variant in configs/methods/ (``newton-head``) or a registered method, ``settings``
    on top of the variant's. ``prepared``: the method's state for this model version (used where it
    holds; the record's ``preparation`` says whether this request built it and its seconds).
    ``probe_runner`` / ``curvature_factory``: how the probe and the training-set curvature run
    (default: in this process; ``cluster`` supplies Ray versions built on the same directory).
    ``stage_hook`` is told when each stage of the method starts and ends. ``field`` names the ids
    in error messages the way the user wrote them (e.g. ``forget.sample_ids``).

    ``memory_budget`` ("auto", "8GiB", bytes): the working memory each stage of the method may
    use on top of the loaded model and data (``pipeline.memory``), scoped around the preparation
    and the removal (the one channel every pass sizes its chunks from); a budget that cannot hold
    one chunk raises ``MemoryBudgetError`` before that stage allocates anything."""
    started = time.perf_counter()
    ref = method_ref(method, settings)
    impl = get_method(ref.method)
    budget = memory.MemoryBudget.from_setting(memory_budget, device)
    trained = model_dir if isinstance(model_dir, TrainedModel) else load_trained(model_dir, device=device,
                                                                                 batch_size=batch_size)
    card = trained.card
    if card is None:
        raise ValueError("remove() needs a model with its card (load it with load_trained)")
    ids = [int(i) for i in sample_ids]
    positions = trained.train.positions_of(ids, field=field)
    problem = RemovalProblem(
        model=trained.model, task=trained.task, train=trained.train, forget_positions=positions,
        weight_decay=trained.weight_decay, seed=seed, batch_size=trained.batch_size, card=card,
        user_weights=trained.user_weights, trajectory=trained.trajectory,
        trajectory_missing=trained.trajectory_missing, probe_runner=probe_runner,
        curvature_factory=curvature_factory,
        stage_hook=stage_hook,
    )
    with memory.use_budget(budget):
        memory.check_one_sample(trained.model, trained.task, trained.train, budget)
        outcome = run_removal(impl, problem, ref.settings, prepared)
    model = trained.model
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    user = {k[len(USER_WEIGHT_PREFIX):]: v.detach().cpu() for k, v in outcome.new_parameters.items()
            if k.startswith(USER_WEIGHT_PREFIX)}
    core = {k: v.detach().cpu() for k, v in outcome.new_parameters.items() if not k.startswith(USER_WEIGHT_PREFIX)}
    unknown = sorted(set(core) - set(state))
    if unknown:
        raise KeyError(f"method '{ref.method}' returned parameters the model does not have: {unknown[:10]}")
    state.update(core)
    for key, value in user.items():
        if not bool(torch.isfinite(value).all()):
            raise FloatingPointError(f"the removal produced non-finite user weights in '{key}'; nothing was written")
    for key, value in state.items():
        if not bool(torch.isfinite(value).all()):
            raise FloatingPointError(f"the removal produced non-finite values in '{key}'; nothing was written")
    write_returned_buffers(model, core)
    new_card = card.model_copy(deep=True)
    new_card.training.removed_ids = sorted(set(card.training.removed_ids) | set(ids))
    new_card.training.n = card.training.n - len(ids)
    record = {
        "method": ref.method,
        **({"variant": ref.name} if ref.name != ref.method else {}),
        "settings": ref.settings.model_dump(mode="json"),
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
    after = TrainedModel(model, trained.task, trained.train.without(positions), trained.weight_decay,
                         trained.batch_size, new_card, user_weights if user_weights is not None else outcome.user_weights,
                         trained.trajectory, trajectory_missing=trained.trajectory_missing)
    return RemovalRun(state, new_card, record, user_weights=user_weights, prepared=outcome.prepared, method=impl,
                      settings=ref.settings, after=after, removed=positions, outcome=outcome)
