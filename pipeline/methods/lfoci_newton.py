"""L-FOCI blockwise Newton removal (Mehta, Pal, Singh, Ravi, CVPR 2022), with the Newton update
of Sekhari et al. (NeurIPS 2021) for m removed samples and its Gaussian noise.

With f(w, z) = loss(w, z) + (lambda/2)||w||^2, the training set D (n samples), the forget set
U (m samples), the retained objective L_{D\\U}(w) = (1/(n-m)) sum_{D\\U} f and a block P chosen
by L-FOCI (``pipeline.methods.block_choice``):
    H'   = (n H_P(D) - sum_{z in U} H_P(z)) / (n - m)       (= the Hessian of L_{D\\U} on P)
    w'_P = w_P - (H' + mu I)^{-1} (grad_P L_{D\\U}(w) - a)     (shared/REFERENCE.md section 1)
then N(0, sigma^2 I) on P, once, at the end. Parameters outside P are untouched. The step
uses the retained gradient, not (1/(n-m)) sum_U grad f: the two agree only at an exact optimum
of L_D, which an SGD-trained model or any model after an earlier noisy removal is not.

Target (``target``, ``pipeline.target``): ``minimiser`` converges to the retrained optimum of the block
(a = 0, grad_P L_{D\\U} = 0); ``retrain`` lands where the card's recipe run on D \\ U puts the block:
the minimiser for a converging recipe; for SGD with a fixed budget the recipe replay on a block of at
most ``replay_max_parameters`` entries (the block is set to it: w_replay for the whole model,
w + replay(D \\ U) - replay(D) for a part of a model with frozen layers in front), else (a larger block, or a
part of a network trained end to end) the stationary point of
L_{D\\U}(w) - <r0, w_P> + (mu/2)||w_P - w_start||^2, r0 = grad_P L_D(w_start), mu = 1/tau (the
replay's one-window form; mu is added to the damping of every Newton system).

Curvature (``curvature``): ``hessian`` takes the converged exact-Newton steps described here; ``gauss-newton``
one Gauss-Newton step accepted by a trust region, then an optional refit (``_gauss_newton_removal``; its one-window
right side reads U's term at the trained weights or, ``gauss_newton.forget_gradient: recorded_run``, along the
recorded training run: ``_forget_term``), and for a class
the request empties, Retrain's decision-layer rows replayed along the recorded run where the block holds them
(``pipeline.methods.emptied_rows``: the one-window step cannot take back what the whole run taught the class);
``auto`` the latter where the target takes the one-window form and the logits are not affine in the block
(a block inside a network trained end to end), else the former.

Each step is taken whole when it decreases the objective (Armijo's condition), else halved until it
does (``max_backtracks``); the length used is recorded. Converged block Newton (``newton_max_steps``
> 1): the step is repeated with a fresh gradient and fresh curvature until the residual is at most
max(newton_atol, newton_rtol x its start); on a convex block (an output layer over fixed features)
this is exact retraining of the block.

Robust solve: mu >= ``damping``; an indefinite H' + damping I gets Levenberg-Marquardt damping
(recorded), and a system not solved to the stated tolerance is never published: it raises
``RemovalNotServed`` (``UnsolvedSystemError``), as does a step that removes less than
``min_gradient_reduction`` of the retained block gradient. The model is then left as it was.

Privacy: the release is ``certified`` only where Sekhari et al.'s bound holds
(``pipeline.privacy.certify``); otherwise ``heuristic`` with every reason listed.

Defects of the published code avoided here: the per-sample Hessian is the real one (theirs
was always zero), gradients are fresh tensors (theirs aliased .grad), the Hessian block comes
from exact Hessian-vector products (theirs was a rank-one outer product), parameters are keyed
by qualified name (theirs by module repr), the batch factors use m and n - m (theirs used
m = 1), and nothing is skipped silently.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pipeline import memory
from pipeline.curvature import (
    BlockHessian, CappedProducts, Combination, ProductsSpent, block_gradient, check_dense_solve, solve_newton_system,
)
from pipeline.curvature.linear_layer import LinearCrossEntropyHessian, closed_form_layer
from pipeline.data.sampleset import SampleSet
from pipeline.errors import RemovalNotServed, UnsolvedSystemError
from pipeline.frozen_prefix import cache_frozen_prefix, cached_bytes_per_sample, prefix_outputs, split_for, suffix_start
from pipeline.methods.base import (
    MethodSettings, RandomStream, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method,
)
from pipeline.methods.prefix_prepared import FrozenPrefixPrepared, over_half_budget, prepare_frozen_prefix
from pipeline.methods.block_choice import CHOOSERS, block_share, forget_gradient_rows, trainable_numel
from pipeline.methods.emptied_rows import (
    EmptiedMode, EmptiedRows, emptied_class_samples_field, emptied_classes_field, plan_emptied_rows,
)
from pipeline.methods.trust_region import TrustRegion, gauss_newton_trust_step, refit_block
from pipeline.prepared import Binding, Prepared
from pipeline.privacy import certify
from pipeline.privacy.noise import secret_gaussian_noise
from pipeline.recipe import recipe_of, start_weights
from pipeline.target import REPLAY_MAX_PARAMETERS, TargetKind, budget_damping, prepare_replay, replay_target, resolve_target
from pipeline.target.oracles import ModuleBlockOracle, SubsampledCurvature
from pipeline.target.recorded_pushes import data_pushes, forget_pushes
from pipeline.tasks import Task

__all__ = ["LFociNewton", "LFociNewtonSettings", "RemovalNotServed", "UnsolvedSystemError"]


class GaussNewtonStepSettings(BaseModel):
    """The Gauss-Newton path's step (``pipeline.methods.trust_region``): its curvature and probe, its solve, the
    trust region and the bounded refit of the block."""

    model_config = ConfigDict(extra="forbid")

    curvature_samples: int | None = Field(
        2048, gt=0, description="Gauss-Newton products over a seeded subsample of this many retained samples (null: all)")
    probe_samples: int | None = Field(
        4096, gt=0, description="the ratio test's objective on a seeded probe of this many retained samples (null: all)")
    preconditioner: Literal["none", "kfac"] = Field(
        "kfac", description="the Gauss-Newton PCG's preconditioner: kfac = (K-FAC + damping I)^{-1}, K-FAC on the "
                            "curvature subsample (pipeline.curvature.kfac: one forward and one backward pass over it)")
    cg_max_iter: int = Field(10, gt=0, description="PCG iterations per solve (a truncated solve is still a descent "
                                                   "direction of the quadratic model)")
    cg_rtol: float = Field(1e-6, gt=0, description="PCG stops at this relative residual")
    min_ratio: float = Field(0.25, ge=0, lt=1, description="accept a step when actual / predicted decrease >= this")
    max_retries: int = Field(4, ge=0, description="damping increases after a rejected step; then the request is "
                                                  "refused (needs_retrain)")
    damping_growth: float = Field(2.0, gt=1, description="the damping is multiplied by this at each retry")
    gradient_samples: int | None = Field(
        8192, gt=0, description="g_D (the mean training gradient on the block) on a seeded subsample of this many "
                                "samples (null: all of D, one pass); g_U is always exact")
    refit_epochs: float = Field(0.0, ge=0, description="epochs of the recipe's SGD on D \\ U over the block after the "
                                                       "step (0: none)")
    refit_lr_scale: float = Field(0.2, ge=0, description="refit learning rate = the recipe's lr x this (cosine decay)")
    forget_gradient: Literal["end", "recorded_run"] = Field(
        "end", description="the one-window target's forget-set term: end = U's loss gradient at the trained weights, "
                           "-G_U(w0) / (n - m) in grad F(w0); recorded_run = -mu x U's pushes along the recorded training "
                           "run, (1 / n) sum_k W_k G_U(c_k) (pipeline.target.recorded_pushes.forget_pushes: at zero "
                           "curvature the step is those pushes, the retained curvature holds back the stiff directions); "
                           "a model without a recorded trajectory takes end and the record says why")
    forget_push_scale: float = Field(
        1.0, gt=0, description="recorded_run: the weight kappa of U's recorded pushes in the right side, -kappa mu delta (1: "
                               "the linearised run's own account; above 1 follows them further where the retained "
                               "curvature does not hold them back, a setting placed on tuning sets, as "
                               "trajectory-refit's scale is)")
    forget_push_part: Literal["all", "own"] = Field(
        "all", description="recorded_run: what forget_push_scale weights: all = kappa delta; own = U's pushes beyond its "
                           "share of D's, (m / n) delta_D + kappa (delta - (m / n) delta_D), delta_D = D's pushes read from "
                           "the recorded run's displacement (pipeline.target.recorded_pushes.data_pushes: no pass)")
    emptied_classes: EmptiedMode = emptied_classes_field()
    emptied_class_samples: int = emptied_class_samples_field()

    def trust_region(self) -> TrustRegion:
        return TrustRegion(curvature_samples=self.curvature_samples, probe_samples=self.probe_samples,
                           cg_max_iter=self.cg_max_iter, cg_rtol=self.cg_rtol, min_ratio=self.min_ratio,
                           max_retries=self.max_retries, damping_growth=self.damping_growth,
                           preconditioner=self.preconditioner)


class LFociNewtonSettings(certify.PrivacySettings, MethodSettings):
    selection: Literal["auto", "lfoci", "all", "parameters"] = Field(
        "auto", description="auto: the whole model when it fits whole_model_max, else lfoci")
    parameters: list[str] = Field(default_factory=list, description="for selection: parameters")
    whole_model_max: int | None = Field(
        None, ge=0, description="auto: solve the whole model when it has at most this many trainable entries "
                                "(default: dense_max)")
    include_output_layer: bool = Field(True, description="lfoci: always add the last probed layer (the decision)")
    forget_gradient_share: float = Field(
        0.5, ge=0, le=1, description="lfoci: add slices by forget-gradient norm until the block holds this share "
                                     "of ||sum_U grad f|| (0 = off)")
    record_gradient_share: bool = Field(
        True, description="parameters: record the block's share ||g_P(U)|| / ||g(U)|| of the forget gradient (a "
                          "diagnostic: one backward pass of the forget samples through the whole model; lfoci "
                          "always has it, all is 1)")
    block_numel_max: int = Field(200_000, gt=0, description="lfoci: the gradient-share additions stop at this size")
    perturbations: int = Field(1000, gt=1, description="m_p perturbed passes of the forget batch")
    probe_forget_max: int | None = Field(
        32, gt=0, description="lfoci: the probe perturbs a seeded subsample of at most this many forget samples (its "
                               "cost is m x perturbations forward passes); the Newton step uses all of them (null: all)")
    perturb_sigma: float = Field(0.1, ge=0, description="std of input noise (dense inputs)")
    token_replacements: int = Field(2, ge=1, description="tokens replaced per sequence (text)")
    pass_size: int = Field(32, gt=0, description="perturbations per forward pass")
    max_slices: int | None = Field(None, gt=0, description="cap on L-FOCI picks")
    curvature_samples: int | None = Field(
        None, gt=0, description="estimate H_P(D), and the recipe replay's Gauss-Newton matrices, on a seeded "
                                "subsample of this many training samples (gradients stay exact)")
    dense_max: int = Field(4096, gt=0, description="largest block solved densely (Cholesky); CG above")
    small_block_solver: Literal["auto", "dense"] = Field(
        "auto", description="a block of at most dense_max entries: dense = Cholesky of the materialised block; auto = "
                            "Cholesky where materialising is cheap (closed-form curvature), else CG first, capped at a "
                            "quarter of the block's entries in products over all its damping restarts, and Cholesky "
                            "only when CG did not reach cg_rtol within them (and for the removal's later steps)")
    damping: float = Field(0.0, ge=0, description="least damping mu of every Newton system (more is added "
                                                  "when H' + mu I is indefinite; the Gauss-Newton path: its first "
                                                  "solve's Levenberg-Marquardt damping)")
    dense_rtol: float = Field(1e-8, gt=0, description="relative residual a dense solve must reach")
    cg_rtol: float = Field(1e-10, gt=0, description="relative residual a CG solve must reach")
    cg_max_iter: int | None = Field(None, gt=0)
    max_damping_attempts: int = Field(12, ge=1, description="damping levels tried before giving up")
    max_backtracks: int = Field(
        20, ge=0, description="halvings of a Newton step that does not decrease L_{D\\U} (Armijo); the full "
                              "step is taken whenever it decreases the objective enough")
    target: TargetKind = Field(
        "retrain", description="retrain: where the card's recipe run on D \\ U lands (pipeline.target); minimiser: "
                               "grad L_{D\\U} = 0 on the block")
    replay_max_parameters: int = Field(
        REPLAY_MAX_PARAMETERS, gt=0, description="retrain on an SGD recipe: the largest block the recipe replay holds "
                                                 "P x P matrices for; larger blocks, and parts of a network trained end to end "
                                                 "(pipeline.target.resolve_target), take the budget-damped step")
    cache_frozen_prefix: bool = Field(
        True, description="a block after the model's first module (a Sequential, a Hugging Face encoder's upper "
                          "layers): compute the modules before it once and run every pass of the removal on the "
                          "rest (pipeline.frozen_prefix). Where the model has frozen layers before its first "
                          "trainable one, their outputs on D are prepared once (LFociNewtonPrepared) and kept for "
                          "every later version; else the modules before the block run per request (the "
                          "Gauss-Newton path only on the samples it reads)")
    closed_form_curvature: bool = Field(
        True, description="a block that is the whole last Linear layer under cross-entropy: build its Hessian in "
                          "closed form (pipeline.curvature.linear_layer), the same matrix as the Hessian-vector products")
    curvature: Literal["auto", "hessian", "gauss-newton"] = Field(
        "auto", description="hessian: the exact block Hessian, converged Newton (the steps above); gauss-newton: one "
                            "Gauss-Newton step with a trust region and a bounded refit (the gauss_newton section), for "
                            "a block inside a non-convex network; auto: gauss-newton where the target takes the one-window "
                            "form (an SGD recipe and a block too large to replay, or a part of a network trained end to "
                            "end), else "
                            "hessian (where the two differ only off an affine model's last layer)")
    gauss_newton: GaussNewtonStepSettings = Field(
        default_factory=GaussNewtonStepSettings, description="the Gauss-Newton path's step, trust region and refit")
    newton_max_steps: int = Field(3, ge=1, description="converged block Newton: most Newton steps (1 = one step)")
    newton_rtol: float = Field(1e-6, ge=0, description="stop once ||grad_P L_{D\\U}|| <= newton_rtol x its start")
    newton_atol: float = Field(1e-10, ge=0, description="... or once it is <= newton_atol")
    min_gradient_reduction: float = Field(
        0.5, ge=0, le=1, description="a removal that removes less than this share of the retained block gradient "
                                     "is not served (RemovalNotServed)")


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


@dataclass
class LFociNewtonPrepared(FrozenPrefixPrepared):
    """lfoci-newton's preparation: the frozen prefix's outputs on D (``pipeline.methods.prefix_prepared``)."""


@register_method
class LFociNewton(RemovalMethod):
    name = "lfoci-newton"
    Settings = LFociNewtonSettings
    PREPARED_FROM = ("cache_frozen_prefix",)

    def prepare(self, trained: TrainedModel, settings: LFociNewtonSettings,  # type: ignore[override]
                binding: Binding) -> LFociNewtonPrepared:
        """The frozen prefix's outputs on D, where the model has frozen layers (``LFociNewtonPrepared``)."""
        if not settings.cache_frozen_prefix:
            return LFociNewtonPrepared(binding, details={"frozen_prefix": None, "why": "cache_frozen_prefix: false"})
        return prepare_frozen_prefix(trained, binding, LFociNewtonPrepared)

    def remove(self, problem: RemovalProblem, settings: LFociNewtonSettings,  # type: ignore[override]
               prepared: Prepared) -> RemovalOutcome:
        n, m, lam = problem.n, problem.m, problem.weight_decay
        noise_cal = certify.calibration(settings, m, n, lam)
        timings: dict[str, float] = {}
        model, task, bs = problem.model, problem.task, problem.batch_size
        block, choice = CHOOSERS[settings.selection](problem, settings)
        timings.update(choice.pop("timings"))
        full_block = block.numel == trainable_numel(model)
        params = dict(model.named_parameters())
        saved = {part.name: params[part.name].detach().clone() for part in block.parts}
        w_start = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
        kind, schedule, why = resolve_target(settings.target, problem.card, lam, block.numel,
                                             settings.replay_max_parameters,
                                             part_of_end_to_end=not full_block and trained_from_input(model))
        curvature, affine = settings.curvature, None
        if curvature == "auto":
            affine = _affine_in_block(model, problem.task, block) if kind == "budget_damped" else None
            curvature = "gauss-newton" if kind == "budget_damped" and affine is None else "hessian"
        if curvature == "gauss-newton":
            if kind == "replay":  # the Gauss-Newton path takes the one-window form of the target
                kind, why = "budget_damped", "curvature: gauss-newton takes the one-window form of the recipe replay"
            return _gauss_newton_removal(
                problem, settings, block, saved, timings, noise_cal, prepared, full_block=full_block,
                mu=budget_damping(schedule, n - m) if kind == "budget_damped" else 0.0,
                record={"block": {"numel": block.numel, "full_model": full_block,
                                  "parts": block.describe() if block.numel <= 100_000 else len(block.parts)},
                        "selection": {"strategy": settings.selection, **choice}, "frozen_prefix": None,
                        "target": {"setting": settings.target, "how": kind, "why": why}})

        # every pass below runs on `work`: the model itself, or its suffix over cached prefix outputs
        prefix = None
        held = prepared.cache(model) if isinstance(prepared, LFociNewtonPrepared) else None
        own = split_for(model, task, block) if held is not None else None
        if own is not None and own.start == held.start:  # the prepared outputs are the block's
            prefix = held
        elif settings.cache_frozen_prefix and suffix_start(model, block) is not None:
            with problem.stage("prefix_cache", timings):
                prefix = cache_frozen_prefix(model, task, problem.train, block, bs)
        work = problem if prefix is None else replace(problem, model=prefix.suffix, train=prefix.train,
                                                      task=prefix.task)
        task = work.task
        forget = work.forget
        # D \ U of ``work``, taken once, on first use
        retain_set: Callable[[], SampleSet] = functools.cache(lambda: work.retain)

        with problem.stage("gradients", timings):
            g_forget = block_gradient(work.model, task, forget, block, lam, reduction="sum", batch_size=bs)
            g = block_gradient(work.model, task, retain_set(), block, lam, reduction="mean", batch_size=bs)
            share = choice.get("forget_gradient_share")
            if share is None and (full_block or settings.record_gradient_share):
                share = 1.0 if full_block else block_share(
                    forget_gradient_rows(problem),
                    {p.name: (None if p.rows is None else p.rows.tolist()) for p in block.parts})
        r0 = ((n - m) * g + g_forget) / n  # grad_P L_D(w) at the start
        start_norm = _norm(r0)
        target: dict[str, Any] = {"setting": settings.target, "how": kind, "why": why}
        anchor, mu = torch.zeros_like(r0), 0.0
        if kind == "budget_damped":
            anchor, mu = r0, budget_damping(schedule, n - m)
            target.update(equation="grad_P L_D\\U(w') - grad_P L_D(w_start) + mu (w' - w_start) = 0", mu=mu)
        elif kind == "replay":
            with problem.stage("target_replay", timings):
                w_target, target["replay"] = _replayed_block(problem, work, block, schedule, full_block,
                                                             settings.curvature_samples)
                try:
                    block.add_to_model(work.model, (w_target - w_start).to(torch.float64))
                    anchor = block_gradient(work.model, task, retain_set(), block, lam, reduction="mean", batch_size=bs)
                finally:
                    _restore(model, saved)
            target["equation"] = "w' = w_replay (grad_P L_D\\U(w') = grad_P L_D\\U(w_replay))"
        else:
            target["equation"] = "grad_P L_D\\U(w') = 0"
        residual = g - anchor
        g0 = _norm(residual)
        raw0 = _norm(g)
        tol = max(settings.newton_atol, settings.newton_rtol * g0)

        curv_data, curv_note = work.train, "all training samples"
        subsampled = settings.curvature_samples is not None and settings.curvature_samples < n
        if subsampled:
            curv_data = work.train.take(_curvature_subsample(problem, n, settings.curvature_samples))
            curv_note = f"seeded subsample of {settings.curvature_samples} training samples (stream 2)"
        factory = problem.curvature_factory or BlockHessian
        if settings.closed_form_curvature and problem.curvature_factory is None \
                and closed_form_layer(work.model, task, block) is not None:
            # the same matrix, in closed form (pipeline.curvature.linear_layer); a curvature factory the
            # caller supplied (Ray workers) is used as asked
            factory = LinearCrossEntropyHessian
        cg_failed = False
        dense = block.numel <= settings.dense_max
        history: list[dict[str, Any]] = []
        solvers: list[dict[str, Any]] = []  # every step's solve, in order
        info = None
        norm_g = g0
        f_now: float | None = None  # the line search's objective at the current weights, once known
        solve_settings = settings if mu == 0.0 else settings.model_copy(update={"damping": settings.damping + mu})
        try:
            if kind == "replay":  # the target is a point: set the block to it and check it there
                with problem.stage("verify", timings):
                    block.add_to_model(work.model, (w_target - w_start).to(torch.float64))
                    g = block_gradient(work.model, task, retain_set(), block, lam, reduction="mean", batch_size=bs)
                norm_g = _norm(g - anchor)
                history.append({"step": 1, "residual_norm_after": norm_g, "retain_gradient_norm_after": _norm(g),
                                "step_norm": _norm(w_target - w_start), "step_length": 1.0, "damping": 0.0,
                                "solver": "recipe replay", "iterations": 0, "relative_residual": 0.0})
            for k in range(0 if kind == "replay" else settings.newton_max_steps):
                if norm_g <= tol and k > 0:
                    break
                with problem.stage("curvature_and_solve", timings):
                    h_train = factory(work.model, task, curv_data, block, lam, reduction="mean", batch_size=bs)
                    forget_factory = LinearCrossEntropyHessian if factory is LinearCrossEntropyHessian else BlockHessian
                    h_forget = forget_factory(work.model, task, forget, block, lam, reduction="sum", batch_size=bs)
                    h_new = Combination([(n / (n - m), h_train), (-1.0 / (n - m), h_forget)])
                    direction, info, fell_back = _newton_direction(
                        h_new, residual, solve_settings, dense=dense,
                        cheap_dense=factory is LinearCrossEntropyHessian or cg_failed)
                    cg_failed = cg_failed or fell_back  # once CG missed its share, later systems go dense at once
                    solvers.append(dict(info.__dict__))
                    step_length, f_now = _backtrack(work.model, task, retain_set(), lam, bs, block, direction, residual,
                                                    settings.max_backtracks, anchor, w_start, f_now, mu)
                with problem.stage("verify", timings):
                    g = block_gradient(work.model, task, retain_set(), block, lam, reduction="mean", batch_size=bs)
                residual = _residual(g, anchor, mu, block, model, w_start)
                norm_g = _norm(residual)
                history.append({"step": k + 1, "residual_norm_after": norm_g,
                                "retain_gradient_norm_after": _norm(g),
                                "step_norm": step_length * _norm(direction), "step_length": step_length,
                                "damping": info.damping, "solver": info.solver, "iterations": info.iterations,
                                "relative_residual": info.relative_residual})
                if norm_g <= tol or step_length == 0.0:
                    break
            reduction = 1.0 - norm_g / g0 if g0 > 0 else 1.0
            if reduction < settings.min_gradient_reduction:
                raise RemovalNotServed(
                    f"the Newton step removed {100 * reduction:.1f}% of the retained gradient on the block "
                    f"(needs {100 * settings.min_gradient_reduction:.0f}%): a local step cannot serve this request",
                    {"retain_gradient_norm_before": g0, "retain_gradient_norm_after": norm_g, "steps": history})
            params = dict(model.named_parameters())
            damping_used = max(h["damping"] for h in history) if history else settings.damping
            noised = noise_cal.sigma > 0
            converged = norm_g <= tol  # (the solve's, before the noise: a removal that does not reach it is still served
            # when it removes min_gradient_reduction of the residual)
            release = certify.release(
                problem.model, problem.task, lam, settings, noise_cal, full_block=full_block, steps=len(history),
                damping_used=damping_used, subsampled=subsampled, shortened=any(h["step_length"] != 1.0 for h in history),
                start_gradient_norm=start_norm, final_gradient_norm=_norm(g),
                bounds=certify.data_bounds(problem.model, problem.task, problem.train) if noised else None)
            block.add_to_model(model, secret_gaussian_noise(block.numel, noise_cal.sigma))
            new_parameters = {part.name: params[part.name].detach().clone() for part in block.parts}
            w_published = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
            if noised:  # the record describes the published weights: nothing of the solution before the noise
                with problem.stage("verify_published", timings):
                    g = block_gradient(work.model, task, retain_set(), block, lam, reduction="mean", batch_size=bs)
                norm_g = _norm(_residual(g, anchor, mu, block, model, w_start))
        except RemovalNotServed as err:
            _restore(model, saved)
            err.diagnostics.setdefault("block_numel", block.numel)
            raise
        except BaseException:  # no half-moved model: the step, the noise and the published check stand or fall together
            _restore(model, saved)
            raise
        record = {
            "block": {"numel": block.numel, "full_model": full_block,
                      "parts": block.describe() if block.numel <= 100_000 else len(block.parts)},
            "selection": {"strategy": settings.selection, **choice},
            "frozen_prefix": prefix.describe() if prefix is not None else None,
            "target": target,
            "curvature": {"how": "hessian", "setting": settings.curvature, **({"why": affine} if affine else {}),
                          "data": curv_note, "operator": getattr(factory, "__name__", type(factory).__name__),
                          "solver": dict(info.__dict__) if info else None, "solvers": solvers,
                          "damping": settings.damping, "damping_used": damping_used},
            "newton": {"steps": len(history), "max_steps": settings.newton_max_steps, "tolerance": tol,
                       "converged": converged, "history": certify.published_history(history, noised)},
            "noise": noise_cal.as_record(),
            "epsilon_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.epsilon,
            "delta_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.delta,
            "gradient_norms": {
                "forget_sum_block": _norm(g_forget),
                "data_mean_block_start": start_norm,
                "retain_mean_block_before": raw0,
                "retain_mean_block_after": _norm(g),   # at the published weights
                "residual_before": g0,   # ||grad F|| of the target's equation (= retain gradient for the minimiser)
                "residual_after": norm_g,
            },
            "gradient_share": {
                "retained_removed": 1.0 - norm_g / g0 if g0 > 0 else 1.0,  # at the published weights
                "forget_in_block": share,       # ||g_P(U)|| / ||g(U)|| (None: record_gradient_share off)
            },
            "step_norm": _norm(w_published - w_start),  # the published step
            "timings": timings,
            "release": release.model_dump(mode="json"),
        }
        return RemovalOutcome(new_parameters, record, release)


