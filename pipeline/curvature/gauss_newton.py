"""One anchored Gauss-Newton step on every layer of a classifier head (hidden layers included).

A converged Newton solve on the decision layer alone (``pipeline.decision_layer_newton``) retrains
that layer over the hidden features the original computes; the hidden layers keep what the
forgotten samples taught them. This module moves them too, by one step of the anchored removal
of ``pipeline.methods.lfoci_newton`` over every weight of the head:

    L_{D\\U}(w) = (1/(n-m)) sum_{D\\U} loss + (lambda/2)||w||^2,   r0 = grad L_D(w)  (the anchor)
    grad L_{D\\U}(w) - r0 = -g_U,   g_U = (sum_U grad loss(w, z) - m mean_D grad loss(w, z)) / (n - m)
    w' = w + d,   d = (G_{D\\U} + (lambda + mu) I)^{-1} g_U

(the weight decay cancels in g_U). G is the generalised Gauss-Newton matrix of the cross-entropy,
G_S = (1/(n-m)) sum_{z in S} J_z^T M_z J_z with M = diag(p) - p p^T the loss Hessian in the
logits (Schraudolph 2002; Martens 2020, "New insights and perspectives on the natural gradient
method", section 8): positive semi-definite where the Hessian of a ReLU network is not. On a
single Linear layer G is the Hessian, and d is the Newton step.

Truncation (the step is a heuristic, never certified):
- Rows: tr M_z = 1 - sum_c p_c^2 is ~0 on the samples the model fits confidently, so the products
  run over the ``rows`` retained samples with the largest tr M_z (ranked once per model) and are
  still divided by n - m: the dropped samples' terms are ~0, not estimated by sampling.
- Solve: ``iterations`` steps of preconditioned CG from x0 = P^{-1} g_U, with P the eigenvalue-
  corrected Kronecker factorisation of G on D (EK-FAC, George et al. 2018, "Fast approximate
  natural gradient descent in a Kronecker-factored eigenbasis") plus (lambda + mu) I: per Linear
  layer with inputs a~ = (a, 1) and output-side vectors delta_c = J_out^T sqrt(p_c) (e_c - p),
      A = E[a~ a~^T] = Q_A diag Q_A^T,  G_out = E[sum_c delta_c delta_c^T] = Q_G diag Q_G^T,
      S = E[sum_c (Q_G^T delta_c)^2 (Q_A^T a~)^2^T]    (the diagonal of G in the basis Q_G (x) Q_A),
      P^{-1} V = Q_G ((Q_G^T V Q_A) / (S + lambda + mu)) Q_A^T   for V = [W | b] of the layer.
The factors, mean_D grad loss and the ranking are computed once per model (``HeadCurvature``);
a removal then passes over its m forgotten samples and the ``rows`` ranked samples only.

Where the ``rows`` kept hold less than ``min_trace_share`` of the retained trace (a head that fits
its data loosely spreads its curvature over most samples), G would be understated: no step.

Heads: an ``nn.Sequential`` of Linear layers and parameter-free modules (activations, Flatten,
Dropout in eval mode) under cross-entropy, usually the trainable head over cached features.
Memory: the samples per pass are sized from the memory budget (``pipeline.memory``) with the
factors' own arrays counted first; a budget that cannot hold one sample raises up front.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp

from pipeline import memory
from pipeline.curvature.operators import LinearOperator
from pipeline.curvature.pcg import pcg
from pipeline.data.sampleset import SampleSet
from pipeline.tasks import Task, output_logits

__all__ = ["HeadCurvature", "HeadGaussNewton", "HeadLayout", "GaussNewtonStep", "head_layout", "gauss_newton_step"]

# modules without parameters that act on each sample alone (eval mode)
_PARAMETER_FREE = (nn.Flatten, nn.Identity, nn.Dropout, nn.ReLU, nn.LeakyReLU, nn.GELU, nn.Tanh,
                   nn.Sigmoid, nn.SiLU, nn.ELU, nn.Softplus)


@dataclass(frozen=True)
class HeadLayout:
    """The head's Linear layers and the flat layout of their weights: layer after layer, each
    as its (out, in + 1) matrix [W | b] (no bias column for a layer without bias), row-major."""

    layers: tuple[tuple[str, nn.Linear], ...]
    chain: tuple[nn.Module, ...] = ()   # the head's modules in the order they run (nested Sequentials flattened)

    def shape(self, layer: nn.Linear) -> tuple[int, int]:
        return layer.out_features, layer.in_features + (layer.bias is not None)

    @property
    def numel(self) -> int:
        return sum(o * i for o, i in (self.shape(m) for _, m in self.layers))

    def parameter_names(self) -> list[str]:
        names = []
        for name, layer in self.layers:
            names.append(f"{name}.weight")
            if layer.bias is not None:
                names.append(f"{name}.bias")
        return names

    def matrices(self, flat: Tensor) -> list[Tensor]:
        """flat -> one (out, in + 1) view per layer."""
        out, start = [], 0
        for _, layer in self.layers:
            rows, cols = self.shape(layer)
            out.append(flat[start:start + rows * cols].view(rows, cols))
            start += rows * cols
        return out

    def to_parameters(self, flat: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        """flat -> {parameter name: tensor} in ``dtype``."""
        params = {}
        for (name, layer), mat in zip(self.layers, self.matrices(flat)):
            params[f"{name}.weight"] = mat[:, :layer.in_features].to(dtype)
            if layer.bias is not None:
                params[f"{name}.bias"] = mat[:, -1].to(dtype)
        return params

    def flatten(self, params: dict[str, Tensor]) -> Tensor:
        """{parameter name: tensor} -> flat float64."""
        parts = []
        for name, layer in self.layers:
            mat = params[f"{name}.weight"].to(torch.float64)
            if layer.bias is not None:
                mat = torch.cat([mat, params[f"{name}.bias"].to(torch.float64)[:, None]], 1)
            parts.append(mat.reshape(-1))
        return torch.cat(parts)


def head_layout(model: nn.Module, task: Task) -> HeadLayout:
    """The layout of a head made of Linear layers and parameter-free modules under
    cross-entropy; ValueError naming what is not."""
    if getattr(task, "loss", None) != "cross_entropy":
        raise ValueError(f"the head Gauss-Newton step needs the cross-entropy loss (the task has '{task.loss}'); "
                         "use method decision-layer-newton (no hidden step)")
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"the head Gauss-Newton step covers an nn.Sequential head of Linear layers and parameter-free "
                         f"modules; this model is a {type(model).__name__}: use method decision-layer-newton (no hidden step), or give the head "
                         "alone over cached features")
    chain = tuple(_run_order(model))
    if len({id(m) for m in chain}) != len(chain):
        raise ValueError("the head Gauss-Newton step needs each module of the head to run once; this head calls one "
                         "module instance twice: give each position its own module, or use method decision-layer-newton (no hidden step)")
    other = sorted({type(m).__name__ for m in chain if not isinstance(m, (nn.Linear, *_PARAMETER_FREE))})
    if other:
        raise ValueError(f"the head Gauss-Newton step covers a head of Linear layers and parameter-free modules; "
                         f"this model also has {', '.join(other)}: use method decision-layer-newton (no hidden step), or give the head alone "
                         "over cached features")
    devices = sorted({str(p.device) for p in model.parameters()})
    if devices and devices != ["cpu"]:
        raise ValueError(f"the head Gauss-Newton step runs on a head held on the CPU (this one is on {devices}); "
                         "move the head to the CPU or use method decision-layer-newton (no hidden step)")
    frozen = sorted(name for name, p in model.named_parameters() if not p.requires_grad)
    if frozen:
        raise ValueError(f"the head Gauss-Newton step moves every weight of the head, and {frozen} are frozen "
                         "(requires_grad False): give the trainable head alone, or use method decision-layer-newton (no hidden step)")
    layers = tuple((name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear))
    if not layers:
        raise ValueError("the head Gauss-Newton step found no Linear layer in the model; use method decision-layer-newton (no hidden step)")
    return HeadLayout(layers, chain)


def _run_order(module: nn.Module) -> list[nn.Module]:
    """The leaf modules of a (nested) Sequential in the order they run, repeats kept
    (``nn.Module.modules()`` drops a module instance it has already seen)."""
    if not isinstance(module, nn.Sequential):
        return [module]
    return [leaf for child in module._modules.values() if child is not None for leaf in _run_order(child)]


def rows_per_pass(layout: HeadLayout, classes: int, batch_size: int,
                  budget: "memory.MemoryBudget | None" = None) -> int:
    """Samples per pass within the budget: fixed = the float64 factors (A and Q_A, G and Q_G, S and
    the mean gradient, with eigh's work copies: 3 of each); per sample = the K class deltas and
    the float64 inputs, their rotations and the autograd buffers of the pass (2x the layer widths
    in the model's precision, counted as float64)."""
    budget = memory.available_in(budget or memory.current_budget())
    fixed, per_row = _pass_bytes(layout, classes)
    return memory.chunk_size(budget, per_row, fixed, limit=batch_size, what="sample's Gauss-Newton pass",
                             fix="use method decision-layer-newton (no hidden step)")


def _pass_bytes(layout: HeadLayout, classes: int) -> tuple[int, int]:
    shapes = [layout.shape(m) for _, m in layout.layers]
    fixed = 8 * sum(3 * i * i + 3 * o * o + 3 * o * i for o, i in shapes)
    per_row = 8 * sum((classes + 2) * o + 3 * i for o, i in shapes)
    return fixed, per_row


def _with_ones(a: Tensor, bias: bool) -> Tensor:
    return torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1) if bias else a


class _Capture:
    """Forward hooks keeping each Linear layer's input and output of the last call."""

    def __init__(self, layout: HeadLayout):
        self.layout = layout
        self.inputs: list[Tensor] = [torch.empty(0)] * len(layout.layers)
        self.outputs: list[Tensor] = [torch.empty(0)] * len(layout.layers)
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, (_, layer) in enumerate(layout.layers)]

    def _hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            self.inputs[i], self.outputs[i] = args[0].detach(), output
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _flat_gradient(output_grads: tuple[Tensor, ...], inputs: list[Tensor]) -> Tensor:
    """The loss gradient of every layer's [W | b] on the flat layout (float64) from the gradients
    at the layers' outputs and their inputs a~: dL/d[W | b] = (dL/d out)^T a~."""
    return torch.cat([(go.to(torch.float64).T @ a).reshape(-1) for go, a in zip(output_grads, inputs)])


