"""The removal step both trajectory-refit and lfoci-newton's Gauss-Newton path take for a class the request empties:
its decision-layer rows set to Retrain's, replayed along the recorded run (``pipeline.target.emptied_classes``).

``plan_emptied_rows`` finds the classes U empties and replays their rows (before the method moves anything: the
replay reads the recorded checkpoints, not the model's weights; their views of the replay's sample are kept in the
method's prepared state by the first request that computes them); ``EmptiedRows.apply`` writes them into the model;
``EmptiedRows.record`` is what the removal's record says (the classes, the rows' parameters, the replay's sample
and sub-steps, or why nothing was set)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.data import SampleSet
from pipeline.frozen_prefix import deterministic_prefix
from pipeline.methods.base import RemovalProblem, stream_seed
from pipeline.methods.prefix_prepared import FrozenPrefixPrepared, over_half_budget
from pipeline.methods.trust_region import draw
from pipeline.param_block import ParamBlock
from pipeline.prepared import Prepared, content_digest, digest_tensor
from pipeline.recipe import recipe_of
from pipeline.trajectory import retrain_rates
from pipeline.target.emptied_classes import (
    CheckpointViews, checkpoint_views, emptied_classes, emptied_rows_record, integrate_rows, output_layer_names,
    reset_emptied_rows,
)

__all__ = ["EMPTIED_STREAM", "EmptiedRows", "EmptiedMode", "absent_classes", "emptied_classes_field",
           "emptied_class_samples_field", "plan_emptied_rows"]

EMPTIED_STREAM = 36  # the replay's per-request sample of D \ U (hashed with the removal seed)
VIEWS_SEED = stream_seed(0, EMPTIED_STREAM)  # the replay's sample S of D, the same for every request on a model
EmptiedMode = Literal["replayed", "corrected"]


def emptied_classes_field() -> Any:
    """The ``emptied_classes`` setting of every method that takes this step (one definition, a field per class)."""
    return Field("replayed", description="the decision layer's rows of a class U empties (no retained sample has it), "
                                         "where the method's step holds them and the model has a recorded trajectory: "
                                         "replayed: Retrain's, from the recipe's initial rows along the recorded run "
                                         "under the weight decay and the retained samples' softmax pushes "
                                         "(pipeline/target/emptied_classes.py), set after the method's step and refit; "
                                         "corrected: left to the method's own step like every other weight")


def emptied_class_samples_field() -> Any:
    """The ``emptied_class_samples`` setting (see ``emptied_classes_field``)."""
    return Field(256, gt=0, description="the replay's fixed seeded sample of D, U's members dropped (one forward pass of "
                                        "it per recorded checkpoint, by the first request that needs it; kept in the "
                                        "method's prepared state for later requests and versions)")


@dataclass
class EmptiedRows:
    """The emptied classes' replayed rows (none where nothing is set; ``record`` says why)."""

    record: dict[str, Any]
    rows: dict[str, Tensor] = field(default_factory=dict)

    @property
    def classes(self) -> list[int]:
        """The classes this request empties."""
        return list(self.record.get("classes") or [])

    @property
    def written(self) -> list[int]:
        """The classes whose rows ``apply`` writes, in the rows' order: the ones this request empties and those D
        already lacks, replayed with them (``plan_emptied_rows``)."""
        return list(self.record.get("written") or self.classes)

    def apply(self, model: nn.Module) -> None:
        """Write the rows into ``model``'s decision layer (nothing where there are none)."""
        if self.rows:
            reset_emptied_rows(model, self.rows, self.written)


def _not_set(why: str) -> EmptiedRows:
    return EmptiedRows({"classes": [], "applied": False, "why": why})


