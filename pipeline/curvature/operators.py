"""Curvature as linear operators (curvlinops-style): one symmetric map per class, materialised
only when asked.

  ``LinearOperator``   v -> A v on R^dim (1-D CPU float64 vectors); ``matmat``; ``to_dense``
                       (materialised in chunks inside the memory budget, symmetrised)
  ``Combination``      sum_k c_k A_k + damping I
  ``DenseOperator``    a matrix already held
  ``CappedProducts``   an operator that refuses its (cap + 1)-th product (``ProductsSpent``)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from pipeline import memory
from pipeline.progress import tick

__all__ = ["CappedProducts", "Combination", "DenseOperator", "LinearOperator", "ProductsSpent"]


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


class ProductsSpent(Exception):
    """A ``CappedProducts`` operator was asked for more products than its cap."""


class CappedProducts(LinearOperator):
    """``op`` that raises ``ProductsSpent`` at its (cap + 1)-th product: one cap for a whole
    solve, every damping restart included."""

    def __init__(self, op: Any, cap: int):
        self.op, self.cap, self.dim, self.products = op, cap, op.dim, 0

    def matvec(self, v: Tensor) -> Tensor:
        self.products += 1
        if self.products > self.cap:
            raise ProductsSpent
        return self.op.matvec(v)
