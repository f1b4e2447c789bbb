"""Exact gradients and Hessian-vector products restricted to a parameter block.

For a block P of coordinates (``pipeline.param_block``) and a set of samples S, with the
per-sample objective f(w, z) = loss(w, z) + (lambda/2)||w||^2:
    gradient  g_P(S) = sum_{z in S} grad_P f(w, z)   = sum_z grad_P loss(w, z) + |S| lambda w_P
    Hessian   H_P(S) = sum_{z in S} hess_PP f(w, z)  = sum_z hess_PP loss(w, z) + |S| lambda I
(``reduction="mean"`` divides both by |S|). Gradients are one reverse pass of autograd through the
model's functional form. Hessian-vector products are exact: forward-over-
reverse autodiff (``torch.func.jvp`` of ``torch.func.grad``, vmapped over the columns of a block of
vectors) or, for one vector, reverse-over-reverse (autograd's double backward) on the model's functional
form, never finite differences. Products run where the model lives (CPU or GPU); vectors, dense
blocks and solves stay on the CPU in float64, so big blocks never sit on the GPU.

Memory: every pass sizes its chunks (samples per batch, tangent columns per vmapped pass) from
the scoped memory budget (``pipeline.memory.current_budget``, read when the operator is built):
``batch_size`` and ``columns_per_pass`` are upper bounds that the budget may lower, and a budget
that cannot hold one sample or one column raises ``MemoryBudgetError`` before the pass allocates
anything. Chunking only splits sums: results agree up to float rounding.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, vmap

from pipeline import memory
from pipeline.curvature.operators import LinearOperator
from pipeline.curvature.solve import check_finite
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.tasks import Batch, Task, output_logits

__all__ = ["BlockHessian", "BlockObjective", "block_gradient", "gradient_batch_size"]


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

    def gradient_sum(self, batch: Batch) -> Tensor:
        """grad_P sum_{z in batch} loss(w, z), by one reverse pass of autograd: the block's parameters enter the
        model's functional form as fresh leaves (their storage shared; nothing written) and ``gather`` takes the
        block's entries of their gradients. The same gradient as ``torch.func.grad`` of ``loss_sum`` at delta = 0
        without functorch's per-operation wrapping, which costs as much as the pass itself on small batches."""
        args, kwargs = self.task.model_args(batch)
        names = [part.name for part in self.block.parts]
        leaves = {name: self.params[name].detach().requires_grad_(True) for name in names}
        with torch.enable_grad():
            out = functional_call(self.model, {**self.params, **leaves, **self.buffers}, args, kwargs)
            loss = self.task.per_sample_loss(output_logits(out), batch).sum()
            grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        return self.block.gather({n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads)})


def gradient_batch_size(model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, batch_size: int) -> int:
    """Samples per gradient pass: ``batch_size`` or fewer, so that one pass fits the budget."""
    if len(data) == 0:
        return batch_size
    cost = memory.cost_of(model, task, data)
    return memory.sample_chunk(
        memory.available_in(memory.current_budget(memory.model_device(model))), cost, cost.gradient_plan(block),
        limit=min(batch_size, len(data)), what="sample's gradient",
        fix="choose fewer parameters (a smaller block) or a smaller model")


def block_gradient(
    model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, weight_decay: float,
    *, reduction: str = "sum", batch_size: int = 1024,
) -> Tensor:
    """g_P(S) = sum_{z in S} [grad_P loss(w, z) + lambda w_P]  (or its mean); CPU float64.
    ``batch_size`` is lowered to fit the scoped memory budget."""
    obj = BlockObjective(model, task, block)
    batch_size = gradient_batch_size(model, task, data, block, batch_size)
    total: Tensor | None = None
    for batch in data.batches(batch_size):
        part = obj.gradient_sum(batch).detach().to("cpu", torch.float64)
        total = part if total is None else total.add_(part)
    if total is None:
        total = torch.zeros(block.numel, dtype=torch.float64)
    if weight_decay:
        total.add_(obj.w_block.to("cpu", torch.float64), alpha=len(data) * weight_decay)
    if reduction == "mean":
        total /= len(data)
    return check_finite(total, "gradient")


def _has_custom_function(node: object) -> bool:
    """Whether the autograd graph below ``node`` holds a custom ``torch.autograd.Function``'s backward."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, torch.autograd.function.BackwardCFunction):
            return True
        stack.extend(child for child, _ in getattr(current, "next_functions", ()))
    return False


class BlockHessian(LinearOperator):
    """H_P(S) v, exact, for samples S (``reduction`` "sum" or "mean"), lambda I included.

    ``batch_size`` (samples per pass) and ``columns_per_pass`` (tangent columns vmapped at
    once) are upper bounds: both are lowered so that one pass fits the memory budget scoped when
    the operator is built. A budget that cannot hold one Hessian column of one sample raises
    ``MemoryBudgetError`` here, before any product."""

    def __init__(
        self, model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, weight_decay: float,
        *, reduction: str = "mean", batch_size: int = 1024, columns_per_pass: int = 128,
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
        # double backward for one vector (``_hvp_batch_single``): decided by the first product's graph; never where a
        # module in training mode holds buffers (batch normalisation's running statistics, updated by its forward)
        stateful = any(m.training and next(m.buffers(recurse=False), None) is not None for m in model.modules())
        self._twice_differentiable: bool | None = False if stateful else None
        self.budget = memory.current_budget(self.obj.device)
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
        """Forward-over-reverse (``jvp`` of ``grad``): the form ``vmap`` maps over tangent columns."""
        g = grad(self.obj.loss_sum(batch))
        return jvp(g, (self.obj.zeros(),), (v,))[1]

    def _hvp_batch_single(self, batch: Batch, v: Tensor) -> Tensor:
        """Reverse-over-reverse (autograd's double backward) for one vector: the same product, without the
        per-call cost of torch.func's forward-mode rules (docs/METHODS.md, "Hessian-vector products").

        Forward-over-reverse (``_hvp_batch``) where double backward could be silently wrong, undefined or
        change the model: a graph holding a custom ``autograd.Function`` (one marked once-differentiable is cut
        from the second backward without an error, where torch.func raises for want of a forward-mode rule), a
        module in training mode with buffers (plain autograd would let batch normalisation update the model's
        running statistics in place), a loss that does not reach the block, a gradient that does not depend on
        it."""
        if self._twice_differentiable is False:
            return self._hvp_batch(batch, v)
        with torch.enable_grad():
            delta = self.obj.zeros().requires_grad_(True)
            loss = self.obj.loss_sum(batch)(delta)
            if self._twice_differentiable is None:
                self._twice_differentiable = loss.requires_grad and not _has_custom_function(loss.grad_fn)
            if not self._twice_differentiable:
                return self._hvp_batch(batch, v)
            (g,) = torch.autograd.grad(loss, delta, create_graph=True)
            if not g.requires_grad:
                return self._hvp_batch(batch, v)
            return torch.autograd.grad(g, delta, v, allow_unused=True, materialize_grads=True)[0]

    def matvec(self, v: Tensor) -> Tensor:
        vd = v.to(self.obj.device, self.obj.dtype)
        out = torch.zeros(self.dim, dtype=torch.float64)
        for batch in self.data.batches(self._hvp_batch_size()):
            out += self._hvp_batch_single(batch, vd).detach().to("cpu", torch.float64)
        self.products += 1
        return check_finite(self.scale * out + self.ridge * v.to(torch.float64), "Hessian-vector product")

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
        return check_finite(self.scale * out + self.ridge * columns.to(torch.float64), "Hessian block")
