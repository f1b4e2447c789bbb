"""L-FOCI blockwise Newton removal (Mehta, Pal, Singh, Ravi, CVPR 2022), with the Newton
update of Sekhari et al. (NeurIPS 2021) for m removed samples and its Gaussian noise.

With f(w, z) = loss(w, z) + (lambda/2)||w||^2, the training set D (n samples), the forget set
U (m samples), the retained objective L_{D\\U}(w) = (1/(n-m)) sum_{D\\U} f and a block P:
    H'   = (n H_P(D) - sum_{z in U} H_P(z)) / (n - m)       (= the Hessian of L_{D\\U} on P)
    w'_P = w_P - (H' + mu I)^{-1} grad_P L_{D\\U}(w)           (shared/REFERENCE.md section 1)
then N(0, sigma^2 I) on P, once, at the end. Parameters outside P are untouched. The step
uses the retained gradient, not (1/(n-m)) sum_U grad f: the two agree only at an exact optimum
of L_D, which an SGD-trained model or any model after an earlier noisy removal is not.

Each step is taken whole when it decreases L_{D\\U} (Armijo's condition), else halved until it
does (``max_backtracks``); the length used is recorded.
Converged block Newton (``newton_max_steps`` > 1): the step is repeated with a fresh gradient
and fresh curvature until ||grad_P L_{D\\U}|| <= max(newton_atol, newton_rtol ||grad_P^0||);
on a convex block (an output layer over fixed features) this is exact retraining of the block.

Anchored target (``anchor: training_residual``): a model trained by SGD for a fixed budget is
not at a stationary point of L_D; its residual r0 = grad_P L_D(w) is unfinished training that
Retrain with the same recipe leaves unfinished too. The anchored removal solves
    grad_P L_{D\\U}(w') = r0        (a stationary point of L_{D\\U}(w) - <r0, w_P>)
by the same converged Newton iteration (Newton step on the residual grad_P L_{D\\U} - r0,
Armijo on L_{D\\U} - <r0, w_P>). At an exact optimum of L_D, r0 = 0 and it is the retrained
optimum; its first step from w is the forget-gradient form of REFERENCE section 1,
w + H'^{-1} (1/(n-m)) sum_U (grad f(w, z) - r0). The retained gradient it leaves is reported.

Matrix-free decision layer (``curvature_refresh: matrix_free``; the block is the whole last Linear
under cross-entropy over cached inputs): Newton's method on the same anchored objective with the
exact Hessian at the current weights, H V = (1/n_r) [M(x) (V x~)] x~^T + lambda V, never built
(``pipeline.decision_layer_newton``), each system solved by PCG to the forcing tolerance
(preconditioner: the warm H_P(D)^{-1} when prepared), until ||grad_P L_{D\\U} - anchor|| <= tol;
otherwise ``RemovalNotServed``. The chord (``first_step``) keeps the start curvature, which after
a class is forgotten overstates the curvature of its row by orders of magnitude, so its steps
stall there. With the anchor, the rows of a class that has no retained sample are not anchored
(``anchor_absent_classes: false``): their residual is the forgotten samples' unfinished fit.

Hidden step (``hidden_step: gauss_newton``; the model is a head of Linear layers under cross-entropy):
the parameters outside the block move by their part of one anchored Gauss-Newton step on the whole
head, w + (G_{D\\U} + lambda I)^{-1} (1/(n-m)) sum_U (grad loss(w, z) - mean_D grad loss), taken at
the start weights and truncated (``pipeline.head_gauss_newton``); the block is solved as without it.
A heuristic: no noise on those parameters, and the release says so.

Robust solve: mu >= ``damping``; an indefinite H' + damping I gets Levenberg-Marquardt damping
(recorded), and a system not solved to the stated tolerance is never published: it raises
``RemovalNotServed`` (``UnsolvedSystemError``), as does a step that removes less than
``min_gradient_reduction`` of the retained block gradient. The model is then left as it was.
``RemovalNotServed`` is defined in ``pipeline.curvature`` and re-exported here.

Privacy: the release is ``certified`` only where Sekhari et al.'s bound holds (see
``privacy_release``); otherwise ``heuristic`` with every reason listed.

Defects of the published code avoided here: the per-sample Hessian is the real one (theirs
was always zero), gradients are fresh tensors (theirs aliased .grad), the Hessian block comes
from exact Hessian-vector products (theirs was a rank-one outer product), parameters are keyed
by qualified name (theirs by module repr), the batch factors use m and n - m (theirs used
m = 1), and nothing is skipped silently.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, Callable, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from pipeline.data.sampleset import SampleSet
from pipeline.curvature import (
    BlockHessian, Combination, DenseOperator, LinearOperator, RemovalNotServed, SolveInfo, UnsolvedSystemError,
    block_gradient, check_dense_solve, preconditioned_conjugate_gradient, solve_newton_system,
)
from pipeline.methods.base import (
    MethodSettings, RandomStream, RemovalMethod, RemovalOutcome, RemovalProblem, register_method,
)
from pipeline.frozen_prefix import cache_frozen_prefix, suffix_start
from pipeline import memory
from pipeline.head_gauss_newton import GaussNewtonStep, HeadCurvature, gauss_newton_step, head_layout
from pipeline.decision_layer_newton import SoftmaxLayerObjective, dense_preconditioner, newton_minimise, working_bytes
from pipeline.linear_curvature import (LinearCrossEntropyHessian, WarmCurvature, _block_order, closed_form_layer,
                                       native_bfloat16, products_dtype)
from pipeline.methods.block_choice import CHOOSERS, block_share, forget_gradient_rows, trainable_numel
from pipeline.probe import eval_mode_restored
from pipeline.privacy.noise import (
    DEFAULT_HESSIAN_LIPSCHITZ, DEFAULT_LIPSCHITZ_LOSS, NoiseCalibration, calibrate, secret_gaussian_noise,
)
from pipeline.privacy.release import Guarantee, PrivacyRelease
from pipeline.tasks import Task

__all__ = ["LFociNewton", "LFociNewtonSettings", "RemovalNotServed", "UnsolvedSystemError", "privacy_release"]


class LFociNewtonSettings(MethodSettings):
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
    perturb_sigma: float = Field(0.1, ge=0, description="std of input noise (dense inputs)")
    token_replacements: int = Field(2, ge=1, description="tokens replaced per sequence (text)")
    pass_size: int = Field(32, gt=0, description="perturbations per forward pass")
    max_slices: int | None = Field(None, gt=0, description="cap on L-FOCI picks")
    curvature_samples: int | None = Field(
        None, gt=0, description="estimate H_P(D) on a seeded subsample of this many training samples "
                                "(matrix_free: Hessian products on this many retained samples; gradients stay exact)")
    dense_max: int = Field(4096, gt=0, description="largest block solved densely (Cholesky); CG above")
    small_block_solver: Literal["auto", "dense"] = Field(
        "auto", description="a block of at most dense_max entries: dense = Cholesky of the materialised block; auto = "
                            "Cholesky where materialising is cheap (closed-form curvature, or first_step, which "
                            "reuses the factor), else CG first, capped at a quarter of the block's entries in "
                            "products over all its damping restarts, and Cholesky only when CG did not reach "
                            "cg_rtol within them (and for the removal's later steps)")
    damping: float = Field(0.0, ge=0, description="least damping mu of every Newton system (more is added "
                                                  "when H' + mu I is indefinite)")
    dense_rtol: float = Field(1e-8, gt=0, description="relative residual a dense solve must reach")
    cg_rtol: float = Field(1e-10, gt=0, description="relative residual a CG solve must reach")
    cg_max_iter: int | None = Field(None, gt=0)
    max_damping_attempts: int = Field(12, ge=1, description="damping levels tried before giving up")
    max_backtracks: int = Field(
        20, ge=0, description="halvings of a Newton step that does not decrease L_{D\\U} (Armijo); the full "
                              "step is taken whenever it decreases the objective enough")
    anchor: Literal["none", "training_residual"] = Field(
        "none", description="none: converge to the retrained optimum (grad L_{D\\U} = 0); training_residual: "
                            "to grad L_{D\\U}(w') = r0 = grad_P L_D(w) at the start (equal on a model at its optimum; "
                            "keeps an SGD-trained model's unfinished training out of the removal)")
    cache_frozen_prefix: bool = Field(
        True, description="a block in the trailing modules of a Sequential: compute the modules before it once "
                          "and run every pass of the removal on the rest (pipeline.frozen_prefix)")
    closed_form_curvature: bool = Field(
        True, description="a block that is the whole last Linear layer under cross-entropy: build its Hessian in "
                          "closed form (pipeline.linear_curvature), the same matrix as the Hessian-vector products")
    curvature_refresh: Literal["every_step", "first_step", "matrix_free"] = Field(
        "every_step", description="every_step: fresh curvature for each Newton step (Newton's method); first_step: "
                                  "the first step's system (factorised once) for every step, with fresh gradients "
                                  "(a chord iteration: same fixed point, linear convergence, far cheaper steps); "
                                  "matrix_free: Newton's method with the exact curvature of D\\U at the current "
                                  "weights, never built: closed-form products over the cached inputs, inexact PCG "
                                  "(pipeline.decision_layer_newton; the block must be the whole last Linear layer "
                                  "under cross-entropy)")
    anchor_absent_classes: bool = Field(
        False, description="matrix_free with anchor training_residual: keep the anchor on the decision-layer rows of "
                           "classes that have no retained sample (false: those rows go to the plain retrained optimum; "
                           "their residual is the forgotten samples' unfinished fit, which Retrain never has)")
    curvature_products: Literal["auto", "layer", "bfloat16"] = Field(
        "auto", description="matrix_free: precision of the Hessian products (they only steer the Newton direction; "
                            "the gradient, the objective and the stopping test keep the layer's precision). layer: the "
                            "layer's own (float32 model: float32; else float64); bfloat16: curvature rows in bfloat16, "
                            "float32 in between (CG asked for no more than 1.6e-2); auto: bfloat16 for a float32 layer "
                            "where this machine multiplies bfloat16 natively, else layer")
    newton_preconditioner: Literal["auto", "kronecker", "none"] = Field(
        "auto", description="matrix_free: PCG preconditioner. auto: the warm H_P(D)^{-1} when a prepared curvature "
                            "holds for the start, else none; kronecker: (A (x) G + lambda I)^{-1}, no preparation")
    newton_forcing: float = Field(
        0.5, gt=0, lt=1, description="matrix_free: each Newton system solved to relative residual "
                                     "min(newton_forcing, sqrt(||grad|| / ||grad_0||)) (inexact Newton)")
    newton_recycle: int = Field(
        40, ge=0, description="matrix_free: the last this many CG directions of the earlier Newton systems (with "
                              "their Hessian products) update the preconditioner by limited-memory BFGS "
                              "(Morales & Nocedal 2000); 0 = off")
    newton_max_steps: int = Field(3, ge=1, description="converged block Newton: most Newton steps (1 = one step)")
    newton_rtol: float = Field(1e-6, ge=0, description="stop once ||grad_P L_{D\\U}|| <= newton_rtol x its start")
    newton_atol: float = Field(1e-10, ge=0, description="... or once it is <= newton_atol")
    min_gradient_reduction: float = Field(
        0.5, ge=0, le=1, description="a removal that removes less than this share of the retained block gradient "
                                     "is not served (RemovalNotServed)")
    exact_start_tol: float = Field(1e-8, gt=0, description="certification: ||grad L_D(w)|| below this counts "
                                                           "as the exact minimiser")
    hidden_step: Literal["none", "gauss_newton"] = Field(
        "none", description="gauss_newton: also move the parameters outside the block (a head of Linear layers under "
                            "cross-entropy, e.g. its hidden layers) by their part of one anchored, truncated Gauss-"
                            "Newton step on the whole head, taken at the start weights (pipeline.head_gauss_newton); "
                            "heuristic, no noise on those parameters")
    hidden_step_rows: int = Field(1024, gt=0, description="hidden_step: Gauss-Newton products over this many retained "
                                                          "samples of largest curvature trace 1 - sum_c p_c^2")
    hidden_step_iterations: int = Field(2, ge=0, description="hidden_step: PCG iterations from the EK-FAC solution")
    hidden_step_damping: float = Field(0.0, ge=0, description="hidden_step: damping added to the weight decay")
    hidden_step_min_trace_share: float = Field(
        0.9, ge=0, le=1, description="hidden_step: no step (recorded) where the rows kept hold less than this share of "
                                     "the retained curvature trace (the truncated Gauss-Newton matrix would understate it)")
    epsilon: float = Field(math.inf, description="privacy budget of this removal; inf = no noise")
    delta: float = Field(1e-5)
    lipschitz_loss: float = Field(DEFAULT_LIPSCHITZ_LOSS, gt=0)
    hessian_lipschitz: float = Field(DEFAULT_HESSIAN_LIPSCHITZ, gt=0)
    strong_convexity: float | None = Field(None, gt=0, description="lambda of the bound; default: weight decay")

    @field_validator("epsilon")
    @classmethod
    def _eps(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("epsilon must be > 0 (use .inf for no noise)")
        return v

    @field_validator("delta")
    @classmethod
    def _delta(cls, v: float) -> float:
        if not 0 < v < 1:
            raise ValueError("delta must lie strictly between 0 and 1")
        return v


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


# Model classes whose loss is convex in the parameters: a single affine map (after flattening)
# under a loss that is convex in the logits.
_AFFINE_ONLY = (nn.Sequential, nn.Flatten, nn.Identity, nn.Linear)
_CONVEX_LOSSES = {"cross_entropy", "mse", "bce_multilabel"}


def convex_model_reason(model: nn.Module, task: Task) -> str | None:
    """None when the objective is convex in the trainable parameters (one Linear map, convex
    loss); otherwise why that cannot be claimed."""
    loss = getattr(task, "loss", None)
    if loss not in _CONVEX_LOSSES:
        return f"loss '{loss}' is not known to be convex in the parameters"
    other = sorted({type(m).__name__ for m in model.modules() if not isinstance(m, _AFFINE_ONLY)})
    if other:
        return f"the model is not one affine map (it has {', '.join(other)}): its loss is not convex in the weights"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        return f"the model composes {len(linears)} Linear layers: its loss is not convex in the weights"
    return None


def privacy_release(
    problem: RemovalProblem, settings: LFociNewtonSettings, cal: NoiseCalibration, *, full_block: bool,
    steps: int, damping_used: float, subsampled: bool, shortened: bool, start_gradient_norm: float, final_gradient_norm: float,
    inexact_solve: str | None = None, moved_outside_block: bool = False,
) -> PrivacyRelease:
    """``certified`` only where Sekhari et al. (2021, Thm 3.2) holds: a full-parameter step on a
    convex model with weight decay lambda > 0 (strong convexity no larger than lambda), and
    either (a) one undamped Newton step with the exact Hessian from the exact minimiser
    (||grad L_D|| <= exact_start_tol), or (b) a result whose retained gradient proves it lies
    within gamma of the retrained optimum: ||w - w*|| <= ||grad L_{D\\U}(w)|| / lambda <= gamma
    (lambda-strong convexity). Otherwise ``heuristic`` with every reason (``moved_outside_block``:
    the hidden step moved parameters the noise does not cover)."""
    if math.isinf(cal.epsilon) or cal.sigma == 0.0:
        return PrivacyRelease.non_private()
    lam = problem.weight_decay
    reasons: list[str] = []
    if not full_block:
        reasons.append("blockwise step: the bound covers a full-parameter Newton step")
    if moved_outside_block:
        reasons.append("hidden_step: parameters outside the block were moved by a truncated Gauss-Newton step, "
                       "without noise")
    convex = convex_model_reason(problem.model, problem.task)
    if convex:
        reasons.append(convex)
    if not lam > 0:
        reasons.append("no weight decay: the objective is not strongly convex")
    elif cal.strong_convexity > lam:
        reasons.append(f"strong_convexity {cal.strong_convexity} exceeds the weight decay {lam}: "
                       "not a property of the objective")
    one_step: list[str] = []
    if steps != 1:
        one_step.append(f"{steps} Newton steps (the one-step bound covers one)")
    if damping_used > 0:
        one_step.append(f"damped solve (damping {damping_used:.3g})")
    if shortened:
        one_step.append("a Newton step was shortened by the line search")
    if subsampled:
        one_step.append("curvature estimated on a subsample")
    if inexact_solve:
        one_step.append(inexact_solve)
    if not start_gradient_norm <= settings.exact_start_tol:
        one_step.append(f"start is not the exact minimiser (||grad L_D|| = {start_gradient_norm:.3g} > "
                        f"{settings.exact_start_tol:g}): a sequential or SGD-trained model")
    if one_step and lam > 0:
        bound = final_gradient_norm / lam
        if not bound <= cal.gamma:
            reasons.extend(one_step)
            reasons.append(f"the a-posteriori distance bound ||grad L_D\\U||/lambda = {bound:.3g} exceeds "
                           f"gamma = {cal.gamma:.3g}")
    elif one_step:
        reasons.extend(one_step)
    return PrivacyRelease(
        mechanism="gaussian", sigma=cal.sigma, sensitivity=cal.gamma, epsilon=cal.epsilon, delta=cal.delta,
        calibration=cal.calibration,  # type: ignore[arg-type]
        guarantee=Guarantee.HEURISTIC if reasons else Guarantee.CERTIFIED, reasons=reasons,
    )


@register_method
class LFociNewton(RemovalMethod):
    name = "lfoci-newton"
    Settings = LFociNewtonSettings

    @staticmethod
    def _system(problem: RemovalProblem, work: RemovalProblem, settings: LFociNewtonSettings, block, curv_data,
                forget, factory, n: int, m: int, lam: float, warm: "WarmCurvature | None",
                notes: dict[str, Any]) -> Combination:
        """H' = (n H_P(D) - H_P(U)) / (n - m), from the warm H_P(D) when it holds at these weights."""
        bs = problem.batch_size
        if warm is not None:
            h_train: Any = LinearCrossEntropyHessian(work.model, work.task, curv_data, block, lam, matrix=warm.matrix) \
                if factory is LinearCrossEntropyHessian else DenseOperator(warm.matrix)
        else:
            h_train = factory(work.model, work.task, curv_data, block, lam, reduction="mean", batch_size=bs)
        forget_factory = LinearCrossEntropyHessian if factory is LinearCrossEntropyHessian else BlockHessian
        h_forget = forget_factory(work.model, work.task, forget, block, lam, reduction="sum", batch_size=bs)
        return Combination([(n / (n - m), h_train), (-1.0 / (n - m), h_forget)])

    def run(self, problem: RemovalProblem, settings: LFociNewtonSettings) -> RemovalOutcome:  # type: ignore[override]
        n, m, lam = problem.n, problem.m, problem.weight_decay
        noise_cal = calibrate(
            epsilon=settings.epsilon, delta=settings.delta, m=m, n=n,
            strong_convexity=settings.strong_convexity or lam,
            lipschitz_loss=settings.lipschitz_loss, hessian_lipschitz=settings.hessian_lipschitz,
        )
        with eval_mode_restored(problem.model):
            return self._run(problem, settings, noise_cal, n, m, lam)

    def _run(self, problem: RemovalProblem, settings: LFociNewtonSettings, noise_cal: NoiseCalibration,
             n: int, m: int, lam: float) -> RemovalOutcome:
        timings: dict[str, float] = {}
        model, task, bs = problem.model, problem.task, problem.batch_size
        block, choice = CHOOSERS[settings.selection](problem, settings)
        timings.update(choice.pop("timings"))
        full_block = block.numel == trainable_numel(model)
        params = dict(model.named_parameters())
        saved = {part.name: params[part.name].detach().clone() for part in block.parts}
        w_start = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)

        # every pass below runs on `work`: the model itself, or its suffix over cached prefix outputs
        warm = problem.extras.get("warm_curvature")
        if not (isinstance(warm, WarmCurvature) and warm.holds_for(model, block, problem.train, lam)):
            warm = None
        prefix = None
        if settings.cache_frozen_prefix and warm is not None and warm.prefix is not None:
            # the same frozen prefix on the same data: its outputs are kept; the suffix is this model's
            prefix = replace(warm.prefix, suffix=model[warm.prefix.start:])
        elif settings.cache_frozen_prefix and suffix_start(model, block) is not None:
            with problem.stage("prefix_cache", timings):
                prefix = cache_frozen_prefix(model, task, problem.train, block, bs)
        work = problem if prefix is None else replace(problem, model=prefix.suffix, train=prefix.train)
        forget = work.forget
        # D \ U of ``work``, taken once, on first use: a matrix-free removal from the prepared X~ never
        # needs it (a copy of n - m rows it would make only to read their labels)
        retain_set: Callable[[], SampleSet] = functools.cache(lambda: work.retain)

        hidden: GaussNewtonStep | None = None
        if settings.hidden_step == "gauss_newton":  # at the start weights, before the block moves
            with problem.stage("hidden_step", timings):
                hidden = _hidden_step(problem, block, settings)
        with problem.stage("gradients", timings):
            g_forget = block_gradient(work.model, task, forget, block, lam, reduction="sum", batch_size=bs)
            if warm is not None and warm.training_gradient is not None:
                # grad L_{D\U} = (n grad L_D - g_U) / (n - m) from the prepared grad L_D at these weights:
                # only the m forgotten samples are passed over
                g = (n * warm.training_gradient - g_forget) / (n - m)
            else:
                g = block_gradient(work.model, task, retain_set(), block, lam, reduction="mean", batch_size=bs)
            share = choice.get("forget_gradient_share")
            if share is None and (full_block or settings.record_gradient_share):
                share = 1.0 if full_block else block_share(
                    forget_gradient_rows(problem),
                    {p.name: (None if p.rows is None else p.rows.tolist()) for p in block.parts})
        r0 = ((n - m) * g + g_forget) / n  # grad_P L_D(w) at the start
        start_norm = _norm(r0)
        anchor = r0 if settings.anchor == "training_residual" else torch.zeros_like(r0)
        unanchored: list[int] = []
        if settings.anchor == "training_residual" and settings.curvature_refresh == "matrix_free" \
                and not settings.anchor_absent_classes:
            # a class with no retained sample: its row's residual is the forgotten samples' unfinished
            # fit, which Retrain never has; that row's target is the plain retrained optimum
            unanchored, entries = _absent_class_entries(work, task, block)
            anchor = anchor.clone()
            anchor[entries] = 0.0
        residual = g - anchor
        g0 = _norm(residual)
        raw0 = _norm(g)
        tol = max(settings.newton_atol, settings.newton_rtol * g0)

        curv_data, curv_note = work.train, "all training samples"
        subsampled = settings.curvature_samples is not None and settings.curvature_samples < n
        if subsampled:
            if settings.curvature_refresh != "matrix_free":  # (the matrix-free products draw their own rows)
                gen = problem.generator(RandomStream.CURVATURE_SUBSAMPLE)
                pick = torch.randperm(n, generator=gen)[: settings.curvature_samples].sort().values
                curv_data = work.train.take(pick)
            curv_note = f"seeded subsample of {settings.curvature_samples} training samples (stream 2)"
        factory = problem.curvature_factory or BlockHessian
        if settings.closed_form_curvature and problem.curvature_factory is None \
                and closed_form_layer(work.model, task, block) is not None:
            # the same matrix, in closed form (pipeline.linear_curvature); a curvature factory the
            # caller supplied (Ray workers) is used as asked
            factory = LinearCrossEntropyHessian
        curvature_notes: dict[str, Any] = {"operator": getattr(factory, "__name__", type(factory).__name__),
                                           "warm_first_step": warm is not None,
                                           "retained_gradient": "prepared grad L_D minus the forgotten samples'"
                                           if warm is not None and warm.training_gradient is not None
                                           else "a pass over D \\ U",
                                           "refresh": settings.curvature_refresh}
        chord: _Chord | _WarmChord | None = None
        cg_failed = False
        dense = block.numel <= settings.dense_max
        history: list[dict[str, Any]] = []
        solvers: list[dict[str, Any]] = []  # every step's solve, in order
        info = None
        norm_g = g0
        f_now: float | None = None  # the line search's objective at the current weights, once known
        try:
            if settings.curvature_refresh == "matrix_free":
                with problem.stage("curvature_and_solve", timings):
                    history, solvers, verify = _matrix_free_newton(work, task, retain_set, block, lam, anchor,
                                                                   residual, tol, settings, warm)
                with problem.stage("verify", timings):  # at the published (rounded) weights
                    g = verify()
                residual = g - anchor
                norm_g = _norm(residual)
                curvature_notes["operator"] = "closed-form products at the current weights (matrix-free)"
                if solvers and "curvature_rows_cut" in solvers[0]:  # the memory budget subsampled the products
                    subsampled = True
                    curv_note = f"seeded subsample of {solvers[0]['curvature_rows']} retained samples (stream 2; " \
                                f"{solvers[0]['curvature_rows_cut']})"
            else:
                for k in range(settings.newton_max_steps):
                    if norm_g <= tol and k > 0:
                        break
                    with problem.stage("curvature_and_solve", timings):
                        if chord is None and k == 0 and warm is not None and warm.inverse is not None \
                                and factory is LinearCrossEntropyHessian and settings.curvature_refresh == "first_step":
                            h_forget = LinearCrossEntropyHessian(work.model, task, forget, block, lam, reduction="sum",
                                                                 batch_size=bs)
                            chord = _WarmChord(warm, h_forget, n, m, settings.dense_rtol, settings.cg_max_iter)
                        if chord is not None:
                            direction, info = chord.solve(residual)
                        else:
                            h_new = self._system(problem, work, settings, block, curv_data, forget, factory, n, m, lam,
                                                 warm if k == 0 else None, curvature_notes)
                            direction, info, fell_back = _newton_direction(
                                h_new, residual, settings, dense=dense,
                                cheap_dense=factory is LinearCrossEntropyHessian or settings.curvature_refresh == "first_step"
                                or cg_failed)
                            cg_failed = cg_failed or fell_back  # once CG missed its share, later systems go dense at once
                            if settings.curvature_refresh == "first_step" and dense:
                                chord = _Chord(h_new.to_dense(), info.damping, settings.dense_rtol)
                        solvers.append(dict(info.__dict__))
                        step_length, f_now = _backtrack(work.model, task, retain_set(), lam, bs, block, direction, residual,
                                                        settings.max_backtracks, anchor, w_start, f_now)
                    with problem.stage("verify", timings):
                        g = block_gradient(work.model, task, retain_set(), block, lam, reduction="mean",
                                           batch_size=bs)
                    residual = g - anchor
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
        except RemovalNotServed as err:
            _restore(model, saved)
            err.diagnostics.setdefault("block_numel", block.numel)
            raise

        params = dict(model.named_parameters())
        w_solved = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
        damping_used = max(h["damping"] for h in history) if history else settings.damping
        raw_after = _norm(g)
        release = privacy_release(
            problem, settings, noise_cal, full_block=full_block, steps=len(history), damping_used=damping_used,
            subsampled=subsampled, shortened=any(h["step_length"] != 1.0 for h in history),
            start_gradient_norm=start_norm, final_gradient_norm=raw_after,
            inexact_solve=("matrix_free: each Newton system solved inexactly (PCG to the forcing term "
                           f"{settings.newton_forcing:g} or better), not Sekhari's exact-Hessian step"
                           if settings.curvature_refresh == "matrix_free" else None),
            moved_outside_block=hidden is not None and bool(hidden.delta))
        noise = secret_gaussian_noise(block.numel, noise_cal.sigma)
        block.add_to_model(model, noise)
        new_parameters = {part.name: params[part.name].detach().clone() for part in block.parts}
        if hidden is not None:
            with torch.no_grad():
                for name, delta in hidden.delta.items():
                    params[name].add_(delta.to(params[name].dtype))
                    new_parameters[name] = params[name].detach().clone()
        record = {
            "block": {"numel": block.numel, "full_model": full_block,
                      "parts": block.describe() if block.numel <= 100_000 else len(block.parts)},
            "selection": {"strategy": settings.selection, **choice},
            "frozen_prefix": prefix.describe() if prefix is not None else None,
            "target": {"anchor": settings.anchor, "anchor_norm": _norm(anchor), "unanchored_classes": unanchored,
                       "equation": "grad_P L_D\\U(w') = 0" if settings.anchor == "none"
                       else "grad_P L_D\\U(w') = grad_P L_D(w_start)"},
            "curvature": {"data": curv_note, **curvature_notes, "solver": dict(info.__dict__) if info else None,
                          "solvers": solvers,
                          "damping": settings.damping, "damping_used": damping_used},
            "newton": {"steps": len(history), "max_steps": settings.newton_max_steps, "tolerance": tol,
                       "converged": norm_g <= tol, "history": history},
            "noise": noise_cal.as_record(),
            "epsilon_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.epsilon,
            "delta_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.delta,
            "gradient_norms": {
                "forget_sum_block": _norm(g_forget),
                "data_mean_block_start": start_norm,
                "retain_mean_block_before": raw0,
                "retain_mean_block_after": raw_after,
                "residual_before": g0,   # ||grad_P L_D\\U - anchor|| (= retain gradient when anchor is none)
                "residual_after": norm_g,
            },
            "gradient_share": {
                "retained_removed": reduction,  # 1 - ||residual after|| / before (pre-noise)
                "forget_in_block": share,       # ||g_P(U)|| / ||g(U)|| (None: record_gradient_share off)
            },
            "hidden_step": None if hidden is None else hidden.record,
            "step_norm": _norm(w_solved - w_start),
            "noise_norm": _norm(noise),
            "timings": timings,
            "release": release.model_dump(mode="json"),
        }
        return RemovalOutcome(new_parameters, record, release)