def plan_emptied_rows(problem: RemovalProblem, mode: EmptiedMode, samples: int, timings: dict[str, float],
                      prepared: Prepared | None = None,
                      admits: Callable[[list[int], tuple[str, str | None]], str | None] | None = None) -> EmptiedRows:
    """The classes U empties and, under ``replayed``, their rows as Retrain leaves them, from the recorded run's views
    (``checkpoint_views``) of a fixed seeded sample S of D, U's members dropped: kept in ``prepared`` (a
    ``FrozenPrefixPrepared``) by the first request that computes them, for every later request and version; per
    request, on a sample of D \\ U of the removal's seed, where fewer than half of S are retained (or nothing keeps
    them). ``admits(classes, names)``: why the method's step cannot take these rows (None: it can).

    The classes earlier requests on this model emptied (kept in ``prepared``) that D still lacks are replayed
    jointly with U's and written too, on every request: Retrain on D \\ U has none of their samples, and each row's
    softmax share enters the others' equations. Where ``admits`` refuses them, U's rows alone are written."""
    if mode == "corrected":
        return _not_set("emptied_classes: corrected")
    trajectory = problem.trajectory
    if trajectory is None:
        return _not_set(f"no recorded training trajectory ({problem.trajectory_missing or 'none was written'}; the "
                        "replay starts from its first checkpoint)")
    labels = problem.train.columns.get("y")
    if problem.task.loss != "cross_entropy" or labels is None or labels.dim() != 1:
        return _not_set("not a single-label cross-entropy classifier")
    classes = emptied_classes(labels, problem.forget_positions)
    try:
        names = output_layer_names(problem.model)
    except ValueError as err:
        return _not_set(f"no decision layer found: {err}") if classes else _not_set(
            "every class of U keeps retained samples")
    n_classes = int(dict(problem.model.named_parameters())[names[0]].shape[0])
    keeper = prepared if isinstance(prepared, FrozenPrefixPrepared) else None
    absent = absent_classes(labels, keeper.emptied_classes) if keeper is not None else []
    if not classes and not absent:
        return _not_set("every class of U keeps retained samples")
    if any(not 0 <= c < n_classes for c in classes):
        return _not_set(f"labels {classes} outside the decision layer's {n_classes} rows")
    missing = sorted(k for k, p in problem.model.named_parameters() if p.requires_grad and k not in
                     trajectory.checkpoints[0])
    if missing:  # the replay's features would read today's weights there, not the recorded run's
        return _not_set(f"the recorded trajectory lacks the trainable parameters {missing[:5]}")
    if keeper is not None:
        keeper.emptied_classes.update(classes)  # a request refused later leaves them in D: absent_classes skips them
    replayed = sorted(set(classes) | set(absent))
    written, absent_refused = replayed, None
    if admits is not None:
        if classes and (why := admits(classes, names)) is not None:
            return EmptiedRows({"classes": classes, "applied": False, "why": why})
        if absent and (absent_refused := admits(replayed, names)) is not None:
            written = classes
            if not written:
                return _not_set(f"the rows of the classes earlier removals emptied {absent}: {absent_refused}")
    recipe = recipe_of(problem.card) if problem.card is not None else None
    retain = problem.train.without(problem.forget_positions)
    # Retrain's clock: the recipe on D \ U (fewer steps an epoch than the recorded run on the original D)
    rates = None if recipe is None else retrain_rates(trajectory, recipe, len(retain))
    steps = 1 if recipe is None else max(1, math.ceil(len(retain) / recipe.batch_size) * recipe.epochs
                                          // max(1, len(trajectory.rates)))
    with problem.stage("emptied_classes", timings):
        views, source = _views(problem, retain, names[0], samples, prepared)
        rows, how = integrate_rows(views, trajectory, names, replayed, problem.weight_decay, steps,
                                   float(problem.task.loss_options.get("label_smoothing", 0.0)), rates=rates)
    if written != replayed:
        keep = torch.as_tensor([replayed.index(c) for c in written], dtype=torch.long)
        rows = {name: value.index_select(0, keep) for name, value in rows.items()}
    how["views"] = source
    how["clock"] = (f"Retrain's: the recipe on the {len(retain)} retained samples" if rates is not None else
                    "the recorded run's (no card: the recipe is unknown)")
    record = {**emptied_rows_record(classes, names), **how, "applied": True}
    if absent:
        record.update(absent_classes=absent, written=written)
        if absent_refused is not None:
            record["absent_not_written"] = absent_refused
    return EmptiedRows(record, rows)


def absent_classes(labels: Tensor, emptied: set[int]) -> list[int]:
    """The classes of ``emptied`` (earlier requests emptied them) that no sample of D (``labels``) has."""
    return sorted(set(emptied) - set(torch.as_tensor(labels).reshape(-1).tolist()))


def _views(problem: RemovalProblem, retain: SampleSet, weight: str, samples: int, prepared: Prepared | None
           ) -> tuple[CheckpointViews, str]:
    """The checkpoint views of the replay's sample of D \\ U and where they came from (see ``plan_emptied_rows``):
    the kept views of S where at least half of S is retained; else S drawn anew from the current D and kept, where at
    least half of it is retained (checked before any pass); else, or where nothing can keep them, a sample of
    D \\ U of the removal's seed, for this request alone."""
    need = min(samples, len(retain))
    keeper = prepared if isinstance(prepared, FrozenPrefixPrepared) else None
    held = _suffix_inputs(problem, keeper)
    data = problem.train
    work, task = (None, problem.task) if held is None else (held.suffix, held.task)
    retained_ids = torch.as_tensor(retain.sample_ids)

    def read(sample: SampleSet) -> CheckpointViews:
        """The views of ``sample`` (samples of D; the suffix over their prefix outputs where the prefix is kept)."""
        return checkpoint_views(problem.model, task, sample if held is None else held.inputs(sample),
                                problem.trajectory, weight, problem.batch_size, work)

    if keeper is not None:
        key = _views_key(problem, weight, samples)
        stored = keeper.checkpoint_views.get(key)
        if stored is not None:
            views = stored.take(torch.isin(stored.sample_ids, retained_ids))
            if 2 * len(views) >= need:
                return views, (f"kept from an earlier request on this model: S, {len(stored)} samples of D, "
                               f"{len(views)} of them retained")
        sample = draw(data, samples, VIEWS_SEED)
        inside = torch.isin(torch.as_tensor(sample.sample_ids), retained_ids)
        if 2 * int(inside.sum()) >= need:
            whole = read(sample)
            source = "computed for this request" + ("" if stored is None else
                                                    " (S drawn anew: fewer than half of the kept one are retained)")
            too_large = over_half_budget(problem.model, whole.nbytes + keeper.held_bytes,
                                         "the replay's checkpoint views with the prefix's outputs", device="cpu")
            if too_large is None:
                keeper.checkpoint_views.clear()
                keeper.checkpoint_views[key] = whole
                source += ", kept for later requests on this model and its later versions"
            else:
                source += f", not kept: {too_large}"
            return whole.take(inside), f"{source}: S, {len(whole)} samples of D, {int(inside.sum())} of them retained"
    positions = problem.train.positions_of(
        draw(retain, samples, stream_seed(problem.seed, EMPTIED_STREAM)).sample_ids, field="emptied class sample")
    why = ("no prepared state keeps them" if keeper is None else
           f"fewer than half of the {samples} samples of S are retained")
    return read(data.take(positions)), f"per request ({why}): a sample of {need} of D \\ U of the removal's seed"


def _suffix_inputs(problem: RemovalProblem, keeper: FrozenPrefixPrepared | None) -> Any:
    """The prepared frozen prefix's suffix and inputs where the replay may read the suffix over its outputs: the
    prefix computes the same in training as in eval mode (no batch normalisation, no dropout) and the checkpoints
    hold only trainable parameters (loading one leaves the prefix as it is); else None (the whole model)."""
    held = keeper.suffix_inputs(problem.model, problem.task, problem.batch_size) if keeper is not None else None
    if held is None:
        return None
    trainable = {k for k, p in problem.model.named_parameters() if p.requires_grad}
    if not set(problem.trajectory.checkpoints[0]) <= trainable:
        return None
    return held if deterministic_prefix(problem.model, problem.task, ParamBlock.all_parameters(problem.model)) else None


def _views_key(problem: RemovalProblem, weight: str, samples: int) -> tuple[int, int, str]:
    """What kept views were computed from: the sample's size, the batches (batch normalisation reads them), and the
    recorded run (its n, rates and the decision layer's weight at every checkpoint)."""
    trajectory = problem.trajectory
    h = content_digest()
    h.update(repr((trajectory.n, list(trajectory.rates))).encode())
    for e, checkpoint in enumerate(trajectory.checkpoints):
        digest_tensor(h, f"{e}/{weight}", checkpoint[weight])
    return samples, int(problem.batch_size), h.hexdigest()
