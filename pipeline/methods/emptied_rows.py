"""The removal step both trajectory-refit and lfoci-newton's Gauss-Newton path take for a class the request empties:
its decision-layer rows set to Retrain's, replayed along the recorded run (``pipeline.target.emptied_classes``).

``plan_emptied_rows`` finds the classes U empties and replays their rows (before the method moves anything: the
replay reads the recorded checkpoints, not the model's weights); ``EmptiedRows.apply`` writes them into the model;
``EmptiedRows.record`` is what the removal's record says (the classes, the rows' parameters, the replay's sample
and sub-steps, or why nothing was set)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from torch import Tensor, nn

from pipeline.methods.base import RemovalProblem, stream_seed
from pipeline.methods.trust_region import draw
from pipeline.recipe import recipe_of
from pipeline.trajectory import retrain_rates
from pipeline.target.emptied_classes import (
    emptied_classes, emptied_rows_record, output_layer_names, replayed_rows, reset_emptied_rows,
)

__all__ = ["EMPTIED_STREAM", "EmptiedRows", "EmptiedMode", "emptied_classes_field", "emptied_class_samples_field",
           "plan_emptied_rows"]

EMPTIED_STREAM = 36  # the replay's sample of D \ U (hashed with the removal seed)
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
    return Field(256, gt=0, description="the replay's seeded sample of D \\ U (one forward pass of it per recorded "
                                        "checkpoint)")


@dataclass
class EmptiedRows:
    """The emptied classes' replayed rows (none where nothing is set; ``record`` says why)."""

    record: dict[str, Any]
    rows: dict[str, Tensor] = field(default_factory=dict)

    @property
    def classes(self) -> list[int]:
        return list(self.record.get("classes") or [])

    def apply(self, model: nn.Module) -> None:
        """Write the rows into ``model``'s decision layer (nothing where there are none)."""
        if self.rows:
            reset_emptied_rows(model, self.rows, self.classes)


def _not_set(why: str) -> EmptiedRows:
    return EmptiedRows({"classes": [], "applied": False, "why": why})


def plan_emptied_rows(problem: RemovalProblem, mode: EmptiedMode, samples: int,
                      timings: dict[str, float]) -> EmptiedRows:
    """The classes U empties and, under ``replayed``, their rows as Retrain leaves them: the whole model over a seeded
    sample of ``samples`` of D \\ U at each of the recorded checkpoints (whose names are the model's)."""
    if mode == "corrected":
        return _not_set("emptied_classes: corrected")
    trajectory = problem.trajectory
    if trajectory is None:
        return _not_set("no recorded training trajectory (the replay starts from its first checkpoint)")
    labels = problem.train.columns.get("y")
    if problem.task.loss != "cross_entropy" or labels is None or labels.dim() != 1:
        return _not_set("not a single-label cross-entropy classifier")
    classes = emptied_classes(labels, problem.forget_positions)
    if not classes:
        return _not_set("every class of U keeps retained samples")
    try:
        names = output_layer_names(problem.model)
    except ValueError as err:
        return _not_set(f"no decision layer found: {err}")
    if any(n is not None and n not in trajectory.checkpoints[0] for n in names):
        return _not_set("the recorded trajectory lacks the decision layer")
    recipe = recipe_of(problem.card) if problem.card is not None else None
    retain = problem.train.without(problem.forget_positions)
    # Retrain's clock: the recipe on D \ U (fewer steps an epoch than the recorded run on the original D)
    rates = None if recipe is None else retrain_rates(trajectory, recipe, len(retain))
    steps = 1 if recipe is None else max(1, math.ceil(len(retain) / recipe.batch_size) * recipe.epochs
                                          // max(1, len(trajectory.rates)))
    sample = draw(retain, samples, stream_seed(problem.seed, EMPTIED_STREAM))
    with problem.stage("emptied_classes", timings):
        rows, how = replayed_rows(problem.model, problem.task, sample, trajectory, names, classes,
                                  problem.weight_decay, steps, problem.batch_size, rates=rates)
    how["clock"] = (f"Retrain's: the recipe on the {len(retain)} retained samples" if rates is not None else
                    "the recorded run's (no card: the recipe is unknown)")
    return EmptiedRows({**emptied_rows_record(classes, names), **how, "applied": True}, rows)