def _hidden_step(problem: RemovalProblem, block, settings: LFociNewtonSettings) -> GaussNewtonStep:
    """The parameters outside the block, moved by their part of one Gauss-Newton step on the head
    (none where the step was skipped: its record says why)."""
    if settings.anchor != "training_residual":
        raise ValueError("hidden_step: gauss_newton takes the anchored step (grad L_{D\\U}(w') = grad L_D(w)); "
                         "set anchor: training_residual so that the block aims at the same target, or set "
                         "hidden_step: none")
    inside = {part.name for part in block.parts}
    partial = [part.name for part in block.parts if part.rows is not None]
    if partial:
        raise ValueError(f"hidden_step: gauss_newton needs whole parameters in the block; {partial} are "
                         "row slices: name whole parameters (selection: parameters) or set hidden_step: none")
    outside_names = [k for k in head_layout(problem.model, problem.task).parameter_names() if k not in inside]
    if not outside_names:
        raise ValueError("hidden_step: gauss_newton has nothing to move: the block already holds every parameter "
                         "of the head; set hidden_step: none")
    prepared = problem.extras.get("head_curvature")
    step = gauss_newton_step(problem.model, problem.task, problem.train, problem.forget_positions,
                             problem.weight_decay, rows=settings.hidden_step_rows,
                             iterations=settings.hidden_step_iterations, damping=settings.hidden_step_damping,
                             min_trace_share=settings.hidden_step_min_trace_share,
                             prepared=prepared if isinstance(prepared, HeadCurvature) else None,
                             batch_size=problem.batch_size)
    outside = {k: step.delta[k] for k in outside_names if k in step.delta}
    moved = _norm(torch.cat([v.reshape(-1) for v in outside.values()])) if outside else 0.0
    return GaussNewtonStep(outside, {**step.record, "parameters": outside_names, "step_norm_outside_block": moved,
                                     "block_solved_over": "the start weights of these parameters: the record's "
                                     "newton, gradient_norms and gradient_share describe the weights before this "
                                     "step was added"})


