"""The one preconditioned conjugate gradient of the project: every solver uses it.

Solves A x = b for a symmetric positive definite A given by its product (any tensor shape: the
inner product is the sum of the elementwise product), with an SPD preconditioner P^{-1}
(Hestenes & Stiefel 1952; Saad, "Iterative methods for sparse linear systems", Alg. 9.1):

    r = b - A x0,  z = P^{-1} r,  p = z
    repeat:  alpha = <r, z> / <p, A p>,  x += alpha p,  r -= alpha A p,
             z = P^{-1} r,  beta = <r_new, z_new> / <r, z>,  p = z + beta p

Stops when ||r|| <= rtol ||b|| (r is the recurrence's residual, b - A x in exact arithmetic), when
the residual vanishes exactly (converged; no division by a zero <r, z>), or after ``max_iter``
iterations. A direction with <p, A p> <= 0 (an indefinite operator, or rounded products) stops it
at once, never stepping along that direction: ``rayleigh`` then holds <p, A p> / <p, p>, an upper
bound on the smallest eigenvalue, for the caller to act on (damping). ``pairs``, when given,
receives every (p, A p, <p, A p>) for recycling (each p is rebound, never changed in place).
No preconditioner application is spent after the last update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from pipeline.progress import tick

__all__ = ["PCGResult", "Pair", "pcg"]

Pair = tuple[Tensor, Tensor, float]  # (p, A p, <p, A p>): one CG direction and its curvature


@dataclass
class PCGResult:
    x: Tensor
    iterations: int            # updates made (a direction refused for its curvature is not counted)
    relative_residual: float   # ||r|| / ||b||
    converged: bool
    products: int              # products with A (the refused direction's included)
    rayleigh: float | None = None  # <p, A p> / <p, p> of a non-positive direction that stopped it


def _dot(a: Tensor, b: Tensor) -> float:
    return float((a * b).sum())


def pcg(product: Callable[[Tensor], Tensor], b: Tensor, *, precondition: Callable[[Tensor], Tensor] | None = None,
        x0: Tensor | None = None, rtol: float = 0.0, max_iter: int = 100, pairs: list[Pair] | None = None,
        progress: str | None = None) -> PCGResult:
    """PCG on A x = b from ``x0`` (zero by default); see the module docstring. ``progress``:
    the name of the inner loop shown on the removal's progress bar (with the residual)."""
    apply = precondition or (lambda v: v)
    bnorm = float(torch.linalg.vector_norm(b))
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    products = 0
    if x0 is None:
        r = b.clone()
    else:
        r = b - product(x)
        products += 1
    rnorm = float(torch.linalg.vector_norm(r))
    scale = bnorm if bnorm > 0 else 1.0
    if rnorm == 0.0 or rnorm <= rtol * bnorm:
        return PCGResult(x, 0, rnorm / scale, True, products)
    z = apply(r)
    p = z
    rz = _dot(r, z)
    iterations = 0
    converged, rayleigh = False, None
    while iterations < max_iter:
        ap = product(p)
        products += 1
        curvature = _dot(p, ap)
        if not curvature > 0:
            rayleigh = curvature / max(_dot(p, p), 1e-300)
            break
        if pairs is not None:
            pairs.append((p, ap, curvature))
        alpha = rz / curvature
        x = x + alpha * p
        r = r - alpha * ap
        iterations += 1
        rnorm = float(torch.linalg.vector_norm(r))
        if progress is not None:
            tick(total=max_iter, phase=progress, unit="it", rel_residual=rnorm / scale)
        if rnorm == 0.0 or rnorm <= rtol * bnorm:
            converged = True
            break
        if iterations == max_iter:
            break
        z = apply(r)
        rz_new = _dot(r, z)
        if rz_new == 0.0:  # P^{-1} r = 0 for r != 0: the preconditioner is singular; stop here
            break
        p = z + (rz_new / rz) * p
        rz = rz_new
    if not math.isfinite(rnorm):
        converged = False
    return PCGResult(x, iterations, rnorm / scale, converged, products, rayleigh)
