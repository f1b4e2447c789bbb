"""Oracles of the recipe replay (``pipeline.target.replay.Oracle``): the mean loss of a parameter
block at any block weights, its gradient, its dense Gauss-Newton matrix, outputs and output JVPs.

* ``SoftmaxLayerOracle``: a softmax decision layer theta = [W, b] (K x (d+1), class-major) over
  fixed inputs x~ = (x, 1) with soft targets t (label smoothing: (1 - s) e_y + s / K):
      grad = (1/|S|) (P - T)^T X~,   G = (1/|S|) sum_i (diag p_i - p_i p_i^T) (x) x~_i x~_i^T
  (the exact Hessian: the logits are linear in theta).
* ``ModuleBlockOracle``: any module and ``ParamBlock``, by ``torch.func``: G = (1/|S|) sum_i
  J_i^T H_out,i J_i with per-sample Jacobians J_i = dz_i / dw_P (``jacrev``) and the loss's Hessian in
  the outputs (``hessian`` of the task's per-sample loss); for blocks small enough to hold P x P.
* ``SubsampledCurvature``: another oracle whose G is estimated on the samples of a fixed seeded
  subsample S that are among those asked (G_S = mean over idx & S); gradients, outputs and JVPs stay
  exact. The replay uses G only as the model of the gradient's change near a base (its model (2)),
  and the trust-region probe catches where that model fails, so a subsample trades a little
  accuracy of the model for a pass of |S| instead of |D| samples per base (n C P^2 work on a block).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev, jvp, vmap

from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.tasks import Task, output_logits

__all__ = ["ModuleBlockOracle", "SoftmaxLayerOracle", "SubsampledCurvature"]


class SoftmaxLayerOracle:
    """Closed-form oracle of a softmax layer over fixed inputs (module docstring); w is theta flat."""

    outputs_are_logits = True

    def __init__(self, inputs: Tensor, targets: Tensor, chunk: int = 2048):
        self.x = inputs.to(torch.float64)          # (n, d + 1), the last column ones
        self.t = targets.to(torch.float64)         # (n, K)
        self.n, self.k = self.t.shape
        self.width = self.x.shape[1]
        self.chunk = chunk

    def _theta(self, w: Tensor) -> Tensor:
        return w.reshape(self.k, self.width)

    def outputs(self, w: Tensor, idx: Tensor) -> Tensor:
        return self.x[idx] @ self._theta(w).T

    def jvp(self, w: Tensor, idx: Tensor, v: Tensor) -> Tensor:
        return self.x[idx] @ self._theta(v).T

    def grad(self, w: Tensor, idx: Tensor) -> Tensor:
        total = torch.zeros(self.k, self.width, dtype=torch.float64)
        for s in range(0, len(idx), self.chunk):
            rows = idx[s:s + self.chunk]
            r = torch.softmax(self.outputs(w, rows), -1) - self.t[rows]
            total += r.T @ self.x[rows]
        return total.reshape(-1) / len(idx)

    def curvature(self, w: Tensor, idx: Tensor) -> Tensor:
        k, width = self.k, self.width
        total = torch.zeros(k * width, k * width, dtype=torch.float64)
        for s in range(0, len(idx), self.chunk):
            rows = idx[s:s + self.chunk]
            x = self.x[rows]
            p = torch.softmax(x @ self._theta(w).T, -1)
            y = (p[:, :, None] * x[:, None, :]).reshape(len(rows), k * width)
            total -= y.T @ y
            for c in range(k):
                block = slice(c * width, (c + 1) * width)
                total[block, block] += (x * p[:, c:c + 1]).T @ x
        return total / len(idx)


class ModuleBlockOracle:
    """Oracle of a parameter block of any module under the task's loss (module docstring); w is
    the block's flat weights, in the block's order, float64 (the passes run in the model's dtype)."""

    def __init__(self, model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, *, chunk: int = 256):
        self.model, self.task, self.data, self.block = model, task, data, block
        self.n = len(data)
        self.outputs_are_logits = task.loss == "cross_entropy"
        self.chunk = chunk
        self.params = {name: p.detach() for name, p in model.named_parameters()}
        self.buffers = {name: b.detach() for name, b in model.named_buffers()}
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.w_ref = block.gather(self.params).to(torch.float64).cpu()

    def _delta(self, w: Tensor) -> Tensor:
        return (w - self.w_ref).to(self.device, self.dtype)

    def _call(self, delta: Tensor, columns: dict) -> Tensor:
        args, kwargs = self.task.model_args(columns)
        params = self.block.insert(self.params, delta)
        return output_logits(functional_call(self.model, {**params, **self.buffers}, args, kwargs))

    @torch.no_grad()
    def outputs(self, w: Tensor, idx: Tensor) -> Tensor:
        columns = self.data.take(idx).columns
        return self._call(self._delta(w), columns).to(torch.float64).cpu()

    def jvp(self, w: Tensor, idx: Tensor, v: Tensor) -> Tensor:
        columns = self.data.take(idx).columns
        _, out = jvp(lambda d: self._call(d, columns), (self._delta(w),), (v.to(self.device, self.dtype),))
        return out.detach().to(torch.float64).cpu()

    def grad(self, w: Tensor, idx: Tensor) -> Tensor:
        delta = self._delta(w)
        total = torch.zeros(self.block.numel, dtype=torch.float64)
        for s in range(0, len(idx), 4 * self.chunk):
            batch = self.data.take(idx[s:s + 4 * self.chunk]).columns

            def loss(d: Tensor) -> Tensor:
                return self.task.per_sample_loss(self._call(d, batch), batch).sum()

            total += grad(loss)(delta).detach().to(torch.float64).cpu()
        return total / len(idx)

    def curvature(self, w: Tensor, idx: Tensor) -> Tensor:
        delta = self._delta(w)
        size = self.block.numel
        total = torch.zeros(size, size, dtype=torch.float64)
        for s in range(0, len(idx), self.chunk):
            batch = self.data.take(idx[s:s + self.chunk]).columns
            keys = list(batch)

            def one(d: Tensor, *values: Tensor) -> Tensor:  # a single sample's outputs, (C,)
                return self._call(d, {k: v.unsqueeze(0) for k, v in zip(keys, values)}).squeeze(0)

            # per-sample Jacobians J_i (b, C, P): a backward pass per output of one sample, not of the batch
            jac = vmap(jacrev(one), in_dims=(None, *[0] * len(keys)))(delta, *[batch[k] for k in keys])
            z = self._call(delta, batch).detach()
            h_out = vmap(hessian(self._sample_loss))(z, batch["y"])            # (b, C, C)
            jac = jac.to(torch.float64).cpu()
            h_out = h_out.to(torch.float64).cpu()
            total += torch.einsum("bcp,bcd,bdq->pq", jac, h_out, jac)
        return total / len(idx)

    def _sample_loss(self, z: Tensor, y: Tensor) -> Tensor:
        return self.task.per_sample_loss(z.unsqueeze(0), {"y": y.unsqueeze(0)}).sum()


class SubsampledCurvature:
    """``oracle`` with its Gauss-Newton matrix estimated on ``positions`` (module docstring)."""

    def __init__(self, oracle: "ModuleBlockOracle | SoftmaxLayerOracle", positions: Tensor):
        self.oracle = oracle
        self.n = oracle.n
        self.outputs_are_logits = oracle.outputs_are_logits
        self.positions = torch.as_tensor(positions, dtype=torch.long)
        if len(self.positions) == 0:
            raise ValueError("the curvature subsample is empty")

    def grad(self, w: Tensor, idx: Tensor) -> Tensor:
        return self.oracle.grad(w, idx)

    def outputs(self, w: Tensor, idx: Tensor) -> Tensor:
        return self.oracle.outputs(w, idx)

    def jvp(self, w: Tensor, idx: Tensor, v: Tensor) -> Tensor:
        return self.oracle.jvp(w, idx, v)

    def curvature(self, w: Tensor, idx: Tensor) -> Tensor:
        """G on idx & S (on idx itself where they share no sample)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        shared = idx[torch.isin(idx, self.positions)]
        return self.oracle.curvature(w, shared if len(shared) else idx)
