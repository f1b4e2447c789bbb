"""Retrain a network's trailing layers from where the recipe started them, on the retained data, the layers
before them frozen: ``suffix-retrain`` (EU-k, exact unlearning of the last k layers: Goel et al., "Towards
Adversarial Evaluation of Machine Unlearning", 2022).

Scope. As block-gauss-newton's (``pipeline.methods.trailing_scope.choose_scope``): the largest trailing part
of the network that a registered splitter divides off and whose forward cost is at most ``scope_cost_share`` of
the whole forward pass; ``scope_cost_share: 1`` is the whole model.

Removal. The scope's parameters and buffers (batch-norm statistics) are set to w_init, where the model card's
recipe started them (its seeded initialisation and init checkpoint, ``pipeline.recipe.start_weights``); then the
recipe's optimiser (SGD: its momentum, weight decay, shuffling seed and cosine decay; its learning rate times
``lr_scale``; ``batch_size`` and ``epochs`` where given, else the recipe's) trains the scope on R = D \\ U, the
suffix reading the frozen prefix's outputs (computed in eval mode: the prefix's batch-norm statistics are the
trained model's). With ``scope_cost_share: 1`` and the recipe's own settings this is Retrain itself (the same
start, data, seed and steps): the exact reference the tests hold it to. Where nothing outside the scope moved from
where the recipe started it (checked once per version, entry by entry: e.g. a text model's frozen lower layers,
the cut at its first trained layer) the result depends on D \\ U alone, and with the recipe's own settings it is
Retrain where those layers draw nothing at random (no dropout: ``pipeline.recipe.fit`` then runs them once too, in
eval mode), their outputs carried instead of recomputed. Otherwise the suffix is trained on D \\ U only,
but over the outputs of a prefix that U shaped (its weights are the original's): a heuristic removal, no
certificate. Either way a request costs the suffix's training, not one step. Parameters frozen in the trained model
(``requires_grad`` False) are not trained by the recipe and are kept as they are. A recipe run to its optimum
(L-BFGS) is run as it is: the SGD settings below are refused for it.

The prefix's pushes (``prefix_pushes_scale`` s > 0; needs the recipe's recorded run, ``pipeline.trajectory``). Before
the suffix is retrained, the prefix's trainable weights P move by s delta_P, delta_P = (1 / n) sum_k W_k G_U,P(c_k):
the forget set's pushes along the recorded run (``pipeline.target.recorded_pushes``, trajectory-refit's) restricted
to P, so that the prefix the suffix reads holds less of what U taught it; the suffix then trains over the moved
prefix's outputs on D \\ U (computed by the removal). s filters as trajectory-refit's scale does: U's pushes include
what the rest of the run undid (the stiff part), which a frozen prefix keeps; no refit of the prefix follows.

Prepared once per model version (what does not depend on U): the scope, the prefix's outputs on D (not with the
prefix's pushes), w_init on the scope and the prefix's digest. A removal moves only the suffix, so the next version
keeps the outputs of D \\ U (``after_removal``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.methods.base import (
    MethodSettings, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method,
)
from pipeline.curvature.hessian import block_gradient
from pipeline.methods.trailing_scope import (
    Scope, ScopeInputs, carried_inputs, check_prefix_budget, choose_scope, scope_inputs,
)
from pipeline.param_block import ParamBlock
from pipeline.prepared import Binding, Prepared
from pipeline.privacy.release import PrivacyRelease
from pipeline.recipe import OPTIMIZERS, Recipe, fit, recipe_of, start_weights
from pipeline.target.recorded_pushes import forget_pushes, kept_checkpoints
from pipeline.tasks import Task

__all__ = ["SuffixRetrain", "SuffixRetrainPrepared", "SuffixRetrainSettings", "moved_outside_scope", "moves_prefix",
           "prefix_parameter_names", "scope_state_names", "take_back_prefix_pushes"]


class SuffixRetrainSettings(MethodSettings):
    scope_cost_share: float = Field(
        0.65, gt=0, le=1, description="the scope: the trailing modules whose forward cost (multiply-accumulates) is at "
                                      "most this share of the whole forward pass (1: the whole model: Retrain)")
    epochs: int | None = Field(
        None, ge=1, description="epochs of the recipe's optimiser over the scope, its learning rate decayed over them "
                                "(null: the recipe's own epochs)")
    batch_size: int | None = Field(None, ge=1, description="the SGD batch size (null: the recipe's)")
    lr_scale: float = Field(1.0, gt=0, description="the SGD learning rate = the recipe's lr x this")
    prefix_pushes_scale: float = Field(
        0.0, ge=0, le=1, description="share of the forget set's recorded pushes taken back from the prefix's trainable "
                                     "weights before the suffix is retrained over it (0: the prefix as trained; needs "
                                     "the recipe's recorded run)")
    prefix_pushes_checkpoints: int | None = Field(
        None, ge=2, description="recorded checkpoints the prefix's pushes read, evenly spaced, the first and the last "
                                "among them (null: all)")


def moved_outside_scope(current: dict[str, Tensor], initial: dict[str, Tensor], names: list[str]) -> list[str]:
    """The model's state entries outside the scope (``names``) that are not where the recipe started them
    (``initial``; an entry the start lacks counts as moved). None moved: nothing outside the scope was trained, so a
    removal's result depends on the retained data alone (with the recipe's own settings and no dropout in front, it
    is Retrain)."""
    inside = set(names)
    return [n for n, value in current.items() if n not in inside and
            (n not in initial or not torch.equal(value, initial[n].to(dtype=value.dtype, device=value.device)))]


def scope_state_names(model: nn.Module, suffix: nn.Module) -> list[str]:
    """The model's state-dict names of the suffix's trainable parameters and persistent buffers (found by identity:
    a suffix module shares its tensors with the model); frozen parameters and non-persistent buffers are left out."""
    persistent = set(model.state_dict().keys())
    name_of_tensor = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]
                      if name in persistent}
    trainable = [p for p in suffix.parameters() if p.requires_grad]
    return [name_of_tensor[id(t)] for t in [*trainable, *suffix.buffers()] if id(t) in name_of_tensor]


def prefix_parameter_names(model: nn.Module, scope_names: dict[str, Tensor] | list[str]) -> list[str]:
    """The model's trainable parameters outside the scope (``scope_names``): the prefix's, in the model's order."""
    inside = set(scope_names)
    return [n for n, p in model.named_parameters() if p.requires_grad and n not in inside]


