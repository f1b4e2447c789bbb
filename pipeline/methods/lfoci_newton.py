"""L-FOCI blockwise Newton removal (Mehta, Pal, Singh, Ravi, CVPR 2022), with the Newton
update of Sekhari et al. (NeurIPS 2021) for m removed samples and its Gaussian noise.

With f(w, z) = loss(w, z) + (lambda/2)||w||^2, a model at the optimum of (1/n) sum_D f, the
forget set U (m samples) and a parameter block P:
    H'   = (n H_P(D) - sum_{z in U} H_P(z)) / (n - m)          (H_P(D): mean Hessian on D)
    w'_P = w_P + (1/(n - m)) (H' + damping I)^{-1} sum_{z in U} grad_P f(w, z)  + N(0, sigma^2 I)
Parameters outside P are untouched. With damping 0 and P = all parameters this is exactly one
Newton step on the retained objective (1/(n-m)) sum_{D \\ U} f from w.

Defects of the published code avoided here: the per-sample Hessian is the real one (theirs
was always zero), gradients are fresh tensors (theirs aliased .grad), the Hessian block comes
from exact Hessian-vector products (theirs was a rank-one outer product), parameters are keyed
by qualified name (theirs by module repr), the batch factors use m and n - m (theirs used
m = 1), and nothing is skipped silently.
"""
from __future__ import annotations

import math
import time
from typing import Literal

import torch
from pydantic import Field, field_validator

from pipeline.curvature import (
    BlockHessian, Combination, block_gradient, conjugate_gradient, solve_dense,
)
from pipeline.methods.base import (
    MethodSettings, RandomStream, RemovalMethod, RemovalOutcome, RemovalProblem, register_method,
)
from pipeline.methods.block_choice import CHOOSERS
from pipeline.probe import eval_mode_restored
from pipeline.privacy.noise import (
    DEFAULT_HESSIAN_LIPSCHITZ, DEFAULT_LIPSCHITZ_LOSS, calibrate, secret_gaussian_noise,
)


class LFociNewtonSettings(MethodSettings):
    selection: Literal["lfoci", "all", "parameters"] = "lfoci"
    parameters: list[str] = Field(default_factory=list, description="for selection: parameters")
    perturbations: int = Field(1000, gt=1, description="m_p perturbed passes of the forget batch")
    perturb_sigma: float = Field(0.1, ge=0, description="std of input noise (dense inputs)")
    token_replacements: int = Field(2, ge=1, description="tokens replaced per sequence (text)")
    pass_size: int = Field(32, gt=0, description="perturbations per forward pass")
    max_slices: int | None = Field(None, gt=0, description="cap on L-FOCI picks")
    curvature_samples: int | None = Field(
        None, gt=0, description="estimate H_P(D) on a seeded subsample of this many training samples")
    dense_max: int = Field(4096, gt=0, description="largest block solved densely (Cholesky); CG above")
    damping: float = Field(0.0, ge=0)
    cg_rtol: float = Field(1e-10, gt=0)
    cg_max_iter: int | None = Field(None, gt=0)
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


@register_method
class LFociNewton(RemovalMethod):
    name = "lfoci-newton"
    Settings = LFociNewtonSettings

    def run(self, problem: RemovalProblem, settings: LFociNewtonSettings) -> RemovalOutcome:  # type: ignore[override]
        n, m, lam = problem.n, problem.m, problem.weight_decay
        noise_cal = calibrate(
            epsilon=settings.epsilon, delta=settings.delta, m=m, n=n,
            strong_convexity=settings.strong_convexity or lam,
            lipschitz_loss=settings.lipschitz_loss, hessian_lipschitz=settings.hessian_lipschitz,
        )
        with eval_mode_restored(problem.model):
            return self._run(problem, settings, noise_cal, n, m, lam)

    def _run(self, problem, settings, noise_cal, n, m, lam) -> RemovalOutcome:
        timings: dict[str, float] = {}
        model, task, bs = problem.model, problem.task, problem.batch_size
        block, choice = CHOOSERS[settings.selection](problem, settings)
        timings.update(choice.pop("timings"))

        t = time.perf_counter()
        forget, retain = problem.forget, problem.retain
        g_forget = block_gradient(model, task, forget, block, lam, reduction="sum", batch_size=bs)
        g_retain_before = block_gradient(model, task, retain, block, lam, reduction="mean", batch_size=bs)
        timings["gradients"] = time.perf_counter() - t

        t = time.perf_counter()
        curv_data, curv_note = problem.train, "all training samples"
        if settings.curvature_samples is not None and settings.curvature_samples < n:
            gen = problem.generator(RandomStream.CURVATURE_SUBSAMPLE)
            pick = torch.randperm(n, generator=gen)[: settings.curvature_samples].sort().values
            curv_data = problem.train.take(pick)
            curv_note = f"seeded subsample of {settings.curvature_samples} training samples (stream 2)"
        factory = problem.curvature_factory or BlockHessian
        h_train = factory(model, task, curv_data, block, lam, reduction="mean", batch_size=bs)
        h_forget = BlockHessian(model, task, forget, block, lam, reduction="sum", batch_size=bs)
        h_new = Combination([(n / (n - m), h_train), (-1.0 / (n - m), h_forget)], damping=settings.damping)
        if block.numel <= settings.dense_max:
            direction, info = solve_dense(h_new.to_dense(), g_forget)
        else:
            direction, info = conjugate_gradient(h_new, g_forget, rtol=settings.cg_rtol, max_iter=settings.cg_max_iter)
        timings["curvature_and_solve"] = time.perf_counter() - t

        step = direction / (n - m)
        noise = secret_gaussian_noise(block.numel, noise_cal.sigma)
        block.add_to_model(model, step + noise)
        params = dict(model.named_parameters())
        new_parameters = {part.name: params[part.name].detach().clone() for part in block.parts}

        t = time.perf_counter()
        g_retain_after = block_gradient(model, task, retain, block, lam, reduction="mean", batch_size=bs)
        timings["verify"] = time.perf_counter() - t
        record = {
            "block": {"numel": block.numel, "parts": block.describe() if block.numel <= 100_000 else len(block.parts)},
            "selection": {"strategy": settings.selection, **choice},
            "curvature": {"data": curv_note, "solver": info.__dict__, "damping": settings.damping},
            "noise": noise_cal.as_record(),
            "epsilon_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.epsilon,
            "delta_spent": None if math.isinf(noise_cal.epsilon) else noise_cal.delta,
            "gradient_norms": {
                "forget_sum_block": _norm(g_forget),
                "retain_mean_block_before": _norm(g_retain_before),
                "retain_mean_block_after": _norm(g_retain_after),
            },
            "step_norm": _norm(step),
            "noise_norm": _norm(noise),
            "timings": timings,
        }
        return RemovalOutcome(new_parameters, record)