def _class_deltas(logits: Tensor, p: Tensor, outputs: list[Tensor]) -> list[list[Tensor]]:
    """For each class c: delta_c at every layer's output, J_out^T sqrt(p_c) (e_c - p), float64."""
    k = p.shape[1]
    eye = torch.eye(k, dtype=p.dtype)
    per_class = []
    for c in range(k):
        seed = (eye[c][None, :] - p) * p[:, c:c + 1].sqrt()
        grads = torch.autograd.grad(logits, outputs, grad_outputs=seed.to(logits.dtype), retain_graph=True)
        per_class.append([g.detach().to(torch.float64) for g in grads])
    return per_class


@dataclass
class LayerFactors:
    """EK-FAC of the Gauss-Newton matrix on D for one Linear layer (module docstring)."""

    q_in: Tensor     # Q_A, (in + 1, in + 1)
    q_out: Tensor    # Q_G, (out, out)
    scale: Tensor    # S, (out, in + 1): the diagonal of G in the Kronecker eigenbasis

    def solve(self, v: Tensor, ridge: float) -> Tensor:
        """(EK-FAC + ridge I)^{-1} v for v = [W | b] of the layer, (out, in + 1), in the factors'
        precision (the model's: a preconditioner only steers CG), returned as float64."""
        v = v.to(self.q_in.dtype)
        return (self.q_out @ ((self.q_out.T @ v @ self.q_in) / (self.scale + ridge)) @ self.q_in.T).to(torch.float64)