def moves_prefix(settings: SuffixRetrainSettings, scope: Scope) -> bool:
    """Whether a removal takes U's pushes back from a prefix (and so computes the prefix's outputs itself: the
    preparation keeps none)."""
    return settings.prefix_pushes_scale > 0 and scope.split is not None


def _without_recorded_run(why: str | None) -> ValueError:
    return ValueError("settings.prefix_pushes_scale: taking back the prefix's pushes needs the recipe's recorded run "
                      "(trajectory.safetensors, written by `unlearn train` beside the original); "
                      + (why or "this model has none"))


def take_back_prefix_pushes(problem: RemovalProblem, names: list[str],
                            settings: SuffixRetrainSettings) -> dict[str, Any]:
    """w_P <- w_P + s delta_P on the prefix's trainable parameters P (``names``): delta_P = (1 / n) sum_k W_k
    G_U,P(c_k), the forget set's pushes along the recorded run restricted to P (``pipeline.target.recorded_pushes``;
    G_U,P the summed gradient over U of the whole network's loss at checkpoint c_k, in the model's mode), s =
    ``prefix_pushes_scale``. What the recipe's steps gave U there, which Retrain never took; what the rest of the
    run undid of it (the stiff part) is taken back too, the suffix retrained over the result."""
    trajectory = problem.trajectory
    if trajectory is None:
        raise _without_recorded_run(problem.trajectory_missing)
    trajectory.require_parameters(names, "the prefix's parameters")
    model = problem.model
    block = ParamBlock.from_rows(model, {n: None for n in names})
    forget = problem.train.take(problem.forget_positions)
    pushes = forget_pushes(model, trajectory,
                           lambda: block_gradient(model, problem.task, forget, block, 0.0, reduction="sum",
                                                  batch_size=problem.batch_size),
                           settings.prefix_pushes_checkpoints)
    block.add_to_model(model, settings.prefix_pushes_scale * pushes)
    return {"scale": settings.prefix_pushes_scale, "parameters": block.numel, "tensors": len(names),
            "checkpoints": len(kept_checkpoints(len(trajectory.checkpoints), settings.prefix_pushes_checkpoints))}


