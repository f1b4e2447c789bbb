"""A network linearised in a block of its parameters, evaluated with forward/reverse products.

For a model f(x; w), a base point w_b (all parameters) and a block P of coordinates
(``param_block``), the first-order Taylor model in the block displacement u in R^|P| is
    f_lin(x; u) = f(x; w_b) + J_b(x) u,        J_b(x) = d f(x; w_b + E_P u) / d u  at u = 0.
It is the object of two methods:
  - NTK scrubbing (Golatkar, Achille, Soatto, "Forgetting Outside the Box", ECCV 2020):
    w_b = w0 (the pre-training weights), u = w - w0;
  - Mixed-Linear forgetting (Golatkar, Achille, Ravichandran, Polito, Soatto, "Mixed-Privacy
    Forgetting in Deep Networks", CVPR 2021): w_b = w_c (the core weights), u = w_u.

Everything is matrix-free: J u is one forward-mode product (``torch.func.jvp``, which also
returns f(x; w_b) at no extra cost), J^T c one reverse-mode product (``torch.func.vjp``).
Per-sample Jacobians (K x |P| per sample) are formed only on request and only for a chunk
of samples (``jacobian``); no |P| x |P| matrix is ever built. Outputs are flattened to
(N, K). Products run on the model's device in its dtype; callers accumulate in float64.
"""
from __future__ import annotations

import threading
import warnings
from typing import Mapping, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, linearize, vjp, vmap

from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.tasks import Batch, Task, output_logits


class LinearizedModel:
    """f_lin(x; u) = f(x; w_b) + J_b(x) u on block coordinates u (see the module docstring).

    ``base`` maps parameter names to the base point w_b; names it lacks take the model's
    current values (so ``base=None`` linearises at the model's own weights). Buffers
    (e.g. BatchNorm statistics) are the model's; call it on a model in eval mode.
    """

    def __init__(self, model: nn.Module, task: Task, block: ParamBlock,
                 base: Mapping[str, Tensor] | None = None):
        self.model, self.task, self.block = model, task, block
        current = {n: p.detach() for n, p in model.named_parameters()}
        unknown = sorted(set(base or {}) - set(current) - {n for n, _ in model.named_buffers()})
        if unknown:
            raise KeyError(f"the base point names tensors the model does not have: {unknown[:5]}; "
                           "pass a state dict keyed by qualified parameter names")
        self.params = {n: (base[n].detach().to(p.device, p.dtype) if base is not None and n in base else p)
                       for n, p in current.items()}
        for n, p in self.params.items():
            if p.shape != current[n].shape:
                raise ValueError(f"base point '{n}' has shape {tuple(p.shape)}, the model {tuple(current[n].shape)}")
        self.buffers = {n: b.detach() for n, b in model.named_buffers()}
        first = next(iter(self.params.values()))
        self.device, self.dtype = first.device, first.dtype
        self.dim = block.numel

    # -- the functional form ---------------------------------------------------------------
    def _fn(self, batch: Batch):
        args, kwargs = self.task.model_args(batch)

        def f(u: Tensor) -> Tensor:
            p = self.block.insert(self.params, u)
            out = output_logits(functional_call(self.model, {**p, **self.buffers}, args, kwargs))
            return out.reshape(out.shape[0], -1)

        return f

    def _vec(self, u: Tensor) -> Tensor:
        return u.to(self.device, self.dtype)

    def zeros(self) -> Tensor:
        return torch.zeros(self.dim, device=self.device, dtype=self.dtype)

    # -- products on one batch -------------------------------------------------------------
    def base_outputs(self, batch: Batch) -> Tensor:
        """f(x; w_b), shape (N, K)."""
        with torch.no_grad():
            return self._fn(batch)(self.zeros())

    def jvp(self, batch: Batch, u: Tensor) -> tuple[Tensor, Tensor]:
        """(f(x; w_b), J_b(x) u), both (N, K), in one forward-mode pass."""
        f0, ju = jvp(self._fn(batch), (self.zeros(),), (self._vec(u),))
        return f0.detach(), ju.detach()

    def predict(self, batch: Batch, u: Tensor) -> Tensor:
        """f_lin(x; u) = f(x; w_b) + J_b(x) u."""
        f0, ju = self.jvp(batch, u)
        return f0 + ju

    def vjp(self, batch: Batch, cotangent: Tensor) -> Tensor:
        """J_b(x)^T c for c of shape (N, K) (the outputs' shape): a |P| vector (model device
        and dtype)."""
        _, pullback = vjp(self._fn(batch), self.zeros())
        return pullback(cotangent.to(self.device, self.dtype))[0].detach()

    def jvp_many(self, batch: Batch, tangents: Tensor) -> Tensor:
        """J_b(x) t for each row t of ``tangents`` (r x |P|): shape (r, N, K)."""
        f = self._fn(batch)
        zero = self.zeros()
        return vmap(lambda t: jvp(f, (zero,), (t,))[1])(tangents.to(self.device, self.dtype)).detach()

    def jacobian(self, batch: Batch) -> Tensor:
        """Per-sample Jacobians of this (small) batch stacked as rows: (N*K) x |P|, row
        i*K + k = d f_k(x_i) / d u. Memory N*K*|P|: for chunks of samples only."""

        def one(u: Tensor, sample: Batch) -> Tensor:
            single = {k: v.unsqueeze(0) for k, v in sample.items()}
            return self._fn(single)(u).reshape(-1)

        jac = vmap(jacrev(one), in_dims=(None, 0))(self.zeros(), dict(batch))
        return jac.reshape(-1, self.dim).detach()


