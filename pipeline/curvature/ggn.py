"""The generalised Gauss-Newton matrix of a parameter block, matrix-free.

For samples S, per-sample logits z(w, x) and loss l(z, y), the objective's Hessian on a block P is
    H_P = sum_z J_P^T (d^2 l / dz^2) J_P  +  sum_z sum_k (d l / d z_k) d^2 z_k / dw_P^2  +  |S| lambda I.
The generalised Gauss-Newton matrix keeps the first term (Schraudolph 2002; Martens 2010):
    G_P(S) = sum_{z in S} J_P(z)^T H_out(z) J_P(z) + |S| lambda I,       J_P = d z / d w_P,
(``reduction="mean"`` divides by |S|). It is positive semi-definite for every convex loss of
the logits (cross-entropy, BCE, MSE), so a Newton system on it needs no Levenberg-Marquardt
rescue where the exact Hessian of a network away from a minimum is indefinite; it equals the
Hessian where the logits are affine in w_P (a linear model, an output layer over fixed features).
Products: G v = J^T (H_out (J v)) per batch, J v by forward-mode ``jvp``, H_out u by forward-over-
reverse on the per-sample loss of the logits (any loss of the task, its options included), J^T by
``vjp``: one forward, one forward-mode and one backward pass per batch; nothing P x P is formed.
Vectors are CPU float64; passes run where the model lives; batches sized from the memory budget
like ``BlockHessian``'s.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, vjp

from pipeline import memory
from pipeline.curvature.hessian import BlockObjective
from pipeline.curvature.operators import LinearOperator
from pipeline.curvature.solve import check_finite
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.tasks import Batch, Task, output_logits

__all__ = ["BlockGaussNewton"]


class BlockGaussNewton(LinearOperator):
    """G_P(S) v = sum_{z in S} J_P^T H_out J_P v + (|S| or 1) lambda v; ``reduction`` "sum" or "mean"."""

    def __init__(
        self, model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, weight_decay: float,
        *, reduction: str = "mean", batch_size: int = 1024,
    ):
        if reduction not in ("sum", "mean"):
            raise ValueError("reduction must be 'sum' or 'mean'")
        if len(data) == 0:
            raise ValueError("the Gauss-Newton matrix needs at least one sample")
        self.obj = BlockObjective(model, task, block)
        self.task, self.data, self.block, self.dim = task, data, block, block.numel
        self.scale = 1.0 / len(data) if reduction == "mean" else 1.0
        self.ridge = weight_decay if reduction == "mean" else weight_decay * len(data)
        self.products = 0
        self.budget = memory.current_budget(self.obj.device)
        cost = memory.cost_of(model, task, data)
        self.batch_size = memory.sample_chunk(
            memory.available_in(self.budget), cost, cost.hvp_plan(block), limit=min(batch_size, len(data)),
            what="Gauss-Newton product of one sample", fix="choose fewer parameters (a smaller block) or a smaller model")

    def _logits(self, batch: Batch):
        args, kwargs = self.task.model_args(batch)
        obj = self.obj

        def z(delta: Tensor) -> Tensor:
            return output_logits(functional_call(obj.model, {**obj.block.insert(obj.params, delta), **obj.buffers},
                                                 args, kwargs))

        return z

    def _product(self, batch: Batch, v: Tensor) -> Tensor:
        z = self._logits(batch)
        zero = self.obj.zeros()
        logits, jv = jvp(z, (zero,), (v,))
        logits = logits.detach()

        def loss_grad(out: Tensor) -> Tensor:
            return grad(lambda o: self.task.per_sample_loss(o, batch).sum())(out)

        h_jv = jvp(loss_grad, (logits,), (jv.detach(),))[1]
        _, pullback = vjp(z, zero)
        return pullback(h_jv)[0]

    def matvec(self, v: Tensor) -> Tensor:
        vd = v.to(self.obj.device, self.obj.dtype)
        out = torch.zeros(self.dim, dtype=torch.float64)
        for batch in self.data.batches(self.batch_size):
            out += self._product(batch, vd).detach().to("cpu", torch.float64)
        self.products += 1
        return check_finite(self.scale * out + self.ridge * v.to(torch.float64), "Gauss-Newton product")