def _affine_in_block(model: nn.Module, task: Task, block: Any) -> str | None:
    """Why the logits are affine in the block (a convex model, or a block inside the last Linear layer), else
    None: there the Gauss-Newton matrix is the Hessian and the converged exact Newton path serves."""
    if certify.convex_model_reason(model, task) is None:
        return "the model is one affine map under a convex loss"
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if linears:
        name, last = linears[-1]
        own = {f"{name}.{p}" if name else p for p, _ in last.named_parameters(recurse=False)}
        if all(part.name in own for part in block.parts):
            return "the block lies in the last Linear layer"
    return None


@dataclass(frozen=True)
class _Passes:
    """What the Gauss-Newton path's passes run on: the model, or its suffix after the block's first module with the
    frozen prefix's outputs in place of the inputs (``pipeline.frozen_prefix``: the same numbers, the prefix run
    once per sample the path reads: U, g_D's samples, the curvature subsample and the probe)."""

    model: nn.Module
    task: Task
    forget: SampleSet
    sample: SampleSet
    retain: SampleSet               # D \ U as the passes read it (the trust region draws its subsamples from it)
    inputs: Callable[[SampleSet], SampleSet] | None = None
    record: dict[str, Any] | None = None


def _passes(problem: RemovalProblem, block: Any, positions: torch.Tensor | None, use_prefix: bool, reads: int,
            timings: dict[str, float], prepared: Prepared) -> _Passes:
    """``positions``: g_D's samples in D (None: all of D); ``reads``: how many samples the path will pass through the
    prefix (U, g_D's sample, the curvature subsample and the probe). With the frozen prefix's outputs prepared
    (``LFociNewtonPrepared``) every pass runs on the suffix after the frozen layers over them. Else, with a split
    before the block, the prefix runs on the samples read, whose outputs are held at once: the suffix is taken only
    where they fit half of what the memory budget leaves (else the whole model, and the record says why)."""
    held = prepared.cache(problem.model) if use_prefix and isinstance(prepared, LFociNewtonPrepared) else None
    if held is not None:
        features = held.train
        return _Passes(held.suffix, held.task, features.take(problem.forget_positions),
                       features if positions is None else features.take(positions),
                       features.without(problem.forget_positions),
                       record={"suffix_start_module": held.start, "prefix": "prepared once (the frozen layers' outputs "
                                                                            "on D)",
                               "suffix_modules": [type(m).__name__ for m in held.suffix.children()]})
    sample = problem.train if positions is None else problem.train.take(positions)
    split = split_for(problem.model, problem.task, block) if use_prefix else None
    if split is None:
        return _Passes(problem.model, problem.task, problem.forget, sample, problem.retain)
    model, task, bs = problem.model, problem.task, problem.batch_size
    over = over_half_budget(model, reads * cached_bytes_per_sample(split, model, task, problem.forget),
                             f"the prefix's outputs of the {reads} samples the path reads")
    if over is not None:
        return _Passes(problem.model, problem.task, problem.forget, sample, problem.retain, record={
            "suffix_start_module": split.start, "skipped": f"{over}: every pass runs through the whole model"})
    counted = {"samples": 0}

    def inputs(data: SampleSet) -> SampleSet:
        counted["samples"] += len(data)
        return prefix_outputs(split, model, task, data, bs)

    with problem.stage("prefix_cache", timings):
        forget, sample = inputs(problem.forget), inputs(sample)
    suffix = split.suffix_of(model)
    return _Passes(suffix, split.task, forget, sample, problem.retain, inputs,
                   {"suffix_start_module": split.start, "prefix": "per request, on the samples read",
                    "prefix_samples": counted, "suffix_modules": [type(m).__name__ for m in suffix.children()]})


