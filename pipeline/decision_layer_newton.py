"""Converged Newton on a softmax decision layer over fixed inputs, matrix-free, in closed form.

The removal's block is the last Linear layer (theta = [W, b], K x (d+1)) over cached inputs
x~ = (x, 1) of the retained set R = D \\ U (n_r samples), targets t(y) (one-hot, or label-smoothed
(1 - s) e_y + s/K: the targets enter linearly). The objective (anchored at r0, the start's
grad_P L_D; r0 = 0 for the plain retrained optimum):

    F(theta) = (1/n_r) sum_R [logsumexp(theta x~) - <t, theta x~>] + (lambda/2)||theta||^2 - <r0, theta - theta_0>
    grad F   = (1/n_r) (P - T)^T X~ + lambda theta - r0                 (P = softmax(X~ theta^T))
    H V      = (1/n_r) [P o (X~ V^T) - P o rowsum(P o X~ V^T)]^T X~ + lambda V

Options of the products: ``curvature_rows`` (a seeded subsample of R: a subsampled Hessian,
Byrd et al. 2011; the gradient and F stay exact, so the minimiser is the same, only the path
changes) and ``curvature_dtype`` (float32 products for a float32 model: CG is then asked for no
more than 100 eps_32 relative residual). Gradients, values and weights are float64 always.
``keep`` (a mask over the rows of ``x``) makes R the kept rows of a larger prepared X~ (D's, with
the forgotten rows masked out of every sum) so that no copy of R is made per removal; ``xt`` is
X~^T when the caller holds it already (contiguous).

H is the exact Hessian of F at the current theta (the same matrix as
``pipeline.linear_curvature.linear_cross_entropy_hessian`` of R), applied without ever being
built: one product costs two passes over X~ (O(n_r K (d+1))). F is lambda-strongly convex, so
Newton's method with Armijo backtracking converges to its unique minimiser from any start;
each Newton system is solved inexactly by preconditioned conjugate gradients to the forcing
tolerance eta_k ||grad F|| with eta_k = min(forcing, sqrt(||grad F|| / ||grad F_0||))
(inexact Newton, Eisenstat & Walker; superlinear near the solution). Where the predicted decrease
is below F's float64 rounding (64 eps |F|), Armijo cannot tell and the full step is taken when it
lowers ||grad F||. The iteration stops once
||grad F|| <= tol; it never claims convergence it did not reach (``converged`` is False).

Preconditioners (no preparation unless given):
  kronecker  (A (x) G + lambda I)^{-1}, A = (1/n_r) sum M(x) at the current weights (K x K,
             M = diag(p) - p p^T), G = X~^T X~ / n_r (once): the Kronecker-factored average of
             the exact blocks, inverted through the eigenvectors of A and G.
  dense      a given symmetric positive definite inverse (e.g. the warm H_P(D)^{-1} at the start).
Either may be recycled (``recycle``): the CG directions of the earlier Newton systems and their
Hessian products update it by limited-memory BFGS before each new system.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

__all__ = ["SoftmaxLayerObjective", "NewtonResult", "kronecker_preconditioner", "dense_preconditioner", "layer_ordered",
           "recycled_preconditioner", "newton_minimise"]


@dataclass
class SoftmaxLayerObjective:
    """F, grad F and H products of the anchored softmax layer objective (module docstring).
    ``x`` (n_r, d+1) with the ones column; ``targets`` (n_r, K); ``anchor`` and ``reference``
    (K, d+1) in the (class, input-with-bias) layout; float64 throughout."""

    x: Tensor
    targets: Tensor
    weight_decay: float
    anchor: Tensor
    reference: Tensor
    curvature_rows: Tensor | None = None
    curvature_dtype: torch.dtype = torch.float64
    keep: Tensor | None = None
    xt: Tensor | None = None

    def __post_init__(self) -> None:
        if self.x.dtype != torch.float64:
            self.x = self.x.to(torch.float64)
        self.targets = self.targets.to(torch.float64)
        self.mask = None if self.keep is None else self.keep.to(torch.float64)[:, None]
        self.n = int(self.x.shape[0]) if self.keep is None else int(self.keep.sum())
        if self.n == 0:
            raise ValueError("the retained set is empty: nothing to fit the decision layer on")
        if self.keep is not None and self.curvature_rows is not None and not bool(self.keep[self.curvature_rows].all()):
            raise ValueError("curvature_rows must be kept rows (rows of R)")
        self.passes = 0.0  # passes over X~ (each costs O(n_r K (d+1))); a subsample counts its share
        if self.curvature_rows is not None:
            self.x_curv = self.x[self.curvature_rows].to(self.curvature_dtype)
        elif self.keep is not None:
            self.x_curv = self.x[self.keep].to(self.curvature_dtype)
        else:
            self.x_curv = self.x.to(self.curvature_dtype)
        self.curv_index = self.curvature_rows if self.curvature_rows is not None else \
            (None if self.keep is None else torch.nonzero(self.keep).squeeze(1))
        if self.xt is None:  # X~^T A as a plain product: ~30% faster than A^T X~ in float64
            self.xt = self.x.T.contiguous()
        # relative accuracy a CG solve can ask of these products
        self.product_rtol = 0.0 if self.curvature_dtype == torch.float64 \
            else 100 * torch.finfo(self.curvature_dtype).eps

    def logits(self, theta: Tensor) -> Tensor:
        self.passes += 1
        return self.x @ theta.T

    def value(self, theta: Tensor, z: Tensor) -> float:
        """F(theta) from the logits z = X~ theta^T."""
        return self.evaluate(theta, z)[0]

    def evaluate(self, theta: Tensor, z: Tensor) -> tuple[float, Tensor]:
        """(F(theta), logsumexp of each row of z): P = exp(z - lse) then costs one exp (a third
        of a row-wise softmax over K columns)."""
        lse = torch.logsumexp(z, dim=1)
        per_row = lse - (self.targets * z).sum(dim=1)
        loss = (per_row if self.mask is None else per_row * self.mask[:, 0]).sum() / self.n
        return float(loss + 0.5 * self.weight_decay * (theta * theta).sum()
                     - (self.anchor * (theta - self.reference)).sum()), lse

    def gradient(self, theta: Tensor, p: Tensor) -> Tensor:
        """grad F from the probabilities P at theta."""
        self.passes += 1
        residual = p - self.targets if self.mask is None else (p - self.targets) * self.mask
        return (self.xt @ residual).T / self.n + self.weight_decay * theta - self.anchor

    def hessian_product(self, p: Tensor, v: Tensor) -> Tensor:
        """H V at the weights whose probabilities are ``p``; V in the (K, d+1) layout. With
        ``curvature_rows`` the loss part is the mean over those rows only (a subsampled Hessian:
        the gradient and the objective stay exact, so the minimiser is the same)."""
        x = self.x_curv
        if self.curv_index is not None:
            p = p[self.curv_index]
        p = p.to(x.dtype)
        self.passes += 2 * x.shape[0] / self.n
        dz = x @ v.to(x.dtype).T
        mz = p * dz - p * (p * dz).sum(dim=1, keepdim=True)
        return (mz.T @ x).to(torch.float64) / x.shape[0] + self.weight_decay * v


Preconditioner = Callable[[Tensor], Tensor]


def kronecker_preconditioner(objective: SoftmaxLayerObjective, p: Tensor,
                             gram: tuple[Tensor, Tensor]) -> Preconditioner:
    """V -> (A (x) G + lambda I)^{-1} V with A = mean_R M(x) at probabilities ``p`` and
    ``gram`` = the eigen-decomposition (values, vectors) of G = X~^T X~ / n_r."""
    if objective.keep is not None:
        p = p[objective.keep]
    a = torch.diag(p.mean(dim=0)) - p.T @ p / objective.n
    s_a, u_a = torch.linalg.eigh(a)
    s_g, u_g = gram
    scale = 1.0 / (s_a.clamp_min(0)[:, None] * s_g.clamp_min(0)[None, :] + objective.weight_decay)

    def apply(v: Tensor) -> Tensor:
        return u_a @ ((u_a.T @ v @ u_g) * scale) @ u_g.T

    return apply


def gram_eigen(objective: SoftmaxLayerObjective) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of G = X~^T X~ / n_r (one pass over X~)."""
    objective.passes += 1
    x = objective.x_curv.to(torch.float64)
    return torch.linalg.eigh(x.T @ x / x.shape[0])


