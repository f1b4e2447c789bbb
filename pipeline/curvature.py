"""Curvature restricted to a parameter block, as linear operators (curvlinops-style).

For a block P of coordinates (see ``param_block``) and a set of samples S, with the per-sample
objective f(w, z) = loss(w, z) + (lambda/2)||w||^2:
    gradient  g_P(S) = sum_{z in S} grad_P f(w, z)   = sum_z grad_P loss(w, z) + |S| lambda w_P
    Hessian   H_P(S) = sum_{z in S} hess_PP f(w, z)  = sum_z hess_PP loss(w, z) + |S| lambda I
(``reduction="mean"`` divides both by |S|). Hessian-vector products are exact: forward-over-
reverse autodiff (``torch.func.jvp`` of ``torch.func.grad``) on the model's functional form,
never finite differences. Products run where the model lives (CPU or GPU); vectors, dense
blocks and solves stay on the CPU in float64, so big blocks never sit on the GPU.

Memory: every pass sizes its chunks (samples per batch, tangent columns per vmapped pass) from
a memory budget (``pipeline.memory``; the one given, else the scoped / ``auto`` one):
``batch_size`` and ``columns_per_pass`` are upper bounds that the budget may lower, and a
budget that cannot hold one sample or one column raises ``MemoryBudgetError`` before the pass
allocates anything. Chunking only splits sums: results agree up to float rounding.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, vmap

from pipeline import memory
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.progress import tick
from pipeline.tasks import Batch, Task, output_logits


class NonFiniteGradientError(FloatingPointError):
    """A gradient or curvature product contained NaN or infinity."""


class RemovalNotServed(ValueError):
    """A local (Newton) step cannot serve this removal request: nothing was published, the
    model is as it was, and the request should go to retraining. ``reason`` says why in one
    sentence; ``diagnostics`` holds the numbers behind it (strict-JSON-ready)."""

    def __init__(self, reason: str, diagnostics: dict | None = None):
        super().__init__(reason)
        self.reason = reason
        self.diagnostics = dict(diagnostics or {})


class UnsolvedSystemError(RemovalNotServed):
    """The Newton system (H' + damping I) x = g was not solved to the stated tolerance."""


class LinearOperator(ABC):
    """A symmetric linear map on R^dim; vectors are 1-D CPU tensors (float64 by default)."""

    dim: int

    @abstractmethod
    def matvec(self, v: Tensor) -> Tensor: ...

    def matmat(self, columns: Tensor) -> Tensor:
        return torch.stack([self.matvec(c) for c in columns.T], dim=1)

    def to_dense(self, chunk: int = 256) -> Tensor:
        """Materialise on the CPU in float64, ``chunk`` basis vectors at a time; symmetrised.
        The dense block (and its symmetrised copy) must fit the memory budget; the products
        that fill it get what is left."""
        dense = 8 * self.dim * self.dim
        budget = memory.available_in(getattr(self, "budget", None) or memory.current_budget())
        if 2 * dense + 2 * 8 * self.dim >= budget.bytes:
            raise memory.MemoryBudgetError(
                f"{budget.named()} cannot hold the dense {self.dim} x {self.dim} "
                f"Hessian block (needs ~{memory.format_bytes(2 * dense)} with its symmetrised copy): raise "
                f"{memory.SETTING} or lower dense_max (larger blocks are solved matrix-free by CG)")
        chunk = max(1, min(chunk, int((budget.bytes - 2 * dense) // (16 * self.dim))))
        out = torch.empty(self.dim, self.dim, dtype=torch.float64)
        with memory.reserved(dense + 16 * self.dim * chunk):
            for start in range(0, self.dim, chunk):
                stop = min(self.dim, start + chunk)
                basis = torch.zeros(self.dim, stop - start, dtype=torch.float64)
                basis[torch.arange(start, stop), torch.arange(stop - start)] = 1.0
                out[:, start:stop] = self.matmat(basis)
                tick(stop - start, total=self.dim, phase="Hessian columns", unit="col")
        sym = out + out.T
        del out
        return sym.mul_(0.5)


@dataclass
class Combination(LinearOperator):
    """sum_k c_k A_k + damping * I."""

    terms: Sequence[tuple[float, LinearOperator]]
    damping: float = 0.0

    def __post_init__(self) -> None:
        dims = {op.dim for _, op in self.terms}
        if len(dims) != 1:
            raise ValueError(f"operators of different sizes {sorted(dims)} cannot be combined")
        self.dim = dims.pop()

    def matvec(self, v: Tensor) -> Tensor:
        out = self.damping * v
        for coeff, op in self.terms:
            out = out + coeff * op.matvec(v)
        return out

    def matmat(self, columns: Tensor) -> Tensor:
        out = self.damping * columns
        for coeff, op in self.terms:
            out = out + coeff * op.matmat(columns)
        return out

    def to_dense(self, chunk: int = 256) -> Tensor:
        """sum_k c_k dense(A_k) + damping I: each term materialised its own way (a term that
        already holds its matrix is not multiplied by the identity)."""
        out = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        for coeff, op in self.terms:
            out += coeff * op.to_dense(chunk)
        out.diagonal().add_(self.damping)
        return out


@dataclass
class DenseOperator(LinearOperator):
    matrix: Tensor

    def __post_init__(self) -> None:
        self.dim = int(self.matrix.shape[0])

    def matvec(self, v: Tensor) -> Tensor:
        return self.matrix @ v

    def matmat(self, columns: Tensor) -> Tensor:
        return self.matrix @ columns

    def to_dense(self, chunk: int = 256) -> Tensor:
        return self.matrix.to(torch.float64)


class BlockObjective:
    """The functional form f(delta; batch) = sum_{z in batch} loss(w + E_P delta, z)."""

    def __init__(self, model: nn.Module, task: Task, block: ParamBlock):
        self.model, self.task, self.block = model, task, block
        self.params = {n: p.detach() for n, p in model.named_parameters()}
        self.buffers = {n: b.detach() for n, b in model.named_buffers()}
        first = next(iter(self.params.values()))
        self.device, self.dtype = first.device, first.dtype
        self.w_block = block.gather(self.params)

    def zeros(self) -> Tensor:
        return torch.zeros(self.block.numel, device=self.device, dtype=self.dtype)

    def loss_sum(self, batch: Batch) -> Callable[[Tensor], Tensor]:
        args, kwargs = self.task.model_args(batch)

        def f(delta: Tensor) -> Tensor:
            p = self.block.insert(self.params, delta)
            out = functional_call(self.model, {**p, **self.buffers}, args, kwargs)
            return self.task.per_sample_loss(output_logits(out), batch).sum()

        return f


def _check_finite(t: Tensor, what: str) -> Tensor:
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteGradientError(
            f"the {what} contains NaN or infinite values: check the model weights, the inputs and "
            "the learning rate it was trained with; nothing was changed"
        )
    return t


def gradient_batch_size(
    model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, batch_size: int,
    budget: "memory.MemoryBudget | str | int | None" = None,
) -> int:
    """Samples per gradient pass: ``batch_size`` or fewer, so that one pass fits the budget."""
    if len(data) == 0:
        return batch_size
    device = memory.model_device(model)
    cost = memory.cost_of(model, task, data)
    return memory.sample_chunk(
        memory.available_in(memory.resolve(budget, device)), cost, cost.gradient_plan(block),
        limit=min(batch_size, len(data)), what="sample's gradient",
        fix="choose fewer parameters (a smaller block) or a smaller model")


def block_gradient(
    model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, weight_decay: float,
    *, reduction: str = "sum", batch_size: int = 1024, memory_budget: "memory.MemoryBudget | str | int | None" = None,
) -> Tensor:
    """g_P(S) = sum_{z in S} [grad_P loss(w, z) + lambda w_P]  (or its mean); CPU float64.
    ``batch_size`` is lowered to fit ``memory_budget`` (default: the scoped / auto budget)."""
    obj = BlockObjective(model, task, block)
    batch_size = gradient_batch_size(model, task, data, block, batch_size, memory_budget)
    total = torch.zeros(block.numel, dtype=torch.float64)
    for batch in data.batches(batch_size):
        g = grad(obj.loss_sum(batch))(obj.zeros())
        total += g.detach().to("cpu", torch.float64)
    total += len(data) * weight_decay * obj.w_block.to("cpu", torch.float64)
    if reduction == "mean":
        total /= len(data)
    return _check_finite(total, "gradient")


class BlockHessian(LinearOperator):
    """H_P(S) v, exact, for samples S (``reduction`` "sum" or "mean"), lambda I included.

    ``batch_size`` (samples per pass) and ``columns_per_pass`` (tangent columns vmapped at
    once) are upper bounds: both are lowered so that one pass fits ``memory_budget`` (default:
    the scoped / auto budget, read when the operator is built). A budget that cannot hold one
    Hessian column of one sample raises ``MemoryBudgetError`` here, before any product."""

    def __init__(
        self, model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, weight_decay: float,
        *, reduction: str = "mean", batch_size: int = 1024, columns_per_pass: int = 128,
        memory_budget: "memory.MemoryBudget | str | int | None" = None,
    ):
        if reduction not in ("sum", "mean"):
            raise ValueError("reduction must be 'sum' or 'mean'")
        self.obj = BlockObjective(model, task, block)
        self.data, self.weight_decay = data, weight_decay
        self.scale = 1.0 / len(data) if reduction == "mean" else 1.0
        self.ridge = weight_decay if reduction == "mean" else weight_decay * len(data)
        self.batch_size, self.columns_per_pass = batch_size, columns_per_pass
        self.dim = block.numel
        self.block = block
        self.products = 0  # number of (sample-set) Hessian-vector products evaluated
        self.budget = memory.resolve(memory_budget, self.obj.device)
        self.cost = memory.cost_of(model, task, data)
        self._chunks(min(columns_per_pass, self.dim))  # fails now when one column cannot fit

    def _chunks(self, columns: int) -> tuple[int, int]:
        """(columns per pass, samples per batch) for a product with ``columns`` columns."""
        return memory.hessian_chunks(memory.available_in(self.budget), self.cost, self.block,
                                     columns=min(columns, self.columns_per_pass),
                                     batch_size=min(self.batch_size, max(1, len(self.data))))

    def _hvp_batch_size(self) -> int:
        return memory.sample_chunk(
            memory.available_in(self.budget), self.cost, self.cost.hvp_plan(self.block),
            limit=min(self.batch_size, max(1, len(self.data))), what="Hessian-vector product of one sample",
            fix="choose fewer parameters (a smaller block) or a smaller model")

    def _hvp_batch(self, batch: Batch, v: Tensor) -> Tensor:
        g = grad(self.obj.loss_sum(batch))
        return jvp(g, (self.obj.zeros(),), (v,))[1]

    def matvec(self, v: Tensor) -> Tensor:
        vd = v.to(self.obj.device, self.obj.dtype)
        out = torch.zeros(self.dim, dtype=torch.float64)
        for batch in self.data.batches(self._hvp_batch_size()):
            out += self._hvp_batch(batch, vd).detach().to("cpu", torch.float64)
        self.products += 1
        return _check_finite(self.scale * out + self.ridge * v.to(torch.float64), "Hessian-vector product")

    def matmat(self, columns: Tensor) -> Tensor:
        out = torch.zeros(self.dim, columns.shape[1], dtype=torch.float64)
        per_pass, batch_size = self._chunks(columns.shape[1])
        for start in range(0, columns.shape[1], per_pass):
            block = columns[:, start : start + per_pass].to(self.obj.device, self.obj.dtype)
            acc = torch.zeros(self.dim, block.shape[1], dtype=torch.float64)
            for batch in self.data.batches(batch_size):
                hv = vmap(lambda u, b=batch: self._hvp_batch(b, u))(block.T)
                acc += hv.T.detach().to("cpu", torch.float64)
            out[:, start : start + block.shape[1]] = acc
        self.products += columns.shape[1]
        return _check_finite(self.scale * out + self.ridge * columns.to(torch.float64), "Hessian block")


@dataclass
class SolveInfo:
    solver: str
    iterations: int = 0
    relative_residual: float = 0.0
    converged: bool = True
    positive_definite: bool = True
    min_eigenvalue: float | None = None
    notes: list[str] = field(default_factory=list)
    damping: float = 0.0           # damping of the system actually solved (requested + added)
    damping_added: float = 0.0     # Levenberg-Marquardt damping added for indefinite curvature
    tolerance: float | None = None  # the stated relative-residual tolerance
    attempts: int = 1              # solves tried (one per damping level)


def solve_dense(matrix: Tensor, rhs: Tensor) -> tuple[Tensor, SolveInfo]:
    """Solve A x = b on the CPU in float64: Cholesky when A is positive definite; otherwise an
    LU solve of the same (indefinite) Newton system, flagged in the info, never hidden."""
    a = matrix.to("cpu", torch.float64)
    b = rhs.to("cpu", torch.float64)
    chol, status = torch.linalg.cholesky_ex(a)
    if int(status) == 0:
        x = torch.cholesky_solve(b.unsqueeze(1), chol).squeeze(1)
        info = SolveInfo("cholesky")
    else:
        x = torch.linalg.solve(a, b)
        min_eig = float(torch.linalg.eigvalsh(a)[0])
        info = SolveInfo("lu", positive_definite=False, min_eigenvalue=min_eig,
                         notes=["the restricted Hessian is not positive definite; add damping for a "
                                "descent step"])
    res = torch.linalg.vector_norm(a @ x - b) / max(float(torch.linalg.vector_norm(b)), 1e-300)
    info.relative_residual = float(res)
    return _check_finite(x, "Newton direction"), info


def conjugate_gradient(
    op: LinearOperator, rhs: Tensor, *, rtol: float = 1e-8, max_iter: int | None = None,
) -> tuple[Tensor, SolveInfo]:
    """Matrix-free CG for A x = b (A symmetric positive definite), CPU float64 vectors.
    Stops at ||r|| <= rtol ||b||; a direction of non-positive curvature stops it and is
    reported (not hidden)."""
    b = rhs.to("cpu", torch.float64)
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rs = float(r @ r)
    bnorm = math.sqrt(float(b @ b)) or 1.0
    limit = max_iter or max(10, 2 * op.dim)
    info = SolveInfo("cg", converged=False)
    for it in range(1, limit + 1):
        ap = op.matvec(p)
        curv = float(p @ ap)
        if curv <= 0:
            info.positive_definite = False
            info.min_eigenvalue = curv / max(float(p @ p), 1e-300)  # an upper bound on lambda_min
            info.notes.append(f"non-positive curvature {curv:.3e} met at iteration {it}; add damping")
            info.iterations = it
            break
        alpha = rs / curv
        x += alpha * p
        r -= alpha * ap
        rs_new = float(r @ r)
        info.iterations = it
        tick(total=limit, phase="CG iterations", unit="it", rel_residual=math.sqrt(rs_new) / bnorm)
        if math.sqrt(rs_new) <= rtol * bnorm:
            info.converged = True
            rs = rs_new
            break
        p = r + (rs_new / rs) * p
        rs = rs_new
    info.relative_residual = math.sqrt(rs) / bnorm
    return _check_finite(x, "Newton direction"), info


def preconditioned_conjugate_gradient(
    op: LinearOperator, rhs: Tensor, precondition: Callable[[Tensor], Tensor], *, rtol: float = 1e-8,
    max_iter: int | None = None,
) -> tuple[Tensor, SolveInfo]:
    """Preconditioned CG for A x = b (A and the preconditioner P^{-1} symmetric positive
    definite), CPU float64. Stops at ||A x - b|| <= rtol ||b|| (the true residual norm, not the
    preconditioned one); non-positive curvature stops it and is reported."""
    b = rhs.to("cpu", torch.float64)
    x = torch.zeros_like(b)
    r = b.clone()
    z = precondition(r)
    p = z.clone()
    rz = float(r @ z)
    bnorm = math.sqrt(float(b @ b)) or 1.0
    limit = max_iter or max(10, op.dim)
    info = SolveInfo("pcg", converged=False)
    for it in range(1, limit + 1):
        ap = op.matvec(p)
        curv = float(p @ ap)
        info.iterations = it
        if curv <= 0:
            info.positive_definite = False
            info.min_eigenvalue = curv / max(float(p @ p), 1e-300)
            info.notes.append(f"non-positive curvature {curv:.3e} met at iteration {it}")
            break
        alpha = rz / curv
        x += alpha * p
        r -= alpha * ap
        if math.sqrt(float(r @ r)) <= rtol * bnorm:
            info.converged = True
            break
        z = precondition(r)
        rz_new = float(r @ z)
        p = z + (rz_new / rz) * p
        rz = rz_new
    info.relative_residual = math.sqrt(float(r @ r)) / bnorm
    tick(info.iterations, phase="PCG", unit="it")
    return _check_finite(x, "Newton direction"), info


def _eye_like(a: Tensor) -> Tensor:
    return torch.eye(a.shape[0], dtype=a.dtype)


def solve_newton_system(
    op: LinearOperator, rhs: Tensor, *, dense: bool, damping: float = 0.0, rtol: float = 1e-8,
    max_iter: int | None = None, max_attempts: int = 12,
) -> tuple[Tensor, SolveInfo]:
    """Solve (A + mu I) x = b to ||(A + mu I) x - b|| <= rtol ||b||, with adaptive
    Levenberg-Marquardt damping mu >= ``damping`` when A + damping I is not positive definite.

    dense  A materialised once (float64); Cholesky; on failure mu = damping + 2 |lambda_min(A +
           damping I)| (from ``eigvalsh``), then mu grows tenfold until Cholesky succeeds.
    CG     matrix-free conjugate gradient; a direction p with Rayleigh quotient q = p'(A + mu I)p
           / p'p <= 0 proves lambda_min <= q, so mu grows by 2|q| (at least tenfold) and CG
           restarts from zero.
    The solve is never silently accepted: a system not solved to ``rtol`` (iteration cap,
    damping attempts exhausted) raises ``UnsolvedSystemError`` with the numbers.
    """
    b = rhs.to("cpu", torch.float64)
    bnorm = float(torch.linalg.vector_norm(b))
    if bnorm == 0.0:
        info = SolveInfo("zero-rhs", damping=damping, tolerance=rtol, attempts=0)
        return torch.zeros_like(b), info
    if dense:
        check_dense_solve(op)
        x, info = _solve_dense_damped(op.to_dense(), b, damping, rtol, max_attempts)
    else:
        x, info = _solve_cg_damped(op, b, damping, rtol, max_iter, max_attempts)
    info.tolerance = rtol
    if not info.converged or not info.relative_residual <= rtol:
        raise UnsolvedSystemError(
            f"the Newton system was not solved to the stated tolerance (relative residual "
            f"{info.relative_residual:.3e} > {rtol:.1e} after {info.iterations} iterations, damping "
            f"{info.damping:.3e}); a step from it would be an arbitrary direction, so nothing was published",
            {"solver": {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                        for k, v in info.__dict__.items()}},
        )
    return _check_finite(x, "Newton direction"), info


def check_dense_solve(op: LinearOperator) -> None:
    """The dense solve holds the matrix, a damped copy and its Cholesky factor (3 dim^2 float64)."""
    budget = memory.available_in(getattr(op, "budget", None) or memory.current_budget())
    needs = 3 * 8 * op.dim * op.dim
    if needs > budget.bytes:
        raise memory.MemoryBudgetError(
            f"{budget.named()} cannot hold the dense {op.dim} x {op.dim} Newton "
            f"system (needs ~{memory.format_bytes(needs)} for the matrix, a damped copy and its Cholesky factor): "
            f"raise {memory.SETTING} or lower dense_max (larger blocks are solved matrix-free by CG)")


def _damped(a: Tensor, mu: float) -> Tensor:
    """a + mu I as a new matrix (no identity matrix materialised)."""
    out = a.clone()
    out.diagonal().add_(mu)
    return out


def _solve_dense_damped(a: Tensor, b: Tensor, damping: float, rtol: float, max_attempts: int) -> tuple[Tensor, SolveInfo]:
    a = a.to("cpu", torch.float64)
    mu = damping
    info = SolveInfo("cholesky", damping=mu, attempts=0)
    for attempt in range(1, max_attempts + 1):
        chol, status = torch.linalg.cholesky_ex(_damped(a, mu))
        info.attempts = attempt
        if int(status) == 0:
            break
        chol = None  # the failed factor goes before the next matrix is made
        if info.positive_definite:  # first failure: measure how indefinite the system is
            info.positive_definite = False
            lam_min = float(torch.linalg.eigvalsh(_damped(a, damping))[0])
            info.min_eigenvalue = lam_min
            scale = float(a.diagonal().abs().mean()) or 1.0
            mu = damping + max(2.0 * abs(lam_min), 1e-10 * scale)
            info.notes.append(f"H' + damping I is indefinite (lambda_min {lam_min:.3e}): Levenberg-Marquardt damping added")
        else:
            mu = damping + 10.0 * (mu - damping)
    else:
        info.converged = False
        info.relative_residual = math.inf
        info.damping, info.damping_added = mu, mu - damping
        return torch.zeros_like(b), info
    x = torch.cholesky_solve(b.unsqueeze(1), chol).squeeze(1)
    del chol
    res = torch.linalg.vector_norm(a @ x + mu * x - b) / torch.linalg.vector_norm(b)
    info.relative_residual = float(res)
    info.converged = bool(info.relative_residual <= rtol)
    info.damping, info.damping_added = mu, mu - damping
    return x, info


def _solve_cg_damped(op: LinearOperator, b: Tensor, damping: float, rtol: float, max_iter: int | None,
                     max_attempts: int) -> tuple[Tensor, SolveInfo]:
    mu = damping
    total = 0
    notes: list[str] = []
    for attempt in range(1, max_attempts + 1):
        damped = Combination([(1.0, op)], damping=mu)
        x, info = conjugate_gradient(damped, b, rtol=rtol, max_iter=max_iter)
        total += info.iterations
        if info.positive_definite:
            info.iterations, info.attempts = total, attempt
            info.positive_definite = attempt == 1
            info.damping, info.damping_added = mu, mu - damping
            info.notes = notes + info.notes
            return x, info
        q = info.min_eigenvalue if info.min_eigenvalue is not None else 0.0
        new_mu = mu + max(2.0 * abs(q), 9.0 * mu, 1e-8)
        notes.append(f"CG met curvature {q:.3e} (Rayleigh quotient) at damping {mu:.3e}; damping raised to {new_mu:.3e}")
        mu = new_mu
    info.iterations, info.attempts, info.notes = total, max_attempts, notes
    info.damping, info.damping_added, info.converged = mu, mu - damping, False
    info.positive_definite = False
    return x, info
