"""The generalised Gauss-Newton matrix of a parameter block, matrix-free.

For samples S, per-sample logits z(w, x) and loss l(z, y), the objective's Hessian on a block P is
    H_P = sum_z J_P^T (d^2 l / dz^2) J_P  +  sum_z sum_k (d l / d z_k) d^2 z_k / dw_P^2  +  |S| lambda I.
The generalised Gauss-Newton matrix keeps the first term (Schraudolph 2002; Martens 2010):
    G_P(S) = sum_{z in S} J_P(z)^T H_out(z) J_P(z) + |S| lambda I,       J_P = d z / d w_P,
(``reduction="mean"`` divides by |S|). It is positive semi-definite for every convex loss of
the logits (cross-entropy, BCE, MSE), so a Newton system on it needs no Levenberg-Marquardt
rescue where the exact Hessian of a network away from a minimum is indefinite; it equals the
Hessian where the logits are affine in w_P (a linear model, an output layer over fixed features).
Products: G v = J^T (H_out (J v)) per batch, H_out u by forward-over-reverse on the per-sample loss
of the logits (any loss of the task, its options included); nothing P x P is formed. Two ways:
  kept linearisation (``keep_linearisation``, where every batch's graph fits a quarter of the memory
  budget): each batch's forward runs once, its ``vjp`` pullback u -> J^T u is kept, and J v is read
  from the same graph as d/du <J^T u, v> (the pullback is linear in u; a backward pass through it):
  two backward-sized passes per batch and product, no forward;
  recomputed (else, or where an operator of the model has no double backward): J v by forward-mode
  ``jvp``, J^T by a fresh ``vjp``: one forward, one forward-mode and one backward pass per batch.
When the graphs are built, one product on a seeded random vector is computed both ways and the kept
form dropped if they differ beyond rounding (a backward that cannot be differentiated gives a wrong
J v under torch.func, not an error).
Both give the same matrix (to float rounding; tests/test_ggn.py). Vectors are CPU float64; passes
run where the model lives; batches sized from the memory budget like ``BlockHessian``'s.
"""
from __future__ import annotations

from typing import Any

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
        *, reduction: str = "mean", batch_size: int = 1024, keep_linearisation: bool = True,
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
        # each batch's kept graph: its forward's activations and the pullback's (the backward's) once more
        kept_bytes = 2.0 * cost.HVP_PRIMAL * cost.activation_bytes * len(data)
        self._kept: list[tuple[Batch, Tensor, Any, Any]] | None = None
        self.linearisation = "recomputed per product"
        if not keep_linearisation:
            self.linearisation += " (keep_linearisation off)"
        elif kept_bytes > 0.25 * memory.available_in(self.budget).bytes:
            self.linearisation += (f" (the graphs of {len(data)} samples, ~{memory.format_bytes(kept_bytes)}, exceed a "
                                   "quarter of the memory budget)")
        else:
            self._kept = []
            self.linearisation = "kept"

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
        h_jv = self._h_out(batch, logits, jv.detach())
        _, pullback = vjp(z, zero)
        return pullback(h_jv)[0]

    def _h_out(self, batch: Batch, logits: Tensor, u: Tensor) -> Tensor:
        def loss_grad(out: Tensor) -> Tensor:
            return grad(lambda o: self.task.per_sample_loss(o, batch).sum())(out)

        return jvp(loss_grad, (logits,), (u,))[1]

    def _linearise(self) -> None:
        """Each batch's forward once: (batch, logits, u -> J^T u, v -> J v) kept for every product."""
        kept = []
        for batch in self.data.batches(self.batch_size):
            logits, pullback = vjp(self._logits(batch), self.obj.zeros())
            logits = logits.detach()
            _, forward = vjp(lambda u, pb=pullback: pb(u)[0], torch.zeros_like(logits))
            kept.append((batch, logits, pullback, forward))
        self._kept = kept
        # checked once on a seeded random vector against the recomputed form: a backward an operator does not
        # differentiate (a custom Function's once-differentiable backward under torch.func) gives a wrong J v,
        # not an error
        probe = torch.randn(self.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        probe = probe.to(self.obj.device, self.obj.dtype)
        fresh = self._recomputed_products(probe)
        gap = float((self._kept_products(probe) - fresh).norm()) / max(float(fresh.norm()), 1e-300)
        if gap > 1e3 * torch.finfo(self.obj.dtype).eps:
            self._kept = None
            self.linearisation = (f"recomputed per product (the kept linearisation's product on a random vector was "
                                  f"{gap:.3g} off the recomputed one: an operator of the model without a double "
                                  "backward)")

    def _kept_products(self, vd: Tensor) -> Tensor:
        out = torch.zeros(self.dim, dtype=torch.float64)
        for batch, logits, pullback, forward in self._kept:
            jv = forward(vd)[0]
            out += pullback(self._h_out(batch, logits, jv.detach()))[0].detach().to("cpu", torch.float64)
        return out

    def _recomputed_products(self, vd: Tensor) -> Tensor:
        out = torch.zeros(self.dim, dtype=torch.float64)
        for batch in self.data.batches(self.batch_size):
            out += self._product(batch, vd).detach().to("cpu", torch.float64)
        return out

    def matvec(self, v: Tensor) -> Tensor:
        vd = v.to(self.obj.device, self.obj.dtype)
        out = None
        if self._kept is not None:
            try:
                if not self._kept:
                    self._linearise()
                if self._kept is not None:
                    out = self._kept_products(vd)
            except (RuntimeError, NotImplementedError) as err:  # an operator without a double backward
                self._kept = None
                self.linearisation = f"recomputed per product (no kept linearisation: {str(err).splitlines()[0][:200]})"
        if out is None:
            out = self._recomputed_products(vd)
        self.products += 1
        return check_finite(self.scale * out + self.ridge * v.to(torch.float64), "Gauss-Newton product")