def dense_preconditioner(inverse: Tensor, shape: tuple[int, int]) -> Preconditioner:
    """V -> inverse @ V for a dense symmetric positive definite inverse already in the
    (class, input-with-bias) flat layout of V (``layer_ordered``), in the inverse's own precision:
    float32 for float32 products (the solves ask no more than 100 eps_32 of them), which halves
    the bytes every application reads."""
    dtype = inverse.dtype

    def apply(v: Tensor) -> Tensor:
        return (inverse @ v.reshape(-1).to(dtype)).to(torch.float64).reshape(shape)

    return apply


def layer_ordered(inverse: Tensor, order: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """A block-ordered matrix permuted into the layer's (class, input-with-bias) flat layout
    (``order[i]`` = the layout index of block entry i), symmetrised, in ``dtype``."""
    out = torch.empty_like(inverse)
    out[order[:, None], order[None, :]] = inverse
    out = 0.5 * (out + out.T)
    return out.to(dtype).contiguous()


@dataclass
class NewtonResult:
    theta: Tensor
    converged: bool
    gradient_norm: float
    start_gradient_norm: float
    history: list[dict[str, float]] = field(default_factory=list)
    passes: float = 0.0


Pair = tuple[Tensor, Tensor, float]  # (s, H s, s^T H s): one CG direction and its curvature


def _pcg(product: Callable[[Tensor], Tensor], b: Tensor, precondition: Preconditioner, rtol: float,
         max_iter: int, pairs: list[Pair] | None = None) -> tuple[Tensor, int, float]:
    """Preconditioned CG on H x = b to ||H x - b|| <= rtol ||b|| (or max_iter); (x, iterations,
    relative residual). H and the preconditioner are symmetric positive definite here. Each
    direction d and its product H d are appended to ``pairs`` when given."""
    x = torch.zeros_like(b)
    r = b.clone()
    bnorm = float(torch.linalg.vector_norm(b)) or 1.0
    z = precondition(r)
    d = z.clone()
    rz = float((r * z).sum())
    it = 0
    rel = 1.0
    for it in range(1, max_iter + 1):
        hd = product(d)
        dhd = float((d * hd).sum())
        if pairs is not None:
            pairs.append((d, hd, dhd))  # d is rebound, never changed in place
        alpha = rz / dhd
        x += alpha * d
        r -= alpha * hd
        rel = float(torch.linalg.vector_norm(r)) / bnorm
        if rel <= rtol:
            break
        z = precondition(r)
        rz_new = float((r * z).sum())
        d = z + (rz_new / rz) * d
        rz = rz_new
    return x, it, rel


def recycled_preconditioner(base: Preconditioner, pairs: list[Pair]) -> Preconditioner:
    """The limited-memory BFGS update of ``base`` (an SPD inverse) by the pairs (s_i, y_i = H_i s_i)
    that earlier CG solves produced (Morales & Nocedal, SIAM J. Optim. 2000, automatic
    preconditioning): the two-loop recursion

        q <- v;  for i newest..oldest: a_i = s_i^T q / s_i^T y_i,  q <- q - a_i y_i
        r <- base(q); for i oldest..newest: b_i = y_i^T r / s_i^T y_i, r <- r + (a_i - b_i) s_i

    SPD whenever every s_i^T y_i > 0 (H_i SPD), so the next CG stays a CG. It carries into the
    next Newton system the directions where base^-1 and the Hessian disagreed (for a forgotten
    class: its rows' curvature, gone from D \\ U but still in H_P(D))."""
    if not pairs:
        return base

    def apply(v: Tensor) -> Tensor:
        q = v.clone()
        alphas: list[float] = []
        for s, y, sy in reversed(pairs):
            a = float((s * q).sum()) / sy
            alphas.append(a)
            q -= a * y
        r = base(q)
        for (s, y, sy), a in zip(pairs, reversed(alphas)):
            r += (a - float((y * r).sum()) / sy) * s
        return r

    return apply


def newton_minimise(objective: SoftmaxLayerObjective, theta: Tensor, *, tol: float, max_steps: int,
                    preconditioner: str | Preconditioner = "kronecker", forcing: float = 0.5,
                    max_cg: int = 200, max_backtracks: int = 30, recycle: int = 0) -> NewtonResult:
    """Minimise F from ``theta`` by inexact Newton-PCG with Armijo backtracking (module
    docstring) until ||grad F|| <= tol or ``max_steps`` steps. ``recycle`` > 0: each system's
    preconditioner is updated by the last ``recycle`` CG pairs of the earlier systems
    (``recycled_preconditioner``)."""
    if preconditioner not in ("kronecker", "none") and not callable(preconditioner):
        raise ValueError(f"preconditioner '{preconditioner}' is unknown; choose 'kronecker', 'none' or pass a callable")
    theta = theta.to(torch.float64).clone()
    z = objective.logits(theta)
    f, lse = objective.evaluate(theta, z)
    p = torch.exp(z - lse[:, None])  # softmax(z)
    g = objective.gradient(theta, p)
    g0 = gnorm = float(torch.linalg.vector_norm(g))
    gram = gram_eigen(objective) if preconditioner == "kronecker" else None
    history: list[dict[str, float]] = []
    pairs: list[Pair] = []
    for step in range(1, max_steps + 1):
        if gnorm <= tol:
            break
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
        p_now = p
        direction, iterations, rel = _pcg(lambda v: objective.hessian_product(p_now, v), g, precondition,
                                          max(eta, tol / (2 * gnorm), objective.product_rtol), max_cg,
                                          pairs if recycle > 0 else None)
        pairs = pairs[-recycle:]
        slope = float((g * direction).sum())
        dz = objective.logits(direction)
        # below F's rounding the Armijo test cannot see a decrease: there the full step is taken
        # when it lowers ||grad F|| (the quantity the stopping test measures)
        unresolved = 0.5 * slope <= 64 * torch.finfo(torch.float64).eps * max(1.0, abs(f))
        t, g_try = 1.0, None
        for _ in range(max_backtracks + 1):
            z_try = z - t * dz
            f_try, lse_try = objective.evaluate(theta - t * direction, z_try)
            if f_try <= f - 1e-4 * t * slope:
                break
            if unresolved and t == 1.0:
                g_try = objective.gradient(theta - direction, torch.exp(z_try - lse_try[:, None]))
                if float(torch.linalg.vector_norm(g_try)) < gnorm:
                    break
                g_try = None
            t *= 0.5
        else:
            t = 0.0
        if t == 0.0:
            history.append({"step": step, "gradient_norm": gnorm, "step_length": 0.0, "cg_iterations": iterations,
                            "cg_relative_residual": rel})
            break
        theta = theta - t * direction
        z, f = z_try, f_try
        p = torch.exp(z - lse_try[:, None])
        g = objective.gradient(theta, p) if g_try is None else g_try
        gnorm = float(torch.linalg.vector_norm(g))
        history.append({"step": step, "gradient_norm": gnorm, "step_length": t, "cg_iterations": iterations,
                        "cg_relative_residual": rel, "forcing": eta})
    return NewtonResult(theta, gnorm <= tol, gnorm, g0, history, objective.passes)
