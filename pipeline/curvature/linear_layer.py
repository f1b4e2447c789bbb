"""Closed-form curvature of a Linear layer under softmax cross-entropy (the decision layer).

For logits z = W x + b (K classes, inputs x in R^d) and cross-entropy (with or without label
smoothing: the targets enter linearly), the Hessian of the loss in the logits is
M(x) = diag(p) - p p^T with p = softmax(z). With x~ = (x, 1) and theta_a = (W_a, b_a):

    d^2 loss / d theta_a d theta_b = M_ab(x) x~ x~^T,
    H(S) = sum_{x in S} M(x) (kron) x~ x~^T             (+ lambda I, |S| lambda I for a sum)

exactly the matrix the Hessian-vector products of ``pipeline.curvature.hessian.BlockHessian``
would assemble column by column, at 2 |S| K^2 (d+1)^2 flops in K matrix products instead of
K (d+1) passes of forward-over-reverse differentiation. It applies when the block is the whole
weight (and bias) of the last Linear of a Sequential whose earlier modules are frozen for the
removal (``pipeline.frozen_prefix``), the usual decision layer of a classifier head.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from pipeline.curvature.operators import LinearOperator
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.progress import tick
from pipeline.tasks import Task

__all__ = ["LinearCrossEntropyHessian", "closed_form_layer", "cpu_flags", "layer_order", "linear_cross_entropy_hessian",
           "native_bfloat16", "products_dtype"]


def closed_form_layer(model: nn.Module, task: Task, block: ParamBlock) -> nn.Linear | None:
    """The Linear layer when ``model`` (a suffix) is that one Linear under cross-entropy and the
    block is its whole weight and (if it has one) its whole bias; else None."""
    if getattr(task, "loss", None) != "cross_entropy":
        return None
    layers = [m for m in model.modules() if not isinstance(m, (nn.Sequential, nn.Identity))]
    if len(layers) != 1 or not isinstance(layers[0], nn.Linear):
        return None
    return layers[0] if block.is_whole(model, layers[0]) else None


def layer_order(block: ParamBlock, layer_names: dict[str, str], k: int, d: int) -> Tensor:
    """Flat block index -> index in the (class, input-with-bias) ordering a*(d+1) + i."""
    order: list[Tensor] = []
    for part in block.parts:
        if layer_names[part.name] == "weight":
            order.append((torch.arange(k)[:, None] * (d + 1) + torch.arange(d)[None, :]).reshape(-1))
        else:
            order.append(torch.arange(k) * (d + 1) + d)
    return torch.cat(order)


@torch.no_grad()
def linear_cross_entropy_hessian(weight: Tensor, bias: Tensor, names: dict[str, str], block: ParamBlock, x: Tensor,
                                 *, weight_decay: float, reduction: str, chunk: int = 4096) -> Tensor:
    """sum (or mean) over the rows of ``x`` of M(x) (kron) x~ x~^T at logits x W^T + b, plus the
    ridge, in the block's flat order; float64. ``names`` maps the block's parameter names to
    "weight" / "bias" (a layer without bias: ``bias`` zeros, and no bias part in the block)."""
    k, d = weight.shape
    dd = d + 1
    weight, bias = weight.to(torch.float64), bias.to(torch.float64)
    full = torch.zeros(k * dd, k * dd, dtype=torch.float64)
    for start in range(0, x.shape[0], chunk):
        xa = x[start:start + chunk].to(torch.float64)
        xa = torch.cat([xa, torch.ones(xa.shape[0], 1, dtype=torch.float64)], dim=1)   # x~
        p = torch.softmax(xa[:, :d] @ weight.T + bias, dim=1)
        for a in range(k):                                 # blocks b >= a; the rest by symmetry
            m_a = -p[:, a:a + 1] * p[:, a:]                # M_ab = p_a (delta_ab - p_b)
            m_a[:, 0] += p[:, a]
            right = (m_a[:, :, None] * xa[:, None, :]).reshape(xa.shape[0], (k - a) * dd)
            full[a * dd:(a + 1) * dd, a * dd:] += xa.T @ right
            tick(dd if start == 0 else 0, total=k * dd, phase="Hessian columns", unit="col")
    upper = torch.triu(torch.ones(k, k, dtype=torch.bool), diagonal=1)
    for a, b in upper.nonzero().tolist():
        full[b * dd:(b + 1) * dd, a * dd:(a + 1) * dd] = full[a * dd:(a + 1) * dd, b * dd:(b + 1) * dd].T
    order = layer_order(block, names, k, d)
    h = full.index_select(0, order).index_select(1, order)
    n = x.shape[0]
    if reduction == "mean":
        h /= n
        h.diagonal().add_(weight_decay)
    else:
        h.diagonal().add_(weight_decay * n)
    return h


class LinearCrossEntropyHessian(LinearOperator):
    """H_P(S) of the decision layer at the layer's current weights (captured when built):
    products matrix-free in closed form, H v = sum_x x~ (M(x) (Theta_v x~)) rearranged, at
    O(|S| K d) each; the dense matrix only when asked for (then kept)."""

    def __init__(self, model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, weight_decay: float,
                 *, reduction: str = "mean", batch_size: int = 4096, matrix: Tensor | None = None):
        layer = closed_form_layer(model, task, block)
        if layer is None:
            raise ValueError("the closed-form curvature needs a block that is one Linear layer under cross-entropy")
        if reduction not in ("sum", "mean"):
            raise ValueError("reduction must be 'sum' or 'mean'")
        self.names = {n: ("weight" if p is layer.weight else "bias") for n, p in model.named_parameters()}
        self.block, self.x = block, data.columns["x"]
        self.weight_decay, self.reduction, self.chunk = weight_decay, reduction, batch_size
        self.k, self.d = layer.out_features, layer.in_features
        self.order = layer_order(block, self.names, self.k, self.d)
        self.weight = layer.weight.detach().to(torch.float64).clone()
        self.bias = (layer.bias.detach().to(torch.float64).clone() if layer.bias is not None
                     else torch.zeros(self.k, dtype=torch.float64))
        n = self.x.shape[0]
        self.scale = 1.0 / n if reduction == "mean" else 1.0
        self.ridge = weight_decay if reduction == "mean" else weight_decay * n
        self.matrix = matrix
        self.dim = block.numel
        self.products = 0
        self._chunks: list[tuple[Tensor, Tensor]] | None = None

    def matvec(self, v: Tensor) -> Tensor:
        v = v.to(torch.float64)
        if self.matrix is not None:
            return self.matrix @ v
        theta = torch.zeros(self.k * (self.d + 1), dtype=torch.float64)
        theta[self.order] = v
        theta = theta.reshape(self.k, self.d + 1)
        out = torch.zeros_like(theta)
        if self._chunks is None:  # inputs and softmax at the captured weights, once for all products
            with torch.no_grad():
                self._chunks = []
                for start in range(0, self.x.shape[0], self.chunk):
                    xa = self.x[start:start + self.chunk].to(torch.float64)
                    self._chunks.append((xa, torch.softmax(xa @ self.weight.T + self.bias, dim=1)))
        with torch.no_grad():
            for xa, p in self._chunks:
                dz = xa @ theta[:, :-1].T + theta[:, -1]                  # J v: logits' change
                mz = p * dz - p * (p * dz).sum(dim=1, keepdim=True)      # M(x) J v
                out[:, :-1] += mz.T @ xa
                out[:, -1] += mz.sum(dim=0)
        self.products += 1
        return self.scale * out.reshape(-1)[self.order] + self.ridge * v

    def matmat(self, columns: Tensor) -> Tensor:
        if self.matrix is None:
            self.to_dense()
        return self.matrix @ columns.to(torch.float64)

    def to_dense(self, chunk: int = 256) -> Tensor:
        if self.matrix is None:  # at the captured weights, even if the layer has moved since
            self.matrix = linear_cross_entropy_hessian(
                self.weight, self.bias, self.names, self.block, self.x, weight_decay=self.weight_decay,
                reduction=self.reduction, chunk=self.chunk)
        return self.matrix


def products_dtype(layer: nn.Linear) -> torch.dtype:
    """Precision of the matrix-free Hessian products for ``layer``: the layer's own for float32
    (or narrower) weights, float64 otherwise."""
    return torch.float32 if layer.weight.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float64


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the Linux kernel lists them (empty elsewhere or unreadable);
    read once per process."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bfloat16(device: torch.device | str = "cpu") -> bool:
    """True where bfloat16 matrix products run in hardware, so a bfloat16 product costs less than a
    float32 one: CUDA with native bfloat16 (Ampere or later, emulation not counted); a CPU with
    AVX512-BF16 or AMX-BF16 and a oneDNN build. Elsewhere (AVX-512 without BF16, AVX2, other OS)
    they are emulated and slower, and False is returned."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return bool(torch.backends.mkldnn.is_available()) and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
