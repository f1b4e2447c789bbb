"""Training-set Hessian-vector products on a parameter block, sharded over a ``WorkerPool``.

``ShardedBlockHessian`` is a ``pipeline.curvature.LinearOperator`` with the semantics of
``BlockHessian`` (H_P(S) v, ``reduction`` "sum" or "mean", lambda I included). The samples S
are cut into contiguous shards at multiples of ``batch_size``; each shard is sent once to one
worker (which already holds the model) and every ``matvec`` / ``matmat`` fans out to the
workers and sums their products on the driver. Vectors and results stay on the driver's CPU
in float64; the block solve (dense or CG) stays on the driver too, so a large block never has
to be materialised on a GPU.

Summation order: by default (``exact_order``) each worker returns its products per batch and
the driver adds them in the global batch order, i.e. exactly the operations of the in-process
``BlockHessian``: results are bit-identical to it (same device and kernels). When a per-batch
payload would exceed ``max_exact_bytes`` the worker sums its shard first (less traffic; the
result then differs from the in-process sum by rounding only, ~1e-16 relative).

Memory: each worker's operators size their chunks from the removal's memory budget when one is
set (``memory.forwarded``, read when the operator is built), else from the worker's ``auto``;
workers that share a machine split it (``WorkerPool.sharing``, ``memory.worker_budget``).

``RayCurvatureFactory`` satisfies ``pipeline.methods.base.CurvatureFactory``
(``RemovalProblem.curvature_factory``).
"""
from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import ray
import torch
from torch import Tensor, nn

from cluster.pool import Call, WorkerPool
from cluster.shards import aligned_ranges
from pipeline import memory
from pipeline.curvature import LinearOperator
from pipeline.errors import NonFiniteGradientError
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock


def _finite(t: Tensor, what: str) -> Tensor:
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteGradientError(
            f"the {what} contains NaN or infinite values: check the model weights, the inputs and "
            "the learning rate it was trained with; nothing was changed")
    return t


class ShardedBlockHessian(LinearOperator):
    """H_P(S) v computed by ``pool``'s workers (see the module docstring)."""

    def __init__(
        self, pool: WorkerPool, model: nn.Module | None, data: SampleSet, block: ParamBlock,
        weight_decay: float, *, reduction: str = "mean", batch_size: int = 1024,
        columns_per_pass: int = 128, exact_order: bool = True, max_exact_bytes: int = 256 * 2**20,
    ):
        if reduction not in ("sum", "mean"):
            raise ValueError("reduction must be 'sum' or 'mean'")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.pool = pool
        self.dim = block.numel
        self.n = len(data)
        self.scale = 1.0 / self.n if reduction == "mean" else 1.0
        self.ridge = weight_decay if reduction == "mean" else weight_decay * self.n
        self.batch_size = batch_size
        self.exact_order, self.max_exact_bytes = exact_order, max_exact_bytes
        self.key = f"op-{uuid.uuid4().hex}"
        self.weights = pool.weights_for(model)
        self.shards = aligned_ranges(self.n, batch_size, pool.size, "curvature samples")
        block_ref = ray.put(block)
        budget = memory.forwarded()  # the removal's budget when set; else each worker's own auto
        self._specs: list[list[Any]] = []
        self._refs = [block_ref]
        for a, b in self.shards:
            part = data.take(torch.arange(a, b))
            columns = {k: v.detach().to("cpu").numpy() for k, v in part.columns.items()}
            ref = ray.put((columns, part.sample_ids.numpy()))
            self._refs.append(ref)
            self._specs.append([ref, block_ref, batch_size, columns_per_pass, budget])
        self.products = 0

    def _batches_in(self, shard: tuple[int, int]) -> int:
        return -(-(shard[1] - shard[0]) // self.batch_size)

    def _per_batch(self, columns: int) -> bool:
        worst = max(self._batches_in(s) for s in self.shards)
        return self.exact_order and worst * self.dim * columns * 8 <= self.max_exact_bytes

    def _fan_out(self, method: str, x: np.ndarray, per_batch: bool) -> Tensor:
        x_ref = ray.put(x)
        # each spec with the pool's share as it is now (it changes when a worker is replaced)
        calls = [Call(method, (self.key, self.weights, [*spec, self.pool.sharing], x_ref, per_batch))
                 for spec in self._specs]
        outs = self.pool.map(calls, pinned=True)
        acc = torch.zeros(x.shape, dtype=torch.float64)
        for out in outs:  # shard order, then batch order inside a shard: the global batch order
            parts = out if per_batch else out[None]
            for part in parts:
                acc += torch.from_numpy(np.array(part, copy=True))
        return acc

    def matvec(self, v: Tensor) -> Tensor:
        v64 = v.to("cpu", torch.float64)
        acc = self._fan_out("hessian_matvec", v64.contiguous().numpy(), self._per_batch(1))
        self.products += 1
        return _finite(self.scale * acc + self.ridge * v64, "Hessian-vector product")

    def matmat(self, columns: Tensor) -> Tensor:
        c64 = columns.to("cpu", torch.float64)
        acc = self._fan_out("hessian_matmat", c64.contiguous().numpy(), self._per_batch(int(c64.shape[1])))
        self.products += int(c64.shape[1])
        return _finite(self.scale * acc + self.ridge * c64, "Hessian block")

    def close(self) -> None:
        """Free the workers' cached shard operators (best effort, waits a few seconds)."""
        refs = []
        for actor in self.pool.actors:
            try:
                refs.append(actor.release.remote(self.key))
            except Exception:
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=5.0)
        self._refs = []


class RayCurvatureFactory:
    """``curvature_factory`` for ``RemovalProblem``: (model, task, data, block, weight_decay,
    reduction=..., batch_size=...) -> ShardedBlockHessian on ``pool``."""

    def __init__(self, pool: WorkerPool, **options: Any):
        self.pool = pool
        self.options = options
        self.operators: list[ShardedBlockHessian] = []

    def __call__(self, model: nn.Module | None, task: Any, data: SampleSet, block: ParamBlock,
                 weight_decay: float, *, reduction: str = "mean", batch_size: int = 1024,
                 **kwargs: Any) -> ShardedBlockHessian:
        if task is not None:
            self.pool.check_task(task)
        op = ShardedBlockHessian(self.pool, model, data, block, weight_decay, reduction=reduction,
                                 batch_size=batch_size, **{**self.options, **kwargs})
        self.operators.append(op)
        return op

    def close(self) -> None:
        for op in self.operators:
            op.close()
        self.operators = []