class BatchProducts(Protocol):
    """J u and J^T c on one fixed batch (``batch``), plus the base outputs f(x; w_b)."""

    batch: Batch
    base: Tensor

    def jvp(self, u: Tensor) -> Tensor: ...

    def vjp(self, cotangent: Tensor) -> Tensor: ...


class DirectProducts:
    """Recomputes the forward pass on every product: no memory beyond one pass."""

    def __init__(self, lin: LinearizedModel, batch: Batch):
        self.lin, self.batch = lin, batch
        self.base = lin.base_outputs(batch)

    def jvp(self, u: Tensor) -> Tensor:
        return self.lin.jvp(self.batch, u)[1]

    def vjp(self, cotangent: Tensor) -> Tensor:
        return self.lin.vjp(self.batch, cotangent)


_TRACE_LOCK = threading.Lock()  # tracing (make_fx) is not thread-safe; replaying the traces is


class TracedProducts:
    """Traces the batch's linearisation once (``torch.func.linearize`` for J u, a reusable
    ``torch.func.vjp`` pullback for J^T c) and replays only the tangent computations: tens of
    times faster for repeated products (CG), at the memory cost of the batch's activations."""

    def __init__(self, lin: LinearizedModel, batch: Batch):
        self.lin, self.batch = lin, batch
        fn, zero = lin._fn(batch), lin.zeros()
        with _TRACE_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base, self._jvp = linearize(fn, zero)
        self.base = base.detach()
        _, self._vjp = vjp(fn, zero)

    def jvp(self, u: Tensor) -> Tensor:
        return self._jvp(self.lin._vec(u)).detach()

    def vjp(self, cotangent: Tensor) -> Tensor:
        return self._vjp(cotangent.to(self.lin.device, self.lin.dtype))[0].detach()


def batch_products(lin: LinearizedModel, data: SampleSet, batch_size: int, *, cache: bool = True) -> list[BatchProducts]:
    """Per-batch product providers for ``data``: traced and kept (``cache``) or recomputed.
    A model that cannot be traced (data-dependent Python control flow) falls back to the
    recomputing products, with a warning: same values, slower."""
    if not cache:
        return [DirectProducts(lin, batch) for batch in data.batches(batch_size)]
    out: list[BatchProducts] = []
    for batch in data.batches(batch_size):
        try:
            out.append(TracedProducts(lin, batch))
        except Exception as err:  # noqa: BLE001  (tracing limits vary by model; the maths does not)
            warnings.warn(f"could not trace the linearised model ({type(err).__name__}: {err}); "
                          "recomputing the forward pass for every product instead", RuntimeWarning)
            return [DirectProducts(lin, b) for b in data.batches(batch_size)]
    return out


def output_targets(y: Tensor, outputs: int, dtype: torch.dtype) -> Tensor:
    """Regression targets of shape (N, K): integer class labels (1-D) become one-hot rows;
    anything else is reshaped to (N, K)."""
    if not torch.is_floating_point(y) and y.dim() == 1:
        return nn.functional.one_hot(y.long(), outputs).to(dtype)
    return y.to(dtype).reshape(y.shape[0], outputs)


def output_linear(model: nn.Module, block: ParamBlock) -> nn.Linear | None:
    """The last module of a Sequential when it is a Linear with a bias and the block is exactly
    its whole weight and bias (then J(x) = I_K (x) x~^T, x~ = (the layer's input, 1), at any base
    point); else None."""
    if not isinstance(model, nn.Sequential) or len(model) == 0 or not isinstance(model[-1], nn.Linear):
        return None
    layer = model[-1]
    return layer if layer.bias is not None and block.is_whole(model, layer) else None


def outputs_and_inputs(lin: LinearizedModel, layer: nn.Linear, batch: Batch) -> tuple[Tensor, Tensor]:
    """(f(x; w_b), x~ = (input of ``layer``, 1) in float64 on the CPU) in one base-point pass."""
    seen: list[Tensor] = []
    handle = layer.register_forward_pre_hook(lambda _module, args: seen.append(args[0].detach()))
    try:
        f0 = lin.base_outputs(batch)
    finally:
        handle.remove()
    x = seen[0].reshape(f0.shape[0], -1).to("cpu", torch.float64)
    return f0, torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