def _retained_gradient(passes: _Passes, block: Any, n: int, lam: float, bs: int) -> tuple[torch.Tensor, ...]:
    """(g_U summed over U, g_D's mean over the passes' sample, g_R = (n g_D - g_U) / (n - m)) on the block."""
    m = len(passes.forget)
    g_forget = block_gradient(passes.model, passes.task, passes.forget, block, lam, reduction="sum", batch_size=bs)
    g_data = block_gradient(passes.model, passes.task, passes.sample, block, lam, reduction="mean", batch_size=bs)
    return g_forget, g_data, (n * g_data - g_forget) / (n - m)


def _gauss_newton_removal(problem: RemovalProblem, settings: LFociNewtonSettings, block: Any,
                          saved: dict[str, torch.Tensor], timings: dict[str, float], noise_cal: Any,
                          prepared: Prepared, *,
                          full_block: bool, mu: float, record: dict[str, Any]) -> RemovalOutcome:
    """The block's Gauss-Newton path (``curvature: gauss-newton``; ``pipeline.methods.trust_region``):
        rhs = grad F(w0) = g_R - g_D = (m / (n - m)) (g_D - g_U)     (one-window target, mu = 1 / tau)
                         = (m / (n - m)) (g_D - lambda w0) - mu delta  (the same, U read along the recorded run:
                                                                        ``_forget_term``)
                         = g_R = (n g_D - m g_U) / (n - m)            (minimiser, mu = 0)
    with g_U exact over U and g_D over D; for the one-window target, where its error enters scaled by
    m / (n - m), over a seeded subsample of ``gauss_newton.gradient_samples`` of D (the record says which).
    One Gauss-Newton step s = -(G_R + (lambda + mu + damping) I)^{-1} rhs (``damping``: the settings' least
    damping, Levenberg-Marquardt's) accepted by the trust region; ``gauss_newton.refit_epochs`` of the
    recipe's SGD on D \\ U over the block; the noise; then the residual at the published weights on the same
    samples (``verify``). No accepted step, or any failure: the model as it was. Never certified.
    With ``cache_frozen_prefix`` and a block after the model's first module, every pass but the refit runs on the
    suffix over the prefix's outputs of the samples it reads (``_passes``)."""
    gn, lam, n = settings.gauss_newton, problem.weight_decay, problem.n
    model, task = problem.model, problem.task
    positions = None
    if mu > 0 and gn.gradient_samples is not None and gn.gradient_samples < n:
        gen = problem.generator(RandomStream.GRADIENT_SUBSAMPLE)
        positions = torch.randperm(n, generator=gen)[:gn.gradient_samples].sort().values
    retained = n - problem.m
    reads = problem.m + (n if positions is None else len(positions)) + sum(
        retained if k is None else min(k, retained) for k in (gn.curvature_samples, gn.probe_samples))
    passes = _passes(problem, block, positions, settings.cache_frozen_prefix, reads, timings, prepared)
    sample = passes.sample
    record["frozen_prefix"] = passes.record
    with problem.stage("gradients", timings):
        g_forget, g_data, g_retain = _retained_gradient(passes, block, n, lam, problem.batch_size)
        share = record["selection"].get("forget_gradient_share")
        if share is None and (full_block or settings.record_gradient_share):
            share = 1.0 if full_block else block_share(
                forget_gradient_rows(problem), {p.name: (None if p.rows is None else p.rows.tolist()) for p in block.parts})
    anchor = g_data if mu > 0 else torch.zeros_like(g_data)
    w_start = block.gather({k: v.detach() for k, v in model.named_parameters()}).to("cpu", torch.float64)
    record["target"]["equation"] = ("grad_P L_D\\U(w') - grad_P L_D(w_start) + mu (w' - w_start) = 0" if mu > 0
                                    else "grad_P L_D\\U(w') = 0")
    record["target"]["mu"] = mu
    if mu > 0:  # the forget set's term: at the end of the run, or along the recorded run
        anchor, record["target"]["forget_gradient"] = _forget_term(problem, block, gn, anchor, g_forget, w_start, mu,
                                                                    timings)
    rhs = g_retain - anchor
    noised = noise_cal.sigma > 0
    try:
        with problem.stage("curvature_and_solve", timings):
            step, trust = gauss_newton_trust_step(passes.model, passes.task, block, passes.retain, rhs, mu, lam,
                                                  gn.trust_region(), seed=problem.seed, batch_size=problem.batch_size,
                                                  extra_damping=settings.damping, inputs=passes.inputs)
        if noised:  # nothing of the solution before the noise: the trials' step norms and decreases go
            trust = {**trust, "trials": [{k: t[k] for k in ("damping", "cg_iterations", "cg_converged", "accepted")}
                                         for t in trust["trials"]]}
        if step is None:
            best = max((t.get("ratio") for t in trust["trials"] if t.get("ratio") is not None), default=float("nan"))
            raise RemovalNotServed(
                f"no Gauss-Newton step on the block passed the trust region's ratio test in {len(trust['trials'])} "
                f"tries (best ratio {best:.3g}, needs {gn.min_ratio}): the quadratic model does not describe this "
                "removal; retrain", {**record, "trust_region": trust, "timings": timings})
        block.add_to_model(model, step.to(torch.float64))
        emptied = _emptied_in_block(problem, gn, block, timings, prepared)  # reads the recorded run; the model kept as it is
        recipe = recipe_of(problem.card) if problem.card is not None else None
        with problem.stage("refit", timings):
            refit = refit_block(model, task, block, problem.retain, recipe, lam, epochs=gn.refit_epochs,
                                lr_scale=gn.refit_lr_scale, seed=problem.seed)
        emptied.apply(model)
        accepted = next(t for t in trust["trials"] if t["accepted"]) if trust["trials"] else {"damping": lam + mu}
        release = certify.release(
            model, task, lam, settings, noise_cal, full_block=full_block, steps=1, damping_used=accepted["damping"],
            subsampled=True, shortened=False, start_gradient_norm=_norm(g_data), final_gradient_norm=math.inf,
            other_reasons=["one Gauss-Newton step with a trust region and a refit (curvature: gauss-newton): the "
                           "bound covers an exact Newton step on a convex model"] + (
                ["the emptied classes' decision-layer rows replayed along the recorded run, outside the Newton step"]
                if emptied.rows else []),
            bounds=certify.data_bounds(model, task, problem.train) if noised else None)
        block.add_to_model(model, secret_gaussian_noise(block.numel, noise_cal.sigma))
        with problem.stage("verify", timings):  # at the published weights, on the step's samples
            _, g_data_after, g_retain_after = _retained_gradient(passes, block, n, lam, problem.batch_size)
            w = block.gather({k: v.detach() for k, v in model.named_parameters()}).to("cpu", torch.float64)
            after = _norm(g_retain_after - anchor + mu * (w - w_start))
    except BaseException:
        _restore(model, saved)
        raise
    params = dict(model.named_parameters())
    new_parameters = {part.name: params[part.name].detach().clone() for part in block.parts}
    before = _norm(rhs)
    record.update({
        "curvature": {"how": "gauss-newton", "setting": settings.curvature, "operator": "BlockGaussNewton",
                      "data": (f"seeded subsample of {trust['curvature_samples']} retained samples"
                               if "curvature_samples" in trust else "none: g_R = g_D, nothing to move")},
        "trust_region": trust, "refit": refit, "emptied_classes": emptied.record,
        "gradient_norms": {
            "forget_sum_block": _norm(g_forget), "data_mean_block_start": _norm(g_data),
            "retain_mean_block_before": _norm(g_retain), "residual_before": before,
            "retain_mean_block_after": _norm(g_retain_after), "residual_after": after,   # at the published weights
            "data_gradient": ("exact (all of D)" if len(sample) == n else
                              f"g_D on a seeded subsample of {len(sample)} of the {n} samples, before and after")},
        "gradient_share": {"retained_removed": 1.0 - after / before if before > 0 else 1.0, "forget_in_block": share},
        "noise": noise_cal.as_record(),
        "epsilon_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.epsilon,
        "delta_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.delta,
        "timings": timings, "release": release.model_dump(mode="json"),
        # the published step (the weights' own, computable from the two versions), refit and noise included
        "step_norm": _norm(w - w_start),
    })
    return RemovalOutcome(new_parameters, record, release)