@dataclass
class SuffixRetrainPrepared(Prepared):
    """The scope, D's features at the split (the prefix's outputs; None without a split), w_init of the scope's
    parameters and buffers (the model's names) and the prefix's digest (``after_removal`` checks it)."""

    scope: Scope | None = None
    features: SampleSet | None = None
    task: Task | None = None
    start: dict[str, Tensor] = field(default_factory=dict)
    prefix: str | None = None

    what = "the scope (trailing layers by forward cost), the prefix's outputs on D and the scope's initial weights"

    def after_removal(self, trained: Any, removed: Tensor, outcome: Any, binding: Binding) -> "Prepared | None":
        """Only the suffix moved: the prefix's outputs on D \\ U and w_init stay (checked: the prefix's digest)."""
        assert self.scope is not None
        features = None
        if self.features is not None:
            features = carried_inputs(self.scope, self.features, self.prefix, trained.model, removed)
            if features is None:
                return None
        return SuffixRetrainPrepared(binding, 0.0, {**self.details, "updated_from_removal": True},
                                     scope=self.scope, features=features, task=self.task, start=self.start,
                                     prefix=self.prefix)


def _removal_recipe(trained: TrainedModel | RemovalProblem, settings: SuffixRetrainSettings) -> Recipe:
    """The card's recipe with the settings' epochs, batch size and learning-rate scale (an SGD recipe only)."""
    card = trained.card
    if card is None:
        raise ValueError("suffix-retrain retrains with the model card's recipe and from its initial weights: load "
                         "the model from its directory (its model.json), or pick another method")
    recipe = recipe_of(card)
    if recipe.optimizer != "sgd":
        shaped = [name for name in ("epochs", "batch_size") if getattr(settings, name) is not None]
        shaped += ["lr_scale"] if settings.lr_scale != 1.0 else []
        if shaped:
            raise ValueError(f"settings.{shaped[0]}: the model card's recipe is '{recipe.optimizer}', run to its "
                             f"optimum; {', '.join(shaped)} shape an SGD recipe only (leave them at their defaults)")
        return recipe
    changes: dict[str, Any] = {"lr": recipe.lr * settings.lr_scale}
    if settings.epochs is not None:
        changes["epochs"] = int(settings.epochs)
    if settings.batch_size is not None:
        changes["batch_size"] = int(settings.batch_size)
    return recipe.model_copy(update=changes)


