"""The removal's target: where a removal puts the weights. One setting, ``target``, means one thing on
every path (the block Newton, the decision layer, the head step, Fisher, the stream):

  retrain    where Retrain, the card's recipe run on D \\ U from the card's w_init, lands. For a recipe
             that converges (``lbfgs``) or a model without a card it is the minimiser of L_{D\\U}.
             For SGD with a fixed budget it is the recipe replay (``pipeline.target.replay``) on
             blocks small enough to hold P x P (``replay_max_parameters``), and on larger blocks its
             one-window form, the training-budget damped step: the stationary point of
                 L_{D\\U}(w) - <grad_P L_D(w0) - grad_P L_{D\\U}(w0) ..., >  (``budget_damping``)
             i.e. grad_P L_{D\\U}(w') - grad_P L_D(w0) + mu (w' - w0) = 0 with mu = 1 / tau.
  minimiser  the stationary point of L_{D\\U} on the block (grad_P L_{D\\U}(w') = 0).

The anchored point grad L_{D\\U}(w') = grad L_D(w0) (formerly ``anchor: training_residual``) is not
offered: it keeps a linearised gradient-ascent term on the forgotten samples and over-forgets along
the flat directions where training had not converged (docs/METHODS.md, "The removal's target").
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pipeline.target.replay import ReplayCost, ReplayPrepared, ReplaySchedule, prepare_replay, replay_target

if TYPE_CHECKING:
    from pipeline.models.card import ModelCard

__all__ = [
    "REPLAY_MAX_PARAMETERS", "ReplayCost", "ReplayPrepared", "ReplaySchedule", "TargetKind", "budget_damping",
    "prepare_replay", "replay_schedule", "replay_target", "resolve_target",
]

TargetKind = Literal["retrain", "minimiser"]

#: The largest block the replay holds its P x P Gauss-Newton matrices for (about 8 P^2 bytes per
#: checkpoint); larger blocks take the training-budget damped step.
REPLAY_MAX_PARAMETERS = 4096


def replay_schedule(card: "ModelCard | None", weight_decay: float) -> ReplaySchedule | None:
    """The card's SGD recipe as a replay schedule; None when the recipe converges (lbfgs) or the
    model has no card (Retrain is then the minimiser)."""
    if card is None:
        return None
    from pipeline.recipe import recipe_of

    recipe = recipe_of(card)
    if recipe.optimizer != "sgd":
        return None
    return ReplaySchedule(recipe.epochs, recipe.lr, recipe.momentum, recipe.batch_size, weight_decay)


def budget_damping(schedule: ReplaySchedule | None, n_retained: int) -> float:
    """mu = 1 / tau, tau the training budget of the recipe on the retained samples (0 without a
    schedule): the proximal weight of the one-window form of the replay."""
    return 0.0 if schedule is None else 1.0 / schedule.training_time(n_retained)


def resolve_target(target: TargetKind, card: "ModelCard | None", weight_decay: float, block_numel: int,
                   replay_max_parameters: int = REPLAY_MAX_PARAMETERS, *, part_of_end_to_end: bool = False
                   ) -> tuple[str, ReplaySchedule | None, str]:
    """(how the target is computed: "minimiser", "replay" or "budget_damped", the schedule, why).

    ``part_of_end_to_end``: the block is a part of a network the recipe trained from its input layer on. Its
    replay would rerun the recipe on the block alone with every other trained layer held where training left
    it (not Retrain's recipe, which moves them all) at a recipe-length cost (per-sample curvature passes
    through the layers above the block at every base): such a block takes the one-window form."""
    if target == "minimiser":
        return "minimiser", None, "target: minimiser"
    schedule = replay_schedule(card, weight_decay)
    if schedule is None:
        why = "no model card: Retrain's recipe is unknown" if card is None else \
            "the recipe converges (not SGD with a fixed budget): Retrain lands on the minimiser"
        return "minimiser", None, why
    if part_of_end_to_end:
        return "budget_damped", schedule, ("SGD recipe, a part of a network trained end to end: the replay's "
                                           "one-window form (training-budget damped step)")
    if block_numel <= replay_max_parameters:
        return "replay", schedule, f"SGD recipe, block of {block_numel} <= {replay_max_parameters} entries: recipe replay"
    return "budget_damped", schedule, (f"SGD recipe, block of {block_numel} > {replay_max_parameters} entries: the "
                                       "replay's one-window form (training-budget damped step)")