@dataclass
class HeadCurvature:
    """What a Gauss-Newton step needs from D, at the weights it was computed at (once per model;
    the caller binds it to those weights and data): the EK-FAC factors of every Linear layer,
    mean_D grad loss (no weight decay) and tr M_z."""

    factors: list[LayerFactors]
    mean_gradient: Tensor           # flat float64 (HeadLayout order)
    curvature_trace: Tensor         # (n,) float64: 1 - sum_c p_c^2 per training sample
    seconds: float = 0.0
    details: dict[str, float] = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def prepare(cls, model: nn.Module, task: Task, train: SampleSet, batch_size: int = 4096) -> "HeadCurvature":
        """Two passes over D: A, G, mean gradient and tr M; then S in the eigenbases. The factors'
        products run in the model's precision (they only precondition) and are summed in float64;
        the mean gradient is float64 throughout."""
        started = time.perf_counter()
        layout = head_layout(model, task)
        work = next(model.parameters()).dtype
        batch_size = rows_per_pass(layout, layout.layers[-1][1].out_features, batch_size)
        return cls._prepare(model, task, train, layout, work, batch_size, started)

    @classmethod
    def _prepare(cls, model: nn.Module, task: Task, train: SampleSet, layout: HeadLayout, work: torch.dtype,
                 batch_size: int, started: float) -> "HeadCurvature":
        n = len(train)
        a_acc = [torch.zeros(i, i, dtype=torch.float64) for i in (layout.shape(m)[1] for _, m in layout.layers)]
        g_acc = [torch.zeros(o, o, dtype=torch.float64) for o in (layout.shape(m)[0] for _, m in layout.layers)]
        grad_sum = torch.zeros(layout.numel, dtype=torch.float64)
        trace = torch.empty(n, dtype=torch.float64)
        capture = _Capture(layout)
        try:
            start = 0
            for batch in train.batches(batch_size):
                size = task.batch_size_of(batch)
                with torch.enable_grad():
                    logits, p, inputs = _pass(model, task, batch, capture)
                    loss = task.per_sample_loss(logits, batch).sum()
                    out_grads = torch.autograd.grad(loss, capture.outputs, retain_graph=True)
                    per_class = _class_deltas(logits, p, capture.outputs)
                grad_sum += _flat_gradient(out_grads, inputs)
                trace[start:start + size] = 1.0 - (p * p).sum(1)
                for li, a in enumerate(inputs):
                    a = a.to(work)
                    a_acc[li] += (a.T @ a).to(torch.float64)
                    for c in range(len(per_class)):
                        d = per_class[c][li]
                        g_acc[li] += d.T @ d
                start += size
            t_kfac = time.perf_counter() - started
            eig_in = [torch.linalg.eigh(a / n)[1].to(work) for a in a_acc]
            eig_out = [torch.linalg.eigh(g / n)[1].to(work) for g in g_acc]
            scale = [torch.zeros(layout.shape(m), dtype=torch.float64) for _, m in layout.layers]
            for batch in train.batches(batch_size):
                with torch.enable_grad():
                    logits, p, inputs = _pass(model, task, batch, capture)
                    per_class = _class_deltas(logits, p, capture.outputs)
                for li, a in enumerate(inputs):
                    a_rot = (a.to(work) @ eig_in[li]) ** 2
                    d_sq = sum((per_class[c][li].to(work) @ eig_out[li]) ** 2 for c in range(len(per_class)))
                    scale[li] += (d_sq.T @ a_rot).to(torch.float64)
        finally:
            capture.close()
        factors = [LayerFactors(qi, qo, (s / n).to(work)) for qi, qo, s in zip(eig_in, eig_out, scale)]
        # one product on two samples: a process's first torch.func transforms cost tens of ms to set
        # up; a serving process pays that here, once, not in its first removal
        HeadGaussNewton(model, task, train.take(torch.arange(min(2, n))), layout, divisor=1.0,
                        ridge=0.0).matvec(torch.zeros(layout.numel, dtype=torch.float64))
        seconds = time.perf_counter() - started
        return cls(factors, grad_sum / n, trace, seconds,
                   {"factors_and_gradient": t_kfac, "eigenbasis_diagonal": seconds - t_kfac})

    def precondition(self, layout: HeadLayout, v: Tensor, ridge: float) -> Tensor:
        out = torch.empty_like(v)
        for f, src, dst in zip(self.factors, layout.matrices(v), layout.matrices(out)):
            dst.copy_(f.solve(src, ridge))
        return out


