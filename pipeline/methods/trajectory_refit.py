"""Trajectory refit: take back the forget set's share of the recorded training run, then refit on the
retained data. A checkpoint form of Amnesiac unlearning (Graves, Nagisetty and Ganesh, AAAI 2021, who
keep every batch's update; here the recipe's epoch checkpoints, ``pipeline.trajectory``).

The recipe moved the weights by w_K - w_0 = - sum_k c_k g_k (heavy-ball SGD, c_k the share of step k's
gradient the final weights carry). A sample z of U sits in one batch of B per epoch, so over stretch e
(between checkpoints e and e + 1, total rate C_e) U's own pushes sum to about
    (C_e / n) (G_U(c_e) + G_U(c_{e+1})) / 2,      G_U(w) = sum_{z in U} grad loss(w, z),
n the size of the set the recipe ran on. Retrain never took them. The removal adds back
    delta = scale * (1 / n) sum_e C_e (G_U(c_e) + G_U(c_{e+1})) / 2
to every trainable parameter, then runs ``refit_epochs`` of the recipe's SGD on R = D \\ U (its momentum
and batch size, its learning rate times ``refit_lr_scale``, cosine decay to zero; eval mode: batch-norm
statistics fixed), ``pipeline.methods.trust_region.refit_block`` over every trainable parameter. Where the
model has frozen layers before its first trainable one, every pass runs on the suffix over their outputs, each
sample's computed the first time a pass reads it and kept for later requests and versions
(``pipeline.methods.prefix_prepared``): a request pays the prefix for what it reads (U's sample, the probes, the
refit's batches), not for all of D.

"About" is loose: the checkpoint gradients carry the run's oscillation across stiff directions, which the steps'
own gradients cancel over a stretch (on the identities ResNet the trapezium over all of D has 7x the norm of the run's
data pushes, nearly orthogonal to them; docs/METHODS.md): delta is a direction ``scale`` and the refit make useful.

What delta leaves out: the retained data's restoring force. Pushes along directions R's curvature
trains (stiff modes) are undone by the rest of the run, pushes along flat ones (a class or an identity
only U ever taught) stay; scale = 1 (all of them, unfiltered) over-forgets and the refit restores the stiff
part. ``scale`` is chosen on tuning forget sets.

Cheaper pushes (settings, off by default; the variant ``configs/methods/trajectory-refit-sampled.yaml``). The pushes
are the sum over the checkpoints k of W_k G_U(c_k), W_k = (C_{k-1} + C_k) / 2 (the trapezium's weights,
C_{-1} = C_E = 0). ``checkpoints``: only that many of them, evenly spaced (the first and the last kept), each
left-out checkpoint's G_U taken as the linear interpolation of its kept neighbours' (in the checkpoint index),
so its weight is shared between them (``pipeline.target.recorded_pushes``, which the one-window target of
lfoci-newton reads too; all kept: the formula above; exact where G_U is linear along the run). ``forget_samples``:
G_U(c) estimated as |U| / k times the summed gradient over a seeded sample of k of U's samples, the same sample at
every checkpoint (unbiased; its relative error shrinks as sqrt((1 - k / |U|) / k) times the per-sample gradients'
spread over their mean).

A refit pool (``refit_pool``, off by default; the variant ``configs/methods/trajectory-refit-lean.yaml``): the refit's
batches drawn from the first ``refit_pool`` retained samples under a fixed pseudo-random ranking of sample ids (the
probe left out), its steps still those of ``refit_epochs`` of |D \\ U|. Every request on the model and its later
versions draws the same pool, less the samples removed since, so a campaign's requests read samples whose frozen-prefix
rows an earlier one kept. The batches are then a draw of the pool, not of R (samples repeat where the steps visit
more than it holds), and the pool stays the same only while the probe does (a probe drawn anew swaps out the pool's
samples it takes).

Emptied classes (``emptied_classes``). A class every training sample of which is in U (a whole identity) is one no
retained sample trains: Retrain's decision-layer row for it only decays and is pushed down by the other samples'
softmax early in training. The correction leaves that row where training's up-pushes put it, less the share taken
back, and the class's logit on its own inputs away from Retrain's (on the identities benchmark -4.6 at scale 0.1
against Retrain's -0.1 / 0.1: a membership attack tells them apart). Under ``replayed`` (the default) the row is
replayed from the recipe's initial row along the recorded run (``pipeline.target.emptied_classes``: one forward
pass of a seeded sample of D \\ U per checkpoint, on Retrain's clock) and set after every refit round.

Retained-loss guard. Retrain minimises L_R, so at an optimum L_R(Retrain) <= L_R(original): a removal that
leaves the retained data worse fitted than the original model did has over-forgotten (the correction pushed
along directions R trains, further than the refit restores). After the refit the mean loss on a seeded probe
of R (``probe_samples``) is compared with the original's on the same probe; above (1 + ``retained_loss_slack``)
times it (the slack: a recipe not run to its optimum, the probe's noise), the refit runs again (another
``refit_epochs``, its cosine restarted), at most ``refit_rounds`` refits in all, fewer where the last round's drop
carried over the rounds left cannot reach the ceiling; still above, the model is put
back, the scale multiplied by ``backtrack_factor`` and correction and refits run again (the pushes are kept),
at most ``backtracks`` times; then the request is refused (``RemovalNotServed``: the model as it was). Every tried
scale and its probe loss are in the record. The probe is drawn once per model lineage: the accepted removal's last
probe pass read each probe sample's loss at the weights it publishes, and the next version's prepared state keeps them
(``TrajectoryRefitPrepared``, bound to those weights' digest), so a campaign's next request reads the original's probe
loss from them (its U's samples dropped) instead of a pass; drawn anew where under half of it is still retained.
Siblings. The probe is a random draw of R, so a correction that un-learns U's label rather than U's samples (a subject
holding most of an identity's images: the identity's remaining images misclassified with it) hardly moves its mean
loss. Retrain trains on those retained samples of U's labels, the siblings, and fits them as it fits the rest of R;
so where a single-label classifier's U leaves siblings, a seeded draw of them (``sibling_probe_samples``) is scored
too, and a round is accepted only where their accuracy is at most ``sibling_accuracy_slack`` below the original's
on them. Where R's loss is already within the slack and the siblings fall short, the scale backtracks at once (the
refit visits the siblings at their small share of R, so further rounds restore them slowly); where both fall short,
the rounds go on as above (a random U's siblings are a random part of R, restored with it). A class U empties has no
siblings: the replayed row serves it.
Orthogonal to the siblings (``orthogonal_to_siblings``, off by default; the variant
``configs/methods/trajectory-refit-sampled-orthogonal.yaml``). Where U leaves siblings, part of U's push at a checkpoint
is the one its label's retained samples give too (the identity's look, not U's own images), and Retrain takes that part
from them. Taking it back un-learns the label: the sibling check then sends the scale back until U itself is hardly
moved (on the identities benchmark's subjects the forgotten images stay classified at every accepted scale). With the
setting, each read G_U(c_k) loses its component along G_S(c_k), the summed gradient of the siblings' seeded draw
(``sibling_probe_samples``, null: all of them; the check's own draw):
    G_U <- G_U - (G_U . G_S / G_S . G_S) G_S,
one more gradient over that draw per read checkpoint. The check then scores the samples the correction was made
orthogonal to (to first order it leaves their summed loss alone), so it is a weaker check there than on siblings it
never saw; a subject's siblings are usually fewer than the draw, so there are none left to hold out. A heuristic: one
direction of the label's many; measured on the identities benchmark's tuning subjects (docs/NOTES.md).
First order in m / n around the recorded run; a removal from a
version already changed by earlier removals uses the same checkpoints. No guarantee: never certified.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from pydantic import Field

from pipeline.curvature.hessian import block_gradient
from pipeline.data import SampleSet
from pipeline.errors import RemovalNotServed
from pipeline.evaluate.predict import OUTPUT_KINDS, logits_of, per_sample_losses
from pipeline.methods.base import (
    MethodSettings, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method, stream_seed,
)
from pipeline.methods.emptied_rows import (
    EmptiedMode, emptied_class_samples_field, emptied_classes_field, plan_emptied_rows,
)
from pipeline.methods.prefix_prepared import FrozenPrefixPrepared, prepare_frozen_prefix
from pipeline.methods.trust_region import draw, refit_block
from pipeline.param_block import ParamBlock
from pipeline.prepared import Binding, Prepared, state_digest
from pipeline.recipe import recipe_of
from pipeline.target.recorded_pushes import forget_pushes, kept_checkpoints
from pipeline.trajectory import TRAJECTORY_FILE

__all__ = ["ProbeLosses", "TrajectoryRefit", "TrajectoryRefitPrepared", "TrajectoryRefitSettings", "forget_sample",
           "refit_pool", "sibling_probe", "without_component"]

PROBE_STREAM = 34  # the guard's probe of D \ U (hashed with the removal seed)
FORGET_SAMPLE_STREAM = 35  # the pushes' sample of U (hashed with the removal seed)
SIBLING_STREAM = 36  # the guard's draw of U's siblings in D \ U (hashed with the removal seed)
POOL_SEED = 37  # the refit pool's fixed ranking of sample ids (the same on every request and version)
REFIT_ROUND_STREAM = 1000  # refits after the first: streams 1000 + k (k refits already run)


class TrajectoryRefitSettings(MethodSettings):
    scale: float = Field(0.1, gt=0, le=1, description="share of U's recorded pushes taken back (1 = all)")
    refit_epochs: float = Field(1.0, ge=0, description="epochs of the recipe's SGD on D \\ U after the correction")
    refit_lr_scale: float = Field(0.2, ge=0, description="refit learning rate = the recipe's lr x this")
    probe_samples: int | None = Field(1024, gt=0, description="the retained-loss guard's seeded probe of D \\ U "
                                                              "(null: all of it)")
    retained_loss_slack: float | None = Field(
        0.25, ge=0, description="accept when the probe's mean loss after the removal <= (1 + this) x the "
                                "original's (null: no guard)")
    sibling_probe_samples: int | None = Field(64, gt=0, description="the guard's seeded draw of U's siblings: the "
                                                                    "retained samples sharing a label with U (null: all)")
    sibling_accuracy_slack: float | None = Field(
        0.1, ge=0, le=1, description="accept only where the siblings' accuracy after the removal is at least the "
                                     "original's minus this share (null: no sibling check; single-label "
                                     "classification only)")
    orthogonal_to_siblings: bool = Field(
        False, description="G_U at each read checkpoint less its component along the siblings' summed gradient there "
                           "(the share of U's push that teaches U's label, which Retrain takes from the siblings too); "
                           "no effect where U leaves no siblings or the task is no single-label classifier")
    refit_pool: int | None = Field(
        None, gt=0, description="the refit's batches drawn from a pool of this many retained samples, the first under a "
                                "fixed ranking of sample ids (the same on every request and version, U's members and "
                                "the probe left out), its epoch still |D \\ U|: a campaign's requests read the same "
                                "samples again (their frozen-prefix rows kept); null: all of D \\ U")
    refit_rounds: int = Field(4, ge=1, description="refits of refit_epochs each until the probe's loss is within the "
                                                   "slack; then the scale backtracks")
    backtrack_factor: float = Field(0.3, gt=0, lt=1, description="the scale is multiplied by this after a rejection")
    backtracks: int = Field(2, ge=0, description="rejections retried at a smaller scale; then the request is refused "
                                                 "(needs_retrain)")
    checkpoints: int | None = Field(None, ge=2, description="recorded checkpoints the pushes read, evenly spaced, first "
                                                            "and last kept, the others interpolated (null: all)")
    forget_samples: int | None = Field(None, gt=0, description="G_U from a seeded sample of this many of U's samples, "
                                                               "times |U| / k (null: all of U)")
    emptied_classes: EmptiedMode = emptied_classes_field()
    emptied_class_samples: int = emptied_class_samples_field()


@dataclass(frozen=True)
class ProbeLosses:
    """The retained-loss guard's probe (``sample_ids``) and each sample's loss (float64) at the weights whose
    ``pipeline.prepared.state_digest`` is ``weights``, drawn with ``probe_samples`` asked."""

    weights: str
    sample_ids: torch.Tensor
    losses: torch.Tensor
    probe_samples: int | None


@dataclass
class TrajectoryRefitPrepared(FrozenPrefixPrepared):
    """trajectory-refit's preparation: the frozen prefix's outputs on D (``pipeline.methods.prefix_prepared``) and,
    from the removal that made this version, the guard's probe losses at its weights (``retained_probe``; None on a
    version no removal of this lineage made, or where the published weights are not those the probe read)."""

    retained_probe: ProbeLosses | None = None

    def fresh_copy(self) -> "TrajectoryRefitPrepared":
        return replace(super().fresh_copy(), retained_probe=None)

    def after_removal(self, trained: Any, removed: torch.Tensor, outcome: Any, binding: Binding) -> "Prepared | None":
        state = super().after_removal(trained, removed, outcome, binding)
        probe = getattr(outcome, "carried", {}).get("retained_probe")
        if isinstance(state, TrajectoryRefitPrepared) and isinstance(probe, ProbeLosses) and probe.weights == binding.weights:
            state.retained_probe = probe
        return state


def kept_probe(prepared: Prepared, retain: SampleSet, probe_samples: int | None) -> tuple[SampleSet, float] | None:
    """The guard's probe kept in ``prepared`` (the previous removal's, at the weights ``prepared`` holds for) and the
    mean of its samples' losses there, both restricted to ``retain``: None where none is kept for these weights and
    ``probe_samples``, or where under half of the probe asked for (``probe_samples``, at most |retain|) is retained."""
    kept = prepared.retained_probe if isinstance(prepared, TrajectoryRefitPrepared) else None
    if kept is None or kept.weights != prepared.binding.weights or kept.probe_samples != probe_samples:
        return None
    retained = torch.isin(kept.sample_ids, retain.sample_ids)
    wanted = len(retain) if probe_samples is None else min(probe_samples, len(retain))
    if 2 * int(retained.sum()) < wanted:
        return None
    probe = retain.take(retain.positions_of(kept.sample_ids[retained], field="retained probe"))
    return probe, float(kept.losses[retained].mean())


def _out_of_reach(previous: float, after: float, ceiling: float, rounds_left: int) -> bool:
    """Whether the refit rounds left cannot bring the probe's loss to the ceiling at the last round's drop:
    after - rounds_left * (previous - after) > ceiling. Where the rounds' drops shrink (each refit starts nearer
    the retained optimum) the linear projection is an optimistic one, and ending there gives up no round that
    would have been accepted; a round that did not lower the loss (or a non-finite loss) ends the rounds."""
    if not math.isfinite(after):
        return True
    drop = previous - after
    if not math.isfinite(drop):
        return rounds_left == 0
    return after - rounds_left * max(drop, 0.0) > ceiling


def sibling_probe(forget: SampleSet, retain: SampleSet, task: Any, count: int | None, seed: int
                  ) -> tuple[SampleSet | None, str]:
    """A seeded draw of at most ``count`` of U's siblings (the retained samples whose label is one of U's), and what
    it is; None where the task is no single-label classifier or no retained sample shares U's labels."""
    y = retain.columns.get("y")
    if OUTPUT_KINDS.get(task.loss, ("",))[0] != "single" or y is None or y.dim() != 1 or y.is_floating_point():
        return None, "no sibling check: not a single-label classification task"
    shared = torch.isin(y, forget.columns["y"].unique())
    if not bool(shared.any()):
        return None, "no sibling check: no retained sample shares a label with the forget set (a class emptied)"
    siblings = retain.take(torch.nonzero(shared).flatten())
    probe = draw(siblings, count, stream_seed(seed, SIBLING_STREAM))
    return probe, f"{len(probe)} of the {len(siblings)} retained samples sharing a label with the forget set"


