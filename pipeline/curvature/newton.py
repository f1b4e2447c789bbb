"""Converged Newton on the softmax decision layer over fixed inputs, matrix-free, in closed form:
``newton_minimise`` minimises the objective F of ``pipeline.curvature.softmax_layer``.

H is the exact Hessian of F at the current theta (the same matrix as
``pipeline.curvature.linear_layer.linear_cross_entropy_hessian`` of R), applied without ever being
built: one product costs two passes over X~ (O(n_r K (d+1))). F is lambda-strongly convex, so
Newton's method with Armijo backtracking converges to its unique minimiser from any start;
each Newton system is solved inexactly by preconditioned conjugate gradients to the forcing
tolerance eta_k ||grad F|| with eta_k = min(forcing, sqrt(||grad F|| / ||grad F_0||))
(inexact Newton, Eisenstat & Walker; superlinear near the solution). Where the predicted decrease
is below F's rounding (64 eps |F|, eps of the passes' precision), Armijo cannot tell and the full
step is taken when it lowers ||grad F||. The iteration stops once
||grad F|| <= tol; it never claims convergence it did not reach (``converged`` is False).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipeline.curvature.pcg import Pair, pcg
from pipeline.curvature.softmax_layer import (
    Preconditioner, SoftmaxLayerObjective, gram_eigen, kronecker_preconditioner, recycled_preconditioner,
)

__all__ = ["NewtonResult", "newton_minimise"]


@dataclass
class NewtonResult:
    theta: Tensor
    converged: bool
    gradient_norm: float
    start_gradient_norm: float
    history: list[dict[str, float]] = field(default_factory=list)
    passes: float = 0.0
    pass_dtype: str = "float64"       # the precision of the last passes over X~
    float64_from: int | None = None   # the step from which float32 passes gave way to float64 (0: from the start)
    gradient_floor: float = 0.0       # the rounding floor of the last gradient (0: float64)



def newton_minimise(objective: SoftmaxLayerObjective, theta: Tensor, *, tol: float, max_steps: int,
                    preconditioner: str | Preconditioner = "kronecker", forcing: float = 0.5,
                    max_cg: int = 200, max_backtracks: int = 30, recycle: int = 0,
                    start: tuple[Tensor, Tensor] | None = None) -> NewtonResult:
    """Minimise F from ``theta`` by inexact Newton-PCG with Armijo backtracking (module
    docstring) until ||grad F|| <= tol or ``max_steps`` steps. ``recycle`` > 0: each system's
    preconditioner is updated by the last ``recycle`` CG pairs of the earlier systems
    (``recycled_preconditioner``). ``start`` = (logits, grad F) at ``theta`` when the caller
    holds them (a prepared state): the first two passes are then saved.

    Float32 passes (X~ given in float32) carry the iteration while they can resolve it. Their
    gradient is within its rounding floor phi (``gradient_floor``, recomputed at every point) of
    the exact one; it ends the iteration on its own only where phi <= tol / 4. Elsewhere a float32
    ||grad F|| <= tol is certified by float64 passes at the same point, and every later pass is
    float64 (``to_float64``: X~ cast in chunks, never copied) when that check fails, when
    ||grad F|| <= phi (float32 can resolve no further progress) or when a float32 line search
    finds no decrease."""
    if preconditioner not in ("kronecker", "none") and not callable(preconditioner):
        raise ValueError(f"preconditioner '{preconditioner}' is unknown; choose 'kronecker', 'none' or pass a callable")
    theta = theta.to(torch.float64).clone()

    def state(at: Tensor) -> tuple[Tensor, float, Tensor, Tensor, float]:
        z = objective.logits(at)
        p = objective.probabilities(z)
        f = objective.value(at, z, p)
        g = objective.gradient(at, p)
        return z, f, p, g, float(torch.linalg.vector_norm(g))

    def float64_state(at: Tensor) -> tuple[Tensor, float, Tensor, Tensor, float]:
        """Every later pass float64 (``to_float64``), and the state at ``at`` in it."""
        objective.to_float64()
        return state(at)

    if start is None:
        z, f, p, g, gnorm = state(theta)
    else:
        z, g = start[0].to(objective.pass_dtype), start[1].to(torch.float64)
        p = objective.probabilities(z)
        f, gnorm = objective.value(theta, z, p), float(torch.linalg.vector_norm(g))
    g0 = gnorm
    float64_from: int | None = 0 if objective.pass_dtype == torch.float64 else None
    gram = gram_eigen(objective) if preconditioner == "kronecker" else None
    history: list[dict[str, float]] = []
    pairs: list[Pair] = []
    step = 0
    while True:
        floor = objective.gradient_floor(p)
        if floor > 0 and ((gnorm <= tol and floor > tol / 4) or tol < gnorm <= floor):
            # float32 can neither certify nor resolve this: the same point in float64, float64 from here
            float64_from, floor = step + 1, 0.0
            z, f, p, g, gnorm = float64_state(theta)
        if gnorm <= tol or step == max_steps:
            break
        step += 1
        if preconditioner == "kronecker":
            assert gram is not None
            precondition = kronecker_preconditioner(objective, p, gram)
        elif preconditioner == "none":
            def precondition(v: Tensor) -> Tensor:
                return v
        else:
            precondition = preconditioner  # type: ignore[assignment]
        if recycle > 0:
            precondition = recycled_preconditioner(precondition, pairs[-recycle:])
        eta = min(forcing, math.sqrt(gnorm / g0) if g0 > 0 else forcing)
        solved = pcg(objective.curvature_at(p), g, precondition=precondition,
                     rtol=max(eta, tol / (2 * gnorm), objective.product_rtol), max_iter=max_cg,
                     pairs=pairs if recycle > 0 else None, progress="PCG iterations")
        # (a direction of non-positive curvature, which only rounded products can show, is never stepped along)
        direction, iterations, rel = solved.x, solved.products, solved.relative_residual
        pairs = pairs[-recycle:]
        slope = float((g * direction).sum())
        if slope <= 0:  # not a descent direction (rounded products): the preconditioned gradient is one
            direction = precondition(g)
            slope = float((g * direction).sum())
        dz = objective.logits(direction)
        # below F's rounding (in the passes' precision) the Armijo test cannot see a decrease:
        # there the full step is taken when it lowers ||grad F|| (the quantity the stopping test measures)
        unresolved = 0.5 * slope <= 64 * torch.finfo(objective.pass_dtype).eps * max(1.0, abs(f))
        t, g_try = 1.0, None
        for _ in range(max_backtracks + 1):
            z_try = z - t * dz
            p_try = objective.probabilities(z_try)
            f_try = objective.value(theta - t * direction, z_try, p_try)
            if f_try <= f - 1e-4 * t * slope:
                break
            if unresolved and t == 1.0:
                g_try = objective.gradient(theta - direction, p_try)
                if float(torch.linalg.vector_norm(g_try)) < gnorm:
                    break
                g_try = None
            t *= 0.5
        else:
            t = 0.0
        if t == 0.0:
            history.append({"step": step, "gradient_norm": gnorm, "step_length": 0.0, "cg_iterations": iterations,
                            "cg_relative_residual": rel})
            if objective.pass_dtype == torch.float64:
                break
            # no decrease float32 can see: on from the same point in float64
            float64_from = step + 1
            z, f, p, g, gnorm = float64_state(theta)
            continue
        theta = theta - t * direction
        z, f, p = z_try, f_try, p_try
        g = objective.gradient(theta, p) if g_try is None else g_try
        gnorm = float(torch.linalg.vector_norm(g))
        history.append({"step": step, "gradient_norm": gnorm, "step_length": t, "cg_iterations": iterations,
                        "cg_relative_residual": rel, "forcing": eta})
    return NewtonResult(theta, gnorm <= tol, gnorm, g0, history, objective.passes,
                        str(objective.pass_dtype).removeprefix("torch."), float64_from, floor)