def _layer_order(model: nn.Module, block, layer: nn.Linear) -> torch.Tensor:
    """Block entry i -> its (class, input-with-bias) flat index class * (d + 1) + input in ``layer``."""
    names = {name: ("weight" if p is layer.weight else "bias") for name, p in model.named_parameters()
             if p is layer.weight or p is layer.bias}
    return _block_order(block, names, layer.out_features, layer.in_features)


def _absent_class_entries(work: RemovalProblem, task: Task, block) -> tuple[list[int], torch.Tensor]:
    """The classes with no retained sample (counts over D less those over U) and the block
    entries of their decision-layer rows (weight row and bias); empty unless the block is the
    whole last Linear under cross-entropy."""
    layer = closed_form_layer(work.model, task, block)
    if layer is None:
        return [], torch.zeros(0, dtype=torch.long)
    k = layer.out_features
    labels = work.train.columns["y"].long().reshape(-1)
    counts = torch.bincount(labels, minlength=k)[:k] - torch.bincount(labels[work.forget_positions], minlength=k)[:k]
    absent = (counts == 0).nonzero().squeeze(1)
    order = _layer_order(work.model, block, layer)
    entries = torch.isin(order // (layer.in_features + 1), absent).nonzero().squeeze(1)
    return absent.tolist(), entries


def _matrix_free_newton(work: RemovalProblem, task: Task, retain_set: Callable[[], SampleSet], block, lam: float,
                        anchor: torch.Tensor, residual: torch.Tensor, tol: float, settings: LFociNewtonSettings,
                        warm: "WarmCurvature | None") -> tuple[list[dict[str, Any]], list[dict[str, Any]], Callable[[], torch.Tensor]]:
    """``curvature_refresh: matrix_free``: minimise L_{D\\U}(w) - <anchor, w_P> over the decision
    layer by Newton's method with the exact curvature at the current weights, applied in closed
    form over the cached inputs (``pipeline.decision_layer_newton``); the result is written into
    the layer. Returns (history, solvers, verify): ``verify()`` is grad_P L_{D\\U} (mean, lambda
    w_P included) at the weights the layer then holds (rounded to its dtype), in block order, by
    the same closed form in the passes' last precision. Raises ``RemovalNotServed`` when
    ||grad|| <= tol is not reached."""
    layer = closed_form_layer(work.model, task, block)
    if layer is None:
        raise ValueError("curvature_refresh: matrix_free needs a block that is the whole last Linear layer under "
                         "cross-entropy over fixed inputs (selection: parameters naming the output layer's weight "
                         "and bias, cache_frozen_prefix: true); use every_step or first_step for other blocks")
    if layer.bias is None:
        raise ValueError("curvature_refresh: matrix_free needs an output layer with a bias (its closed form works "
                         "on x~ = (x, 1)); use curvature_refresh: every_step for a Linear without bias")
    params = dict(work.model.named_parameters())
    k, d = layer.out_features, layer.in_features
    order = _layer_order(work.model, block, layer)

    def to_theta(v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(k * (d + 1), dtype=torch.float64)
        out[order] = v.to("cpu", torch.float64)
        return out.reshape(k, d + 1)

    smoothing = float(getattr(task, "loss_options", {}).get("label_smoothing", 0.0))
    keep = xt = x_norm = start_logits = None
    prepared = warm is not None and warm.inputs is not None and warm.inputs.shape == (len(work.train), d + 1)
    n_retain = len(work.train) - len(work.forget_positions)
    # products in the layer's own precision (float32 model: float32 products, float64 everywhere else),
    # or in bfloat16 (``curvature_products``); the preconditioner keeps the layer's
    product_dtype = products_dtype(layer)
    device = warm.inputs.device if prepared else torch.device("cpu")
    curvature_dtype = torch.bfloat16 if settings.curvature_products == "bfloat16" or (
        settings.curvature_products == "auto" and product_dtype == torch.float32 and native_bfloat16(device)) \
        else product_dtype
    count, budget_note = _curvature_rows_within_budget(
        n_retain, d, k, settings, product_dtype, curvature_dtype, prepared_rows=len(work.train) if prepared else None,
        warm=warm, order=order)
    if prepared:
        # the prepared X~ of D (and X~^T, logits, ||X~||_F), the forgotten rows masked: no copy of D_r
        # per removal, and no pass over X~ at the start
        x, xt, x_norm, start_logits = warm.inputs, warm.inputs_t, warm.inputs_norm, warm.logits
        keep = torch.ones(len(work.train), dtype=torch.bool)
        keep[work.forget_positions] = False
        labels = work.train.columns["y"]
        inputs_note = "prepared X~ of D, forgotten rows masked"
    else:
        retain = retain_set()
        x = torch.ones(len(retain), d + 1, dtype=products_dtype(layer))  # x~ = (x, 1), one copy
        x[:, :d] = retain.columns["x"].reshape(len(retain), d)
        labels = retain.columns["y"]
        inputs_note = "copy of D_r"
    targets = (1 - smoothing) * nn.functional.one_hot(labels.long(), k).to(torch.float64) + smoothing / k
    w_start = block.gather({name: p.detach() for name, p in params.items()}).to("cpu", torch.float64)
    theta0 = to_theta(w_start)
    rows = None
    if count < n_retain:
        gen = work.generator(RandomStream.CURVATURE_SUBSAMPLE)
        rows = torch.randperm(n_retain, generator=gen)[:count].sort().values
        if keep is not None:  # the same retained samples, as rows of D
            rows = torch.nonzero(keep).squeeze(1)[rows]
    objective = SoftmaxLayerObjective(x, targets, lam, to_theta(anchor), theta0, rows, curvature_dtype, keep, xt, x_norm)
    choice = settings.newton_preconditioner
    preconditioner: Any = choice
    if choice == "auto":
        preconditioner = "none"
        if warm is not None and warm.inverse is not None:
            preconditioner = dense_preconditioner(warm.layer_inverse(order, product_dtype), (k, d + 1))
            choice = "warm H_P(D)^-1"
    result = newton_minimise(objective, theta0, tol=tol, max_steps=settings.newton_max_steps,
                             preconditioner=preconditioner, forcing=settings.newton_forcing,
                             max_cg=settings.cg_max_iter or MATRIX_FREE_MAX_CG, max_backtracks=settings.max_backtracks,
                             recycle=settings.newton_recycle,
                             start=None if start_logits is None else (start_logits, to_theta(residual)))
    history = [{"step": h["step"], "residual_norm_after": h["gradient_norm"], "step_length": h["step_length"],
                "damping": 0.0, "solver": "pcg-matrix-free", "iterations": h["cg_iterations"],
                "relative_residual": h["cg_relative_residual"]} for h in result.history]
    if settings.newton_recycle:
        choice = f"{choice}, updated by the last {settings.newton_recycle} CG pairs (L-BFGS)"
    solvers = [{"solver": "pcg-matrix-free", "preconditioner": choice, "passes_over_inputs": result.passes,
                "converged": result.converged, "product_dtype": str(curvature_dtype).removeprefix("torch."),
                "pass_dtype": result.pass_dtype if not result.float64_from else
                f"float32 for {result.float64_from - 1} steps, then float64 (float32 could not certify or resolve "
                "the tolerance)",
                "gradient_rounding_floor": result.gradient_floor,
                "curvature_rows": n_retain if rows is None else len(rows), "inputs": inputs_note,
                **({"curvature_rows_cut": budget_note} if budget_note else {})}]
    if not result.converged:
        raise RemovalNotServed(
            f"matrix-free Newton did not reach ||grad|| <= {tol:.3g} in {settings.newton_max_steps} steps "
            f"(left {result.gradient_norm:.3g}; raise newton_max_steps or newton_rtol)",
            {"retain_gradient_norm_before": result.start_gradient_norm, "retain_gradient_norm_after":
             result.gradient_norm, "steps": history})
    with torch.no_grad():
        block.add_to_model(work.model, result.theta.reshape(-1)[order] - w_start)

    def verify() -> torch.Tensor:
        published = to_theta(block.gather({name: p.detach() for name, p in params.items()}))
        gradient = objective.gradient(published, objective.probabilities(objective.logits(published))) \
            + objective.anchor  # (F's anchor term taken off)
        return gradient.reshape(-1)[order]

    return history, solvers, verify


class _ProductsSpent(Exception):
    """The CG-first solve used up its products (``_CappedProducts``)."""


class _CappedProducts(LinearOperator):
    """``op`` that raises ``_ProductsSpent`` at its (cap + 1)-th product: one cap for a whole
    CG solve, every damping restart included."""

    def __init__(self, op: Any, cap: int):
        self.op, self.cap, self.dim, self.products = op, cap, op.dim, 0

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self.products += 1
        if self.products > self.cap:
            raise _ProductsSpent
        return self.op.matvec(v)


def _newton_direction(op: Any, rhs: torch.Tensor, settings: LFociNewtonSettings, *, dense: bool,
                      cheap_dense: bool) -> tuple[torch.Tensor, Any, bool]:
    """The Newton system's solution, its ``SolveInfo`` and whether a CG-first solve fell back to
    the dense one: CG above dense_max; at or below it,
    Cholesky, unless ``small_block_solver: auto`` and materialising the block is not
    ``cheap_dense`` (its dim columns are Hessian-vector products through the model, taken
    ``columns_per_pass`` at a time): then CG first, with at most dim / 4 products over all its
    damping restarts, and the dense solve only when CG did not reach cg_rtol within them. A CG
    that converges costs a fraction of the dense build; one that does not adds dim / 4 products
    to it, which is (1 + c / 4)x the dense cost where a product costs c vmapped columns (c about
    4.5 on the test MLP, under 1 through the bench CNN). When the dense system does not fit the
    memory budget, CG goes on to cg_max_iter instead. After a fallback the caller solves the
    removal's later systems densely at once."""
    def solve(target: Any, as_dense: bool, max_iter: int | None) -> tuple[torch.Tensor, Any]:
        return solve_newton_system(target, rhs, dense=as_dense, damping=settings.damping,
                                   rtol=settings.dense_rtol if as_dense else settings.cg_rtol, max_iter=max_iter,
                                   max_attempts=settings.max_damping_attempts)

    if not dense:
        return (*solve(op, False, settings.cg_max_iter), False)
    if settings.small_block_solver == "dense" or cheap_dense:
        return (*solve(op, True, None), False)
    cap = max(1, op.dim // 4)
    capped = _CappedProducts(op, cap if settings.cg_max_iter is None else min(cap, settings.cg_max_iter))
    try:
        direction, info = solve(capped, False, settings.cg_max_iter)
    except (UnsolvedSystemError, _ProductsSpent) as err:
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


#: CG iterations per matrix-free Newton system when cg_max_iter is unset.
MATRIX_FREE_MAX_CG = 200

#: The fewest curvature rows a memory budget may cut the matrix-free products to (all of R when
#: it has fewer): below this a subsampled Hessian steers the Newton steps poorly.
MIN_CURVATURE_ROWS = 1024


def _curvature_rows_within_budget(n_retain: int, d: int, k: int, settings: LFociNewtonSettings,
                                  product_dtype: torch.dtype, curvature_dtype: torch.dtype, *,
                                  prepared_rows: int | None, warm: "WarmCurvature | None",
                                  order: torch.Tensor) -> tuple[int, str | None]:
    """How many retained rows the matrix-free products may use: ``curvature_samples`` (all of R
    when unset), cut to what the memory budget holds beside the iteration's other arrays
    (``decision_layer_newton.working_bytes``; a subsampled Hessian leaves the minimiser as it
    is), never below MIN_CURVATURE_ROWS; ``MemoryBudgetError`` before anything is allocated
    when even that does not fit. ``prepared_rows``: the rows of a prepared X~ of D (else R is
    copied). Returns (rows, a note when the budget cut them)."""
    budget = memory.available_in(memory.current_budget())
    want = n_retain if settings.curvature_samples is None else min(int(settings.curvature_samples), n_retain)
    preconditioner = 0.0
    if settings.newton_preconditioner == "auto" and warm is not None and warm.inverse is not None:
        if not warm.has_layer_inverse(order, product_dtype):
            # layer_ordered: a float64 permuted copy, its symmetrised sum, and the cast that is kept
            preconditioner = (k * (d + 1)) ** 2 * (2 * 8 + product_dtype.itemsize)
    kronecker = settings.newton_preconditioner == "kronecker"

    def plan(copies_rows: bool) -> tuple[float, float]:
        return working_bytes(prepared_rows or n_retain, d, k, input_itemsize=product_dtype.itemsize,
                             curvature_itemsize=curvature_dtype.itemsize,
                             work_itemsize=4 if curvature_dtype in (torch.bfloat16, torch.float32) else 8,
                             copies_inputs=prepared_rows is None, copies_curvature_rows=copies_rows,
                             preconditioner_bytes=preconditioner, kronecker=kronecker,
                             recycle=settings.newton_recycle, max_cg=settings.cg_max_iter or MATRIX_FREE_MAX_CG)

    # the rows are all of X~ in its own precision (no copy) only when R is copied whole, in that precision
    fixed, per_row = plan(copies_rows=not (want == n_retain and prepared_rows is None
                                           and curvature_dtype == product_dtype))
    if fixed + want * per_row <= budget.bytes:
        return want, None
    fixed, per_row = plan(copies_rows=True)  # a subsample is a copy
    least = min(want, MIN_CURVATURE_ROWS)
    room = budget.bytes - fixed
    fit = min(want, int(room // per_row)) if room > 0 else 0
    if fit < least:
        raise memory.MemoryBudgetError(
            f"{budget.named()} cannot hold the matrix-free Newton iteration on the {k} x {d + 1} decision layer "
            f"with {least} curvature rows (needs ~{memory.format_bytes(fixed + least * per_row)}): raise "
            f"{memory.SETTING}")
    return fit, (f"{want} curvature rows asked, {fit} fit {budget.named()} "
                 f"(~{memory.format_bytes(fixed)} fixed, {memory.format_bytes(per_row)} per row)")


class _Chord:
    """One factorised Newton system reused for later steps (``curvature_refresh: first_step``)."""

    def __init__(self, matrix: torch.Tensor, damping: float, rtol: float):
        self.matrix = matrix.to(torch.float64).clone()
        self.matrix.diagonal().add_(damping)
        self.chol = torch.linalg.cholesky(self.matrix)
        self.damping, self.rtol = damping, rtol

    def solve(self, rhs: torch.Tensor) -> tuple[torch.Tensor, SolveInfo]:
        b = rhs.to(torch.float64)
        x = torch.cholesky_solve(b.unsqueeze(1), self.chol).squeeze(1)
        rel = float(torch.linalg.vector_norm(self.matrix @ x - b) / max(float(torch.linalg.vector_norm(b)), 1e-300))
        if not rel <= self.rtol:
            raise UnsolvedSystemError(f"the reused Newton system was not solved to {self.rtol:.1e} (relative residual "
                                      f"{rel:.3e}); nothing was published", {"relative_residual": rel})
        return x, SolveInfo("cholesky-reused", relative_residual=rel, damping=self.damping, tolerance=self.rtol)


class _WarmChord:
    """The first system H' = (n H_P(D) - H_P(U)) / (n - m) at the start weights, from the warm
    H_P(D): never materialised or factorised per removal; solved by conjugate gradients
    preconditioned with the warm inverse of (n / (n - m)) H_P(D) (few iterations when U
    is a small part of D), matrix-free products with H_P(U) in closed form."""

    def __init__(self, warm: WarmCurvature, h_forget: LinearCrossEntropyHessian, n: int, m: int, rtol: float,
                 max_iter: int | None):
        self.op = Combination([(n / (n - m), DenseOperator(warm.matrix)), (-1.0 / (n - m), h_forget)])
        self.inverse, self.factor = warm.inverse, (n - m) / n
        self.rtol, self.max_iter = rtol, max_iter or 1000

    def precondition(self, r: torch.Tensor) -> torch.Tensor:
        return self.factor * (self.inverse @ r)

    def solve(self, rhs: torch.Tensor) -> tuple[torch.Tensor, SolveInfo]:
        x, info = preconditioned_conjugate_gradient(self.op, rhs, self.precondition, rtol=self.rtol,
                                                    max_iter=self.max_iter)
        info.solver, info.tolerance = "pcg-warm", self.rtol
        if not info.converged:
            raise UnsolvedSystemError(
                f"the Newton system was not solved to {self.rtol:.1e} by the warm-preconditioned CG (relative "
                f"residual {info.relative_residual:.3e} after {info.iterations} iterations); nothing was published",
                {"solver": {k: v for k, v in info.__dict__.items() if k != "notes"}})
        return x, info


@torch.no_grad()
def _value(model: nn.Module, task: Task, data, lam: float, batch_size: int) -> float:
    """L_{D\\U}(w) = mean loss + (lambda/2)||w||^2 over trainable parameters (float64 sum)."""
    from pipeline.training import objective

    return float(objective(model, task, data, lam, batch_size).double())


def _backtrack(model: nn.Module, task: Task, retain, lam: float, batch_size: int, block, direction: torch.Tensor,
               g: torch.Tensor, max_backtracks: int, anchor: torch.Tensor | None = None,
               w_ref: torch.Tensor | None = None, f_start: float | None = None) -> tuple[float, float]:
    """Apply w_P -= t d with the largest t in {1, 1/2, ...} satisfying Armijo's condition
    F(w - t d) <= F(w) - 1e-4 t g'd on F = L_{D\\U} - <anchor, w_P - w_ref> (g = grad F; d from a
    positive definite, possibly damped, system, so g'd > 0); a change below the objective's
    rounding counts as satisfied. Returns t (0: no step) and F at the weights left (``f_start``:
    F at the current weights when the caller knows it, saving a pass)."""
    params = dict(model.named_parameters())

    def value() -> float:
        f = _value(model, task, retain, lam, batch_size)
        if anchor is not None and w_ref is not None and bool(anchor.any()):
            w = block.gather({k: v.detach() for k, v in params.items()}).to("cpu", torch.float64)
            f -= float(anchor @ (w - w_ref))
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


@torch.no_grad()
def _restore(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, value in saved.items():
        params[name].copy_(value)