def without_component(gradient: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """g - (g . d / d . d) d: ``gradient`` with its component along ``direction`` removed (float64 inner products;
    ``gradient`` itself where d = 0)."""
    norm2 = float(direction.double() @ direction.double())
    if norm2 == 0.0:
        return gradient
    return gradient - (float(gradient.double() @ direction.double()) / norm2) * direction


def refit_pool(retain: SampleSet, count: int | None, leave_out: torch.Tensor | None = None) -> SampleSet:
    """The ``count`` samples of ``retain`` (those of ``leave_out``'s sample ids excepted) that come first under a fixed
    pseudo-random ranking of sample ids (the splitmix64 finaliser of id + POOL_SEED x 0x9E3779B97F4A7C15), in
    ``retain``'s order: the pool a later
    version's request draws is this one less the samples removed since, the next-ranked in their place. All of
    ``retain`` (less ``leave_out``): ``count`` None. Where leaving ``leave_out`` out leaves fewer than ``count`` (a
    small D), the pool is drawn from all of ``retain``."""
    ids = torch.as_tensor(retain.sample_ids, dtype=torch.long)
    eligible = torch.ones(len(ids), dtype=torch.bool) if leave_out is None else ~torch.isin(ids, leave_out)
    if count is not None and int(eligible.sum()) < min(count, len(ids)):
        eligible = torch.ones(len(ids), dtype=torch.bool)
    if count is None:
        return retain if bool(eligible.all()) else retain.take(torch.nonzero(eligible).flatten())
    with np.errstate(over="ignore"):
        x = ids.numpy().astype(np.uint64) + np.uint64(POOL_SEED) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    rank = np.argsort(x, kind="stable")
    first = rank[eligible.numpy()[rank]][:count]
    return retain.take(torch.as_tensor(np.sort(first), dtype=torch.long))


def forget_sample(forget: SampleSet, count: int | None, seed: int) -> tuple[SampleSet, float]:
    """A seeded sample S of ``count`` of U's samples and |U| / |S|: G_U ~ |U| / |S| sum_{z in S} grad loss(w, z),
    unbiased (each sample is drawn with probability |S| / |U|). All of U, and 1: ``count`` None or >= |U|."""
    if len(forget) == 0:
        raise ValueError("the forget set is empty: nothing to remove")
    sample = draw(forget, count, stream_seed(seed, FORGET_SAMPLE_STREAM))
    return sample, len(forget) / len(sample)


@register_method
class TrajectoryRefit(RemovalMethod):
    name = "trajectory-refit"
    Settings = TrajectoryRefitSettings

    def applies_to(self, trained: TrainedModel) -> str | None:
        """Why this method cannot serve ``trained`` (None: it can): it needs the recipe's recorded trajectory."""
        if trained.trajectory is None:
            return (f"needs the recipe's recorded training trajectory ({TRAJECTORY_FILE}, written by `unlearn train` "
                    "for an SGD recipe beside the original; a later version's card refers to it there); "
                    + (trained.trajectory_missing or "this model has none"))
        return None

    def prepare(self, trained: TrainedModel, settings: TrajectoryRefitSettings,  # type: ignore[override]
                binding: Binding) -> TrajectoryRefitPrepared:
        """Where the model has frozen layers, their rows (none computed: each on its first read; every pass runs
        over them)."""
        return prepare_frozen_prefix(trained, binding, TrajectoryRefitPrepared, lazy=True)

    def remove(self, problem: RemovalProblem, settings: TrajectoryRefitSettings,  # type: ignore[override]
               prepared: Prepared) -> RemovalOutcome:
        started = time.perf_counter()
        trajectory = problem.trajectory
        if (why := self.applies_to(problem.trained)) is not None:
            raise ValueError(f"method trajectory-refit {why}")
        model = problem.model
        names = [k for k, p in model.named_parameters() if p.requires_grad]
        trajectory.require_parameters(names, "the trainable parameters")
        timings: dict[str, float] = {}
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # every pass runs on the suffix over the prefix's outputs where the model has frozen layers in front
        held = (prepared.suffix_inputs(model, problem.task, problem.batch_size)
                if isinstance(prepared, FrozenPrefixPrepared) else None)
        work, task = (model, problem.task) if held is None else (held.suffix, held.task)

        def read(samples: SampleSet) -> SampleSet:
            """What ``work`` reads of samples of D (their prefix outputs where it is the suffix)."""
            return samples if held is None else held.inputs(samples)

        rows = prepared.rows if isinstance(prepared, FrozenPrefixPrepared) else None
        rows_before = (rows.computed, rows.seconds) if rows is not None else None
        block = ParamBlock.all_parameters(work)
        data = problem.train
        forget, retain = data.take(problem.forget_positions), data.without(problem.forget_positions)
        recipe = recipe_of(problem.card) if problem.card is not None else None
        guarded = settings.retained_loss_slack is not None
        kept = kept_probe(prepared, retain, settings.probe_samples) if guarded else None
        probe = (read(kept[0]) if kept is not None else
                 read(draw(retain, settings.probe_samples, stream_seed(problem.seed, PROBE_STREAM))) if guarded else None)
        checked = guarded and settings.sibling_accuracy_slack is not None
        drawn, drawn_what = (sibling_probe(forget, retain, task, settings.sibling_probe_samples, problem.seed)
                             if checked or settings.orthogonal_to_siblings else (None, ""))
        drawn = None if drawn is None else read(drawn)
        siblings, siblings_what = ((drawn, drawn_what) if checked
                                   else (None, "no sibling check (sibling_accuracy_slack or the guard off)"))
        pushed_siblings = drawn if settings.orthogonal_to_siblings else None  # drawn by the pushes
        pool = refit_pool(retain, settings.refit_pool, None if settings.refit_pool is None or probe is None
                          else probe.sample_ids)
        pool_what = None if settings.refit_pool is None else (
            f"{len(pool)} of the {len(retain)} retained samples, first under a fixed ranking of sample ids"
            + (", the probe's left out" if probe is not None and not bool(torch.isin(pool.sample_ids,
                                                                                   probe.sample_ids).any()) else ""))
        losses: torch.Tensor | None = None  # the probe's per-sample losses at the last pass
        tried: list[dict[str, float]] = []

        def refit_once() -> dict[str, Any]:
            """One refit of ``refit_epochs``; the first on the removal's seed, each later one on its own stream; then
            the emptied classes' rows set to Retrain's (the refit's own pushes on them are not Retrain's)."""
            with problem.stage("refit", timings):
                refit = refit_block(work, task, block, pool, recipe, problem.weight_decay,
                                    epochs=settings.refit_epochs, lr_scale=settings.refit_lr_scale,
                                    seed=problem.seed if not tried else stream_seed(problem.seed,
                                                                                    REFIT_ROUND_STREAM + len(tried)),
                                    inputs=None if held is None else held.inputs, epoch_size=len(retain),
                                    ahead=None if held is None else held.ahead)
                if pool_what is not None:
                    refit["pool"] = pool_what
            emptied.apply(model)
            return refit

        def probe_loss() -> float:
            nonlocal losses
            with problem.stage("guard", timings):
                losses = per_sample_losses(work, task, probe, problem.batch_size).double()
            return float(losses.mean())

        def sibling_accuracy() -> float:
            """The siblings' accuracy, counted exactly (float64): k of n correct against the floor, no float32 rounding."""
            with problem.stage("guard", timings):
                logits = logits_of(work, task, siblings, problem.batch_size)
            return float((logits.argmax(1) == siblings.columns["y"]).double().mean())

        try:
            emptied = plan_emptied_rows(problem, settings.emptied_classes, settings.emptied_class_samples, timings,
                                        prepared)
            with problem.stage("forget_pushes", timings):
                sample, share = forget_sample(forget, settings.forget_samples, problem.seed)
                sample = read(sample)

                def forget_gradient() -> torch.Tensor:
                    g = share * block_gradient(work, task, sample, block, 0.0, reduction="sum",
                                               batch_size=problem.batch_size)
                    if pushed_siblings is None:
                        return g
                    along = block_gradient(work, task, pushed_siblings, block, 0.0, reduction="sum",
                                           batch_size=problem.batch_size)
                    return without_component(g, along)
                pushes = forget_pushes(model, trajectory, forget_gradient, settings.checkpoints)
            scale = settings.scale
            if probe is None:
                block.add_to_model(work, scale * pushes)
                refit = refit_once()
                refit["rounds"] = 1
            else:
                before = kept[1] if kept is not None else probe_loss()
                ceiling = (1.0 + settings.retained_loss_slack) * before
                if siblings is not None:
                    siblings_before = sibling_accuracy()
                    floor = siblings_before - settings.sibling_accuracy_slack - 1e-12  # k / n at the floor passes
                while True:
                    block.add_to_model(work, scale * pushes)
                    previous = math.inf
                    for round_ in range(1, settings.refit_rounds + 1):
                        refit = refit_once()
                        after = probe_loss()
                        tried.append({"scale": scale, "retained_probe_loss": after})
                        within = math.isfinite(after) and after <= ceiling
                        if siblings is not None:
                            tried[-1]["sibling_accuracy"] = accuracy = sibling_accuracy()
                            if within and not accuracy >= floor:  # R refitted, U's label still un-learnt: backtrack
                                within = False
                                break
                        if within or "skipped" in refit or _out_of_reach(
                                previous, after, ceiling, settings.refit_rounds - round_):
                            break
                        previous = after
                    if within:
                        break
                    model.load_state_dict(saved)
                    if len({t["scale"] for t in tried}) > settings.backtracks:
                        raise RemovalNotServed(
                            f"at every tried scale and refit round the retained probe's loss after the removal exceeds "
                            f"(1 + {settings.retained_loss_slack}) x the original's ({before:.4g})"
                            + ("" if siblings is None else f", or the accuracy on the forget set's siblings falls "
                               f"more than {settings.sibling_accuracy_slack} below the original's "
                               f"({siblings_before:.4g})") + ": over-forgetting",
                            {"original_probe_loss": before, "tried": tried,
                             **({} if siblings is None else {"original_sibling_accuracy": siblings_before})})
                    scale *= settings.backtrack_factor
                refit["rounds"] = round_
            if held is not None:
                refit["frozen_prefix"] = f"the suffix from module {held.start} over the frozen prefix's outputs"
        except BaseException:
            model.load_state_dict(saved)
            raise
        params = dict(model.named_parameters())
        record: dict[str, Any] = {
            "trajectory": {"checkpoints": len(trajectory.checkpoints), "n": trajectory.n,
                           "rates": [round(r, 6) for r in trajectory.rates],
                           "read": kept_checkpoints(len(trajectory.checkpoints), settings.checkpoints)},
            "forget_gradient": {"samples": len(sample), "of": len(forget), "orthogonal_to": (
                None if not settings.orthogonal_to_siblings
                else f"the summed gradient of {drawn_what}" if pushed_siblings is not None
                else f"nothing: {drawn_what.removeprefix('no sibling check: ')}")},
            "emptied_classes": emptied.record,
            "scale": scale, "correction_norm": scale * float(pushes.norm()),
            "guard": None if probe is None else {
                "probe_samples": len(probe), "original_probe_loss": before, "ceiling": ceiling, "tried": tried,
                "probe": ("kept from the removal that made this version: the original's losses read there" if kept
                          is not None else "drawn for this request; the original's losses by a pass"),
                "siblings": siblings_what if siblings is None else {
                    "what": siblings_what, "original_accuracy": siblings_before, "floor": floor}},
            "refit": refit, "parameters": len(names), "block_numel": block.numel, "timings": timings,
            "frozen_prefix": None if held is None else (
                {"rows": "prepared on all of D"} if rows is None or rows_before is None else
                {"rows_computed": rows.computed - rows_before[0], "seconds": rows.seconds - rows_before[1],
                 "rows_held": rows.held, "of": len(problem.train)}),
            "seconds": time.perf_counter() - started,
        }
        carried = {} if losses is None else {"retained_probe": ProbeLosses(
            state_digest(model), probe.sample_ids.clone(), losses, settings.probe_samples)}
        return RemovalOutcome({k: params[k].detach().clone() for k in names}, record, carried=carried)