def _forget_term(problem: RemovalProblem, block: Any, gn: GaussNewtonStepSettings, anchor: torch.Tensor,
                 g_forget: torch.Tensor, w_start: torch.Tensor, mu: float,
                 timings: dict[str, float]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The one-window anchor with U's term read where ``gn.forget_gradient`` says, and its record.

    The one-window right side g_R(w0) - g_D(w0) holds U's loss gradient at the trained weights only, as
    -G_U(w0) / (n - m) (g_R = (n g_D - g_U) / (n - m), g_U = G_U + m lambda w0 over U). ``recorded_run`` puts U's
    recorded pushes in its place: the anchor becomes g_D(w0) - G_U(w0) / (n - m) + mu delta,
    delta = (1 / n) sum_k W_k G_U(c_k) over the run's checkpoints c_k (``forget_pushes``), so that
        grad F(w0) = (m / (n - m)) (g_D(w0) - lambda w0) - mu delta,
    and a direction the retained curvature does not train (G_R = 0 there) moves by delta, less the
    (m / (n - m)) reweighting of D's residual: the recorded run's own pushes of U, which Retrain never took.
    ``gn.forget_push_scale`` (kappa) weights the pushes: -kappa mu delta in grad F(w0); with ``gn.forget_push_part``
    ``own`` only U's own part, -mu ((m / n) delta_D + kappa (delta - (m / n) delta_D)), delta_D = D's pushes over the
    recorded run (``data_pushes``: read from the run's displacement, no pass; n the set the run saw)."""
    trajectory, how, scale, part = problem.trajectory, gn.forget_gradient, gn.forget_push_scale, gn.forget_push_part
    if how == "end":
        return anchor, {"how": "end", "equation": "U's loss gradient at the trained weights"}
    why = (f"no recorded training trajectory ({problem.trajectory_missing or 'none was written'})"
           if trajectory is None else
           None if set(p.name for p in block.parts) <= set(trajectory.parameters) else
           "the recorded trajectory lacks the block's parameters")
    if why is not None:
        return anchor, {"how": "end", "asked": how, "why": f"{why}: U's gradient at the trained weights"}
    m, n = problem.m, problem.n
    forget = problem.forget
    with problem.stage("forget_pushes", timings):
        pushes = forget_pushes(problem.model, trajectory, lambda: block_gradient(
            problem.model, problem.task, forget, block, 0.0, reduction="sum", batch_size=problem.batch_size))
    end = g_forget - m * problem.weight_decay * w_start  # G_U(w0): U's loss gradient, no weight decay
    record: dict[str, Any] = {}
    if part == "own" and scale != 1.0:
        decay = recipe_of(problem.card).weight_decay if problem.card is not None else problem.weight_decay
        share = (m / trajectory.n) * data_pushes(trajectory, block.gather, decay)
        weighted = share + scale * (pushes - share)
        record["share_of_d_norm_ratio"] = _norm(share) / max(_norm(pushes), 1e-300)   # ||(m/n) delta_D|| / ||delta||
    else:
        weighted = scale * pushes
    return anchor - end / (n - m) + mu * weighted, {
        "how": "recorded_run", "checkpoints": len(trajectory.checkpoints), "samples": m, "push_scale": scale,
        "push_part": part, **record,
        "equation": "-G_U(w0) / (n - m) replaced by -mu (1 / n) sum_k W_k G_U(c_k) (U's recorded pushes)" + (
            "" if scale == 1.0 else f", weighted by kappa = {scale:g}" + (
                " beyond U's share (m / n) delta_D of D's pushes" if part == "own" else ""))}


def _emptied_in_block(problem: RemovalProblem, gn: GaussNewtonStepSettings, block: Any,
                      timings: dict[str, float], prepared: Prepared) -> EmptiedRows:
    """The emptied classes' replayed rows (``pipeline.methods.emptied_rows``), where the block holds them whole: a
    row outside the block is not the removal's to move (checked before the replay runs)."""
    parts = {part.name: part.rows for part in block.parts}

    def admits(classes: list[int], names: tuple[str, str | None]) -> str | None:
        for name in (n for n in names if n is not None):
            rows = parts.get(name, ())
            if name not in parts or (rows is not None and not set(classes) <= set(rows.tolist())):
                return f"the block does not hold the rows {classes} of {name}"
        return None

    return plan_emptied_rows(problem, gn.emptied_classes, gn.emptied_class_samples, timings, prepared, admits)


def _newton_direction(op: Any, rhs: torch.Tensor, settings: LFociNewtonSettings, *, dense: bool,
                      cheap_dense: bool) -> tuple[torch.Tensor, Any, bool]:
    """The Newton system's solution, its ``SolveInfo`` and whether a CG-first solve fell back to
    the dense one: CG above dense_max; at or below it, Cholesky, unless ``small_block_solver: auto``
    and materialising the block is not ``cheap_dense`` (its dim columns are Hessian-vector products
    through the model, taken ``columns_per_pass`` at a time): then CG first, with at most dim / 4
    products over all its damping restarts, and the dense solve only when CG did not reach cg_rtol
    within them. A CG that converges costs a fraction of the dense build; one that does not adds
    dim / 4 products to it, which is (1 + c / 4)x the dense cost where a product costs c vmapped
    columns (c about 4.5 on the test MLP, under 1 through the bench CNN). When the dense system does
    not fit the memory budget, CG goes on to cg_max_iter instead. After a fallback the caller solves
    the removal's later systems densely at once."""
    def solve(target: Any, as_dense: bool, max_iter: int | None) -> tuple[torch.Tensor, Any]:
        return solve_newton_system(target, rhs, dense=as_dense, damping=settings.damping,
                                   rtol=settings.dense_rtol if as_dense else settings.cg_rtol, max_iter=max_iter,
                                   max_attempts=settings.max_damping_attempts)

    if not dense:
        return (*solve(op, False, settings.cg_max_iter), False)
    if settings.small_block_solver == "dense" or cheap_dense:
        return (*solve(op, True, None), False)
    cap = max(1, op.dim // 4)
    capped = CappedProducts(op, cap if settings.cg_max_iter is None else min(cap, settings.cg_max_iter))
    try:
        direction, info = solve(capped, False, settings.cg_max_iter)
    except (UnsolvedSystemError, ProductsSpent) as err:
        why = (f"relative residual left {err.diagnostics.get('solver', {}).get('relative_residual', float('nan')):.1e}"
               if isinstance(err, UnsolvedSystemError) else "its damping restarts included")
        spent = (f"CG did not reach cg_rtol {settings.cg_rtol:.1e} within {capped.cap} products (a quarter of the "
                 f"block's {op.dim} columns, or cg_max_iter; {why})")
        try:
            check_dense_solve(op)
        except memory.MemoryBudgetError as too_big:
            direction, info = solve(op, False, settings.cg_max_iter)
            info.notes.append(f"{spent}; the dense system does not fit ({too_big}): CG went on")
            return direction, info, False
        direction, info = solve(op, True, None)
        info.notes.append(f"{spent}: solved densely")
        return direction, info, True
    info.notes.append(f"CG instead of materialising the {op.dim} x {op.dim} block: {capped.products} products, "
                      "damping restarts included (small_block_solver: auto)")
    return direction, info, False


@torch.no_grad()
def _value(model: nn.Module, task: Task, data, lam: float, batch_size: int) -> float:
    """L_{D\\U}(w) = mean loss + (lambda/2)||w||^2 over trainable parameters (float64 sum)."""
    from pipeline.training import objective

    return float(objective(model, task, data, lam, batch_size).double())


def _backtrack(model: nn.Module, task: Task, retain, lam: float, batch_size: int, block, direction: torch.Tensor,
               g: torch.Tensor, max_backtracks: int, anchor: torch.Tensor | None = None,
               w_ref: torch.Tensor | None = None, f_start: float | None = None, mu: float = 0.0) -> tuple[float, float]:
    """Apply w_P -= t d with the largest t in {1, 1/2, ...} satisfying Armijo's condition
    F(w - t d) <= F(w) - 1e-4 t g'd on F = L_{D\\U} - <anchor, w_P - w_ref> + (mu/2)||w_P - w_ref||^2 (g = grad F; d from a
    positive definite, possibly damped, system, so g'd > 0); a change below the objective's
    rounding counts as satisfied. Returns t (0: no step) and F at the weights left (``f_start``:
    F at the current weights when the caller knows it, saving a pass)."""
    params = dict(model.named_parameters())

    def value() -> float:
        f = _value(model, task, retain, lam, batch_size)
        if w_ref is not None and ((anchor is not None and bool(anchor.any())) or mu > 0):
            w = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
            if anchor is not None:
                f -= float(anchor @ (w - w_ref))
            f += 0.5 * mu * float((w - w_ref) @ (w - w_ref))
        return f

    f0 = value() if f_start is None else f_start
    slope = float(g @ direction)
    eps = torch.finfo(next(model.parameters()).dtype).eps
    noise = 64 * eps * max(abs(f0), 1e-30)
    saved = {part.name: params[part.name].detach().clone() for part in block.parts}
    t = 1.0
    for _ in range(max_backtracks + 1):
        block.add_to_model(model, -t * direction)
        f1 = value()
        if f1 <= f0 - 1e-4 * t * slope or abs(f1 - f0) <= noise:
            return t, f1
        _restore(model, saved)
        t *= 0.5
    return 0.0, f0


def _residual(g: torch.Tensor, anchor: torch.Tensor, mu: float, block: Any, model: nn.Module,
              w_start: torch.Tensor) -> torch.Tensor:
    """grad F = grad_P L_D\\U - a + mu (w_P - w_start) at the model's current block weights."""
    if mu == 0.0:
        return g - anchor
    w = block.gather({k: v.detach() for k, v in model.named_parameters()}).to("cpu", torch.float64)
    return g - anchor + mu * (w - w_start)


def trained_from_input(model: nn.Module) -> bool:
    """Whether the recipe trained the model's first parameterised layer (no frozen layers in front of the trainable
    ones: a network trained end to end), read from ``requires_grad`` as the recipe left it."""
    first = next(iter(model.parameters()), None)
    return first is not None and first.requires_grad


def _curvature_subsample(problem: RemovalProblem, n: int, count: int) -> torch.Tensor:
    """The removal's seeded curvature subsample: ``count`` of the ``n`` training positions, sorted
    (stream CURVATURE_SUBSAMPLE: the Newton step's H_P(D) and the replay's G take the same samples)."""
    gen = problem.generator(RandomStream.CURVATURE_SUBSAMPLE)
    return torch.randperm(n, generator=gen)[:count].sort().values


def _replayed_block(problem: RemovalProblem, work: RemovalProblem, block: Any, schedule: Any,
                    full_block: bool, curvature_samples: int | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The block's recipe-replay target (``pipeline.target.replay``) over ``work``'s model and data:
    the replay itself for the whole model, else w + replay(D \\ U) - replay(D). ``curvature_samples``:
    the replay's Gauss-Newton matrices on the same seeded subsample as the Newton step's H_P(D)
    (``SubsampledCurvature``; gradients stay exact)."""
    import time

    assert problem.card is not None
    started = time.perf_counter()
    module = ModuleBlockOracle(work.model, work.task, work.train, block)
    oracle: Any = module
    if curvature_samples is not None and curvature_samples < module.n:
        oracle = SubsampledCurvature(module, _curvature_subsample(problem, module.n, curvature_samples))
    w_init = block.gather(start_weights(problem.card)).to(torch.float64)
    prepared = prepare_replay(oracle, schedule, w_init)
    labels = work.train.columns.get("y") if work.task.loss == "cross_entropy" else None
    w, cost = replay_target(oracle, prepared, work.forget_positions, labels=labels)
    if not full_block:
        w = module.w_ref + w - prepared.w_mean_field
    return w, {"how": "recipe replay" if full_block else "w + replay(D \\ U) - replay(D)",
               "preparation": {"cost": prepared.cost.as_record(), "seconds": prepared.seconds},
               "cost": cost.as_record(), "seconds": time.perf_counter() - started}


@torch.no_grad()
def _restore(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, value in saved.items():
        params[name].copy_(value)
