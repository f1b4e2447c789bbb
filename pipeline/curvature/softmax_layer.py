"""The anchored softmax decision-layer objective over fixed inputs, its exact Hessian products in
closed form, and their preconditioners (the maths of ``pipeline.curvature.newton``).

The block is the last Linear layer (theta = [W, b], K x (d+1)) over cached inputs x~ = (x, 1) of
the retained set R = D \\ U (n_r samples), targets t(y) (one-hot, or label-smoothed
(1 - s) e_y + s/K: the targets enter linearly). The objective, anchored at r0 (the removal's
target term; r0 = 0 for the plain retrained optimum):

    F(theta) = (1/n_r) sum_R [logsumexp(theta x~) - <t, theta x~>] + (lambda/2)||theta||^2 - <r0, theta - theta_0>
               + (mu/2)||theta - theta_0||^2
    grad F   = (1/n_r) (P - T)^T X~ + lambda theta - r0 + mu (theta - theta_0)     (P = softmax(X~ theta^T))
    H V      = (1/n_r) [P o (X~ V^T) - P o rowsum(P o X~ V^T)]^T X~ + (lambda + mu) V
(mu = ``proximal``: the training-budget damping of the ``retrain`` target's one-window form,
``pipeline.target``; 0 for the minimiser.)

Options of the products: ``curvature_rows`` (a seeded subsample of R: a subsampled Hessian,
Byrd et al. 2011; the gradient and F stay exact, so the minimiser is the same, only the path
changes) and ``curvature_dtype`` (float32 products for a float32 model: CG is then asked for no
more than 100 eps_32 relative residual; bfloat16: the curvature rows stored in bfloat16, the two
matrix products in bfloat16 (float32 accumulation, results rounded to bfloat16) and everything
between them in float32, a third of float32's time where the CPU multiplies bfloat16 natively; the
products are then within about 3e-3 relative of the exact ones (measured on Fashion-MNIST's head;
they are also not exactly symmetric) and CG is asked for no more than 2 eps_bf16 = 1.6e-2. The curvature only steers the direction of an inexact Newton step,
whose forcing asks no more of it; F and its gradient, hence the minimiser and the stopping test,
never use these products). The passes over X~ (logits, probabilities, residuals,
gradients) run in X~'s own precision: float32 inputs (a float32 model's features, exact in float32)
give float32 passes, with F summed and the gradient returned in float64; weights are float64 always.
A float32 gradient is trusted only to its rounding floor (``gradient_floor``, an estimate: the
errors measured on Fashion-MNIST's head were 0.10-0.16 of it); where the tolerance asks for more,
float64 passes certify or finish the iteration (``pipeline.curvature.newton.newton_minimise``).
``keep`` (a mask over the rows of ``x``) makes R the kept rows of a larger prepared X~ (D's, with
the forgotten rows masked out of every sum) so that the passes need no copy of R per removal (the
curvature rows, a subsample or else R, are copied once with their transpose); ``xt`` is X~^T when
the caller holds it already (contiguous).

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
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from pipeline.curvature.pcg import Pair

__all__ = ["Preconditioner", "SoftmaxLayerObjective", "dense_preconditioner", "gram_eigen", "kronecker_preconditioner",
           "layer_ordered", "recycled_preconditioner", "working_bytes"]


@dataclass
class SoftmaxLayerObjective:
    """F, grad F and H products of the anchored softmax layer objective (module docstring).
    ``x`` (n_r, d+1) with the ones column, float32 or float64 (the passes' precision, below);
    ``targets`` (n_r, K); ``anchor`` and ``reference`` (K, d+1) in the (class, input-with-bias)
    layout, float64. Logits, probabilities and residuals are held class-major, (K, n_r): every
    pass is then a plain (K x (d+1)) by ((d+1) x n_r) product or its reverse, the fastest layout
    for float32 (2-3x the row-major float64 passes on one core); softmax over K columns of a
    class-major (K, n_r) float32 array costs a twentieth of the row-major one."""

    x: Tensor
    targets: Tensor
    weight_decay: float
    anchor: Tensor
    reference: Tensor
    curvature_rows: Tensor | None = None
    curvature_dtype: torch.dtype = torch.float64
    keep: Tensor | None = None
    xt: Tensor | None = None
    x_norm: float | None = None  # ||X~||_F over every row of x, when the caller holds it
    proximal: float = 0.0        # mu of the term (mu/2)||theta - reference||^2

    @property
    def ridge(self) -> float:
        """lambda + mu: the identity part of the Hessian."""
        return self.weight_decay + self.proximal

    def __post_init__(self) -> None:
        if self.xt is not None and self.xt.dtype != self.x.dtype:
            raise ValueError(f"xt is {self.xt.dtype} but x is {self.x.dtype}: give X~ and X~^T in one precision")
        if self.x.dtype not in (torch.float32, torch.float64):
            self.x = self.x.to(torch.float64)
            self.xt = None if self.xt is None else self.xt.to(torch.float64)
        self.targets_t = self.targets.to(self.x.dtype).T.contiguous()
        self.mask = None if self.keep is None else self.keep.to(self.x.dtype)
        self.n = int(self.x.shape[0]) if self.keep is None else int(self.keep.sum())
        if self.n == 0:
            raise ValueError("the retained set is empty: nothing to fit the decision layer on")
        if self.keep is not None and self.curvature_rows is not None and not bool(self.keep[self.curvature_rows].all()):
            raise ValueError("curvature_rows must be kept rows (rows of R)")
        self.passes = 0.0  # passes over X~ (each costs O(n_r K (d+1))); a subsample counts its share
        if self.xt is None:
            self.xt = self.x.T.contiguous()
        # the curvature rows and their transpose in the products' storage precision: copies, except
        # where they are all of X~ in its own precision
        if self.curvature_rows is not None:
            self.x_curv = self.x[self.curvature_rows].to(self.curvature_dtype)
        elif self.keep is not None:
            self.x_curv = self.x[self.keep].to(self.curvature_dtype)
        else:
            self.x_curv = self.x.to(self.curvature_dtype)
        self.x_curv_t = self.xt if self.x_curv is self.x else self.x_curv.T.contiguous()
        self.curv_index = self.curvature_rows if self.curvature_rows is not None else \
            (None if self.keep is None else torch.nonzero(self.keep).squeeze(1))
        # ||X~||_F / n_r for the rounding floor of float32 gradients (gradient_floor), over every row of x
        # (an upper bound, without a copy of the kept rows)
        self.precise = self.x.dtype == torch.float64
        if self.precise:
            self.x_scale = 0.0
        else:
            norm = self.x_norm if self.x_norm is not None else math.sqrt(sum(
                float(torch.linalg.vector_norm(self.x[i:i + self.PRECISE_CHUNK], dtype=torch.float64)) ** 2
                for i in self._spans()))  # (a float64 cast of one chunk at a time, not of all of X~)
            self.x_scale = norm / self.n
        # relative accuracy a CG solve can ask of these products
        self.product_rtol = {torch.float64: 0.0, torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}.get(
            self.curvature_dtype, 100 * torch.finfo(self.curvature_dtype).eps)

    PRECISE_CHUNK = 8192  # rows of float32 X~ cast to float64 at a time by the float64 passes

    @property
    def pass_dtype(self) -> torch.dtype:
        return torch.float64 if self.precise else self.x.dtype

    def to_float64(self) -> None:
        """Make every later pass float64. Float32 X~ stays as it is (its values are exact in
        float64): each pass casts it PRECISE_CHUNK rows at a time, so no float64 copy of X~ is made."""
        if not self.precise:
            self.precise, self.x_scale = True, 0.0
            self.targets_t = self.targets.to(torch.float64).T.contiguous()  # (not the float32 copy: smoothed targets round)
            self.mask = None if self.mask is None else self.mask.to(torch.float64)

    def _spans(self) -> range:
        return range(0, int(self.x.shape[0]), self.PRECISE_CHUNK)

    def logits(self, theta: Tensor) -> Tensor:
        """Z^T = theta X~^T, (K, n_r), in the passes' precision."""
        self.passes += 1
        if self.precise and self.x.dtype != torch.float64:
            theta = theta.to(torch.float64)
            return torch.cat([theta @ self.xt[:, i:i + self.PRECISE_CHUNK].to(torch.float64) for i in self._spans()], 1)
        return theta.to(self.x.dtype) @ self.xt

    def value(self, theta: Tensor, z: Tensor, p: Tensor | None = None) -> float:
        """F(theta) from the logits z = theta X~^T: per sample in the passes' precision, summed in float64.
        With the probabilities p = softmax(z) at hand, logsumexp(z) = max_k z_k - log max_k p_k (the
        largest probability is 1 / sum exp(z - max z), never below 1/K: no underflow), a third of
        the cost of a separate logsumexp over a class-major array."""
        lse = torch.logsumexp(z, dim=0) if p is None else z.amax(dim=0) - torch.log(p.amax(dim=0))
        per_row = lse - (self.targets_t * z).sum(dim=0)
        loss = (per_row if self.mask is None else per_row * self.mask).sum(dtype=torch.float64) / self.n
        return float(loss + 0.5 * self.weight_decay * (theta * theta).sum()
                     - (self.anchor * (theta - self.reference)).sum()
                     + 0.5 * self.proximal * ((theta - self.reference) ** 2).sum())

    @staticmethod
    def probabilities(z: Tensor) -> Tensor:
        """P^T = softmax of each sample's logits (class-major), from z - max: in float32 the largest
        probability then carries no rounding of a large logsumexp (exp(z - lse) would: eps_32 |lse|)."""
        return torch.softmax(z, dim=0)

    def residual(self, p: Tensor) -> Tensor:
        """(P - T) o mask, class-major (K, n_r)."""
        residual = p - self.targets_t
        return residual if self.mask is None else residual * self.mask

    def gradient(self, theta: Tensor, p: Tensor) -> Tensor:
        """grad F from the class-major probabilities P^T at theta (computed in the passes' precision)."""
        self.passes += 1
        residual = self.residual(p)
        if self.precise and self.x.dtype != torch.float64:
            total = sum(residual[:, i:i + self.PRECISE_CHUNK] @ self.x[i:i + self.PRECISE_CHUNK].to(torch.float64)
                        for i in self._spans())
        else:
            total = (residual @ self.x).to(torch.float64)
        return total / self.n + self.weight_decay * theta - self.anchor + self.proximal * (theta - self.reference)

    def gradient_floor(self, p: Tensor) -> float:
        """An estimate of the rounding error of ``gradient`` in float32 passes: eps_32 ||P - T||_F
        ||X~||_F / n_r, the Frobenius bound of the last product without the growth in n_r of the
        worst case and without the logits' and probabilities' own rounding (the errors measured on
        Fashion-MNIST's head were 0.10-0.16 of it); 0 for float64 passes."""
        if self.pass_dtype == torch.float64:
            return 0.0
        return torch.finfo(self.x.dtype).eps * float(torch.linalg.vector_norm(self.residual(p), dtype=torch.float64)) \
            * self.x_scale

    def curvature_at(self, p: Tensor) -> Callable[[Tensor], Tensor]:
        """V -> H V at the weights whose class-major probabilities are ``p`` (the subsample's rows
        gathered and cast once per Newton system); V in the (K, d+1) layout. With
        ``curvature_rows`` the loss part is the mean over those rows only (a subsampled Hessian:
        the gradient and the objective stay exact, so the minimiser is the same)."""
        x, xt = self.x_curv, self.x_curv_t
        work = torch.float32 if x.dtype == torch.bfloat16 else x.dtype  # bfloat16 rows: float32 between the products
        pc = (p if self.curv_index is None else p[:, self.curv_index]).to(work).contiguous()
        share, rows = 2 * x.shape[0] / self.n, x.shape[0]

        def product(v: Tensor) -> Tensor:
            self.passes += share
            pdz = pc * (v.to(x.dtype) @ xt).to(work)
            mz = torch.addcmul(pdz, pc, pdz.sum(dim=0, keepdim=True), value=-1.0)
            return (mz.to(x.dtype) @ x).to(torch.float64) / rows + self.ridge * v

        return product

    def hessian_product(self, p: Tensor, v: Tensor) -> Tensor:
        """H V at the weights whose class-major probabilities are ``p`` (``curvature_at``)."""
        return self.curvature_at(p)(v)


def working_bytes(n: int, d: int, k: int, *, input_itemsize: int, curvature_itemsize: int, work_itemsize: int,
                  copies_inputs: bool, copies_curvature_rows: bool = True, preconditioner_bytes: float = 0.0,
                  kronecker: bool = False, recycle: int = 0, max_cg: int = 200) -> tuple[float, float]:
    """(fixed, per curvature row) bytes ``newton_minimise`` and its objective allocate for a
    layer of K classes over d inputs and n rows of X~ (the prepared X~ is resident, not counted).

    Fixed: the targets, the mask and up to ten class-major (K, n) arrays (logits, probabilities,
    residuals, a line search's trial) in float64; the float64 cast of one chunk of X~ and of its
    transpose; ``preconditioner_bytes`` (a dense inverse made for this removal); the CG pairs
    (direction and product, float64 (K, d+1) each) of up to ``recycle`` earlier systems plus the
    ``max_cg`` of the current one, and a few CG vectors; X~ and X~^T of R when ``copies_inputs``.
    Per curvature row: the row and its transpose in the products' storage when
    ``copies_curvature_rows`` (not when the rows are all of X~ in its own precision), its float64
    cast when ``kronecker`` (the Gram matrix), and four (K,) columns of a product in the work
    precision (probabilities, X V^T and its cast, P o X V^T, its correction)."""
    width = d + 1
    fixed = 12.0 * k * n * 8 + n * 8 + 2.0 * SoftmaxLayerObjective.PRECISE_CHUNK * width * 8
    fixed += float(preconditioner_bytes) + 16.0 * k * width * (max(0, recycle) + max_cg + 4)
    if copies_inputs:
        fixed += 2.0 * n * width * input_itemsize
    per_row = 4.0 * k * work_itemsize + (2.0 * width * curvature_itemsize if copies_curvature_rows else 0.0)
    if kronecker:
        per_row += width * 8.0
    return fixed, per_row


Preconditioner = Callable[[Tensor], Tensor]


def kronecker_preconditioner(objective: SoftmaxLayerObjective, p: Tensor,
                             gram: tuple[Tensor, Tensor]) -> Preconditioner:
    """V -> (A (x) G + lambda I)^{-1} V with A = mean_R M(x) at the class-major probabilities
    ``p`` and ``gram`` = the eigen-decomposition (values, vectors) of G = X~^T X~ / n_r."""
    p = p.to(torch.float64) if objective.keep is None else p[:, objective.keep].to(torch.float64)
    a = torch.diag(p.mean(dim=1)) - p @ p.T / objective.n
    s_a, u_a = torch.linalg.eigh(a)
    s_g, u_g = gram
    scale = 1.0 / (s_a.clamp_min(0)[:, None] * s_g.clamp_min(0)[None, :] + objective.ridge)

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