def _pass(model: nn.Module, task: Task, batch: dict[str, Tensor], capture: _Capture
          ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Forward pass keeping each layer's input a~ (float64, with the ones column) and output;
    p = softmax(logits) in float64. The input is made to require grad so that the layer outputs
    have a graph to the logits whatever the parameters' requires_grad."""
    batch = dict(batch)
    x = batch.get("x")
    if x is not None and x.is_floating_point():
        batch["x"] = x.detach().requires_grad_(True)
    logits = task.forward(model, batch)
    p = torch.softmax(logits.detach().to(torch.float64), 1)
    for a, (name, _) in zip(capture.inputs, capture.layout.layers):
        if a.dim() != 2:
            raise ValueError(f"the head Gauss-Newton step needs every Linear layer to see one vector per sample; "
                             f"'{name}' sees inputs of shape {tuple(a.shape)}: use method decision-layer-newton (no hidden step)")
    inputs = [_with_ones(a.to(torch.float64), layer.bias is not None)
              for a, (_, layer) in zip(capture.inputs, capture.layout.layers)]
    return logits, p, inputs


class HeadGaussNewton(LinearOperator):
    """v -> (1/divisor) sum_{z in rows} J_z^T M_z J_z v + ridge v on the head's flat layout
    (``HeadLayout``), exact: J v by forward-mode through the chain over the inputs each module saw
    (kept from one forward pass: a Linear's tangent is t W^T + x V_W^T + V_b, a parameter-free
    module's is ``torch.func.jvp`` of it alone), J^T u by one reverse pass linearised once
    (``torch.func.vjp``); products in the model's precision, vectors float64."""

    def __init__(self, model: nn.Module, task: Task, rows: SampleSet, layout: HeadLayout, *, divisor: float,
                 ridge: float, batch_size: int = 4096):
        self.layout, self.dim = layout, layout.numel
        self.scale, self.ridge = 1.0 / divisor, ridge
        self.products = 0
        named = dict(model.named_parameters())
        self.dtype = named[layout.parameter_names()[0]].dtype
        self.primals = {k: named[k].detach() for k in layout.parameter_names()}
        self.names = {id(layer): name for name, layer in layout.layers}
        frozen = {k: v.detach() for k, v in named.items() if k not in self.primals}
        self.chunks: list[tuple[list[Tensor], Tensor, Any]] = []
        for batch in rows.batches(batch_size):
            args, kwargs = task.model_args(batch)

            def logits_of(params: dict[str, Tensor], args: Any = args, kwargs: Any = kwargs) -> Tensor:
                return output_logits(functional_call(model, {**frozen, **params}, args, kwargs))

            logits, pullback = vjp(logits_of, self.primals)
            with torch.no_grad():
                seen, x = [], args[0]
                for module in layout.chain:
                    seen.append(x)
                    x = module(x)
            self.chunks.append((seen, torch.softmax(logits.detach(), 1), pullback))

    def _tangent(self, seen: list[Tensor], tangents: dict[str, Tensor]) -> Tensor:
        """J v: the logits' tangent for the parameter tangent ``tangents``."""
        t: Tensor | None = None
        for module, x in zip(self.layout.chain, seen):
            if isinstance(module, nn.Linear):
                name = self.names[id(module)]
                out = x @ tangents[f"{name}.weight"].T
                if module.bias is not None:
                    out = out + tangents[f"{name}.bias"]
                t = out if t is None else out + t @ module.weight.detach().T
            elif t is not None:
                t = jvp(module, (x,), (t,))[1]
        assert t is not None  # head_layout found a Linear layer
        return t

    @torch.no_grad()
    def matvec(self, v: Tensor) -> Tensor:
        tangents = self.layout.to_parameters(v, self.dtype)
        total = torch.zeros(self.dim, dtype=torch.float64)
        for seen, p, pullback in self.chunks:
            jv = self._tangent(seen, tangents)
            u = p * jv - p * (p * jv).sum(1, keepdim=True)          # M J v
            (back,) = pullback(u)
            total += self.layout.flatten(back)
        self.products += 1
        return self.scale * total + self.ridge * v


@dataclass
class GaussNewtonStep:
    """d on the head's layout ({parameter name: tensor}, float64) and what produced it."""

    delta: dict[str, Tensor]
    record: dict[str, Any]


def gauss_newton_step(model: nn.Module, task: Task, train: SampleSet, forget_positions: Tensor,
                      weight_decay: float, *, rows: int, iterations: int, damping: float = 0.0,
                      min_trace_share: float = 0.9, prepared: HeadCurvature | None = None,
                      batch_size: int = 4096, minimiser: bool = False) -> GaussNewtonStep:
    """d = (G_{D\\U} + (lambda + mu) I)^{-1} g_U, truncated (module docstring); ``minimiser``: the
    step towards grad L_{D\\U} = 0 instead, d = -(G_{D\\U} + (lambda + mu) I)^{-1} grad L_{D\\U}(w) with
    grad L_{D\\U}(w) = mean_D grad loss + lambda w - g_U. ``iterations``
    PCG steps from x0 = P^{-1} g_U, products over the ``rows`` retained samples of largest tr M.

    The truncation assumes the rows left out carry ~0 curvature. Where the ``rows`` kept hold less
    than ``min_trace_share`` of the retained trace (a model that fits its data loosely: the
    curvature is spread over most samples), G would be understated by the rest and the step
    inflated in its directions: no step is taken (empty ``delta``) and the record says why. (On
    Fashion-MNIST's head, 52-55% of the trace in the rows kept still made every removal worse; R8's
    MiniLM head keeps 92-94%.)"""
    started = time.perf_counter()
    if not weight_decay + damping > 0:
        raise ValueError(f"the head Gauss-Newton system needs a ridge: weight decay {weight_decay:g} + "
                         f"hidden_step_damping {damping:g} must be > 0 (G is singular on dead units and unseen "
                         "directions); set hidden_step_damping > 0")
    layout = head_layout(model, task)
    batch_size = rows_per_pass(layout, layout.layers[-1][1].out_features, batch_size)
    prepared_here = prepared is None
    if prepared is None:
        prepared = HeadCurvature.prepare(model, task, train, batch_size)
    n, m = len(train), int(forget_positions.numel())
    keep = torch.ones(n, dtype=torch.bool)
    keep[forget_positions] = False
    trace = torch.where(keep, prepared.curvature_trace, torch.full_like(prepared.curvature_trace, -math.inf))
    count = min(rows, n - m)
    picked = torch.topk(trace, count).indices.sort().values
    kept_share = float(prepared.curvature_trace[picked].sum() / prepared.curvature_trace[keep].sum().clamp_min(1e-300))
    record: dict[str, Any] = {
        "equation": ("w' = w - (G_{D\\U} + (lambda + mu) I)^{-1} grad L_{D\\U}(w)" if minimiser else
                     "w' = w + (G_{D\\U} + (lambda + mu) I)^{-1} (sum_U grad loss - m mean_D grad loss) / (n - m)"),
        "curvature": "generalised Gauss-Newton J^T (diag p - p p^T) J of the cross-entropy",
        "rows": count, "rows_trace_share": kept_share, "min_trace_share": min_trace_share,
        "prepared": "computed in this removal" if prepared_here else "prepared for these weights and data",
        "preparation_seconds": prepared.seconds if prepared_here else 0.0,
    }
    if kept_share < min_trace_share:
        record["skipped"] = (f"the {count} retained samples of largest curvature hold {100 * kept_share:.1f}% of the "
                             f"retained curvature trace (needs {100 * min_trace_share:.0f}%): the truncated Gauss-Newton "
                             "matrix would understate the curvature, so no hidden step was taken")
        record["seconds"] = time.perf_counter() - started
        return GaussNewtonStep({}, record)
    # the operator keeps every pass's activations and pullback: all ``count`` rows at once
    fixed, per_row = _pass_bytes(layout, layout.layers[-1][1].out_features)
    memory.chunk_size(memory.available_in(memory.current_budget()), count * per_row, fixed, limit=1,
                      what=f"set of {count} Gauss-Newton rows", fix="lower hidden_step_rows or use method decision-layer-newton (no hidden step)")
    forget = train.take(forget_positions)
    ridge = weight_decay + damping
    capture = _Capture(layout)
    try:
        forget_sum = torch.zeros(layout.numel, dtype=torch.float64)
        for batch in forget.batches(batch_size):
            with torch.enable_grad():
                logits, _, inputs = _pass(model, task, batch, capture)
                loss = task.per_sample_loss(logits, batch).sum()
                out_grads = torch.autograd.grad(loss, capture.outputs)
            forget_sum += _flat_gradient(out_grads, inputs)
    finally:
        capture.close()
    g_u = (forget_sum - m * prepared.mean_gradient) / (n - m)
    if minimiser:
        weights = layout.flatten({k: v.detach() for k, v in model.named_parameters()}).to(torch.float64)
        g_u = g_u - prepared.mean_gradient - weight_decay * weights  # -grad L_{D\\U}(w)
    op = HeadGaussNewton(model, task, train.take(picked), layout, divisor=n - m, ridge=ridge,
                         batch_size=batch_size)

    def precondition(v: Tensor) -> Tensor:
        return prepared.precondition(layout, v, ridge)

    # ``iterations`` PCG steps from the EK-FAC solution x0 = P^{-1} g_U (exactly that many, unless the
    # residual vanishes first)
    solved = pcg(op.matvec, g_u, precondition=precondition, x0=precondition(g_u), max_iter=iterations)
    direction, relative = solved.x, solved.relative_residual
    notes = ([] if solved.rayleigh is None else  # cannot happen for G + ridge I with ridge > 0; never hidden
             [f"non-positive curvature {solved.rayleigh:.3e} at iteration {solved.iterations + 1}: stopped there"])
    record.update({
        "preconditioner": "EK-FAC of the Gauss-Newton matrix on D",
        "iterations": iterations, "products": op.products,
        "relative_residual": relative, "notes": list(notes),
        "ridge": ridge, "damping": damping, "step_norm": float(direction.norm()),
        "forget_gradient_norm": float(g_u.norm()),
        "seconds": time.perf_counter() - started,
    })
    delta = {k: v.to(torch.float64) for k, v in layout.to_parameters(direction, torch.float64).items()}
    return GaussNewtonStep(delta, record)