@register_method
class SuffixRetrain(RemovalMethod):
    name = "suffix-retrain"
    Settings = SuffixRetrainSettings
    PREPARED_FROM = ("scope_cost_share", "prefix_pushes_scale")

    def prepare(self, trained: TrainedModel, settings: SuffixRetrainSettings,  # type: ignore[override]
                binding: Binding) -> SuffixRetrainPrepared:
        _removal_recipe(trained, settings)  # a model without a card fails here, before anything is computed
        if settings.prefix_pushes_scale > 0 and trained.trajectory is None:
            raise _without_recorded_run(trained.trajectory_missing)
        assert trained.card is not None
        started = time.perf_counter()
        scope = choose_scope(trained.model, trained.task, trained.train, settings.scope_cost_share)
        t_scope = time.perf_counter() - started
        if moves_prefix(settings, scope):
            # the prefix moves before the suffix reads it: the removal computes its outputs on D \ U
            check_prefix_budget(trained.model, trained.task, trained.train, scope)
            inputs = ScopeInputs(trained.train, scope.split.task, None, 0.0)
        else:
            inputs = scope_inputs(trained.model, trained.task, trained.train, scope, trained.batch_size)
        suffix = scope.split.suffix_of(trained.model) if scope.split is not None else trained.model
        weights_started = time.perf_counter()
        names = scope_state_names(trained.model, suffix)
        initial = start_weights(trained.card)
        missing = [n for n in names if n not in initial]
        if missing:
            raise ValueError(f"the model card's initial weights lack {missing[:5]}: the card does not describe this "
                             "model's architecture")
        current = trained.model.state_dict()
        start = {n: initial[n].to(dtype=current[n].dtype) for n in names}
        moved = moved_outside_scope(current, initial, names)
        t_start = time.perf_counter() - weights_started
        return SuffixRetrainPrepared(
            binding, details={"scope": scope.details, "scope_seconds": t_scope, "prefix_seconds": inputs.seconds,
                              "initial_weights_seconds": t_start, "outside_scope_at_start": not moved,
                              "outside_scope_moved": moved[:5], "outside_scope_moved_count": len(moved)},
            scope=scope, features=inputs.features if inputs.prefix is not None else None, task=inputs.task, start=start,
            prefix=inputs.prefix)

    def remove(self, problem: RemovalProblem, settings: SuffixRetrainSettings,  # type: ignore[override]
               prepared: SuffixRetrainPrepared) -> RemovalOutcome:
        assert prepared.scope is not None and prepared.task is not None
        recipe = _removal_recipe(problem, settings)
        timings: dict[str, float] = {}
        scope = prepared.scope
        model = problem.model
        suffix = scope.split.suffix_of(model) if scope.split is not None else model
        live = dict([*model.named_parameters(), *model.named_buffers()])
        prefix_names = prefix_parameter_names(model, prepared.start) if moves_prefix(settings, scope) else []
        saved = {n: live[n].detach().clone() for n in [*prepared.start, *prefix_names]}
        pushes_record: dict[str, Any] | None = None
        try:
            features = prepared.features
            if prefix_names:
                with problem.stage("prefix_pushes", timings):
                    pushes_record = take_back_prefix_pushes(problem, prefix_names, settings)
                with problem.stage("prefix_outputs", timings):  # the moved prefix's outputs on D \ U
                    features = scope_inputs(model, problem.task, problem.retain, scope, problem.batch_size).features
            with torch.no_grad():
                for name, value in prepared.start.items():
                    live[name].copy_(value)
            with problem.stage("retrain", timings), torch.random.fork_rng(devices=[]):
                torch.manual_seed(recipe.seed)  # as pipeline.recipe.fit seeds Retrain's run
                if scope.split is None:
                    report = fit(model, problem.task, problem.retain, recipe)
                else:
                    assert features is not None
                    retain = features if prefix_names else features.without(problem.forget_positions)
                    report = OPTIMIZERS[recipe.optimizer](suffix, prepared.task, retain, recipe)
        except BaseException:
            with torch.no_grad():  # the parameters and buffers as they were
                for name, value in saved.items():
                    live[name].copy_(value)
            raise
        suffix.eval()
        retrained = {name: live[name].detach().clone() for name in [*prepared.start, *prefix_names]}
        record: dict[str, Any] = {
            "scope": scope.details,
            "retrain": {"optimizer": recipe.optimizer, "epochs": recipe.epochs, "lr": recipe.lr,
                        "batch_size": recipe.batch_size, "seed": recipe.seed, "retained": problem.n - problem.m,
                        "final_objective": report.final_objective, "gradient_norm": report.gradient_norm},
            "timings": timings,
        }
        if pushes_record is not None:
            record["prefix_pushes"] = pushes_record
        at_start = bool(prepared.details.get("outside_scope_at_start"))
        record["retrain"]["outside_scope_at_start"] = at_start
        if at_start:
            what = ("every trained weight retrained from the recipe's start on the retained data, every other weight "
                    "where the recipe started it (checked): the result depends on the retained data alone")
        elif pushes_record is not None:
            what = (f"the trailing layers retrained from the recipe's start on the retained data over a prefix from "
                    f"which a share ({settings.prefix_pushes_scale}) of the removed samples' recorded pushes was "
                    "taken back; the prefix was trained on them (a heuristic removal, no certificate)")
        else:
            what = (f"the trailing layers retrained from the recipe's start on the retained data; "
                    f"{prepared.details.get('outside_scope_moved_count')} state entries outside them (e.g. "
                    f"{', '.join(prepared.details.get('outside_scope_moved') or [])}) were trained on the removed "
                    "samples too (a heuristic removal, no certificate)")
        return RemovalOutcome(retrained, record, PrivacyRelease.non_private(f"no noise: {what}"))
