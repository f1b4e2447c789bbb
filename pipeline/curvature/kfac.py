"""A Kronecker-factored approximation (K-FAC) of a block's Gauss-Newton matrix and its damped inverse:
the preconditioner of the trust region's Gauss-Newton solves (``pipeline.methods.trust_region``).

For a Linear layer z = W a (+ b) inside a network and the cross-entropy's Gauss-Newton matrix over
samples S (mean), G_W = (1/|S|) sum_n J_n^T (diag p_n - p_n p_n^T) J_n. Martens & Grosse (2015,
"Optimizing neural networks with Kronecker-factored approximate curvature", sections 3 and 5):
    G_W ~ Gm (x) A,   Gm = (1/|S|) sum_n delta_n delta_n^T,   A = (1/|S|) sum_n a_n a_n^T,
with delta_n the loss gradient at the layer's output for a label drawn from the model's own softmax,
y~ ~ p_n: E[(p - e_y~)(p - e_y~)^T] = diag p - p p^T, so the draw is unbiased for the class sum.
Weight sharing (conv positions, token positions; KFC, Grosse & Martens 2016; "K-FAC-expand",
Eschenhagen et al. 2023): a_{n,t}, delta_{n,t} at the T positions of sample n,
    A = (1/(|S| T)) sum_{n,t} a_{n,t} a_{n,t}^T,    Gm = (1/|S|) sum_{n,t} delta_{n,t} delta_{n,t}^T,
a convolution's a_{n,t} being the unfolded input patch (channel-major, the weight's row layout).
Rows R of a layer (a row-sliced block): Gm_RR (x) A. A bias part: its exact Gauss-Newton matrix for
the drawn labels, (1/|S|) sum_n (sum_t delta_{n,t,R}) (sum_t delta_{n,t,R})^T. Parts are blocks of a
block-diagonal matrix (the weight and the bias of one layer too).

Damped inverse (exact for the Kronecker product, through the factors' eigenbases):
    (Gm (x) A + d I)^{-1} vec(V) = vec(V / d + Q_G ((Q_G^T V Q_A) * (1 / (l_G l_A^T + d) - 1 / d)) Q_A^T),
which holds for a thin Q_A too: a Linear wider than 1,024 that sees fewer input rows than it has columns
takes A's eigenbasis from the rows' Gram matrix (A's other eigenvalues are 0); factors wider than 1,024
are decomposed in float32 (a preconditioner: eigenvalues clamped at 0).
Any other part (a norm's scale, an embedding), one whose factors would not fit half of what the memory
budget leaves (less the factors kept before it), or one whose module's forward never runs (a parent calls
its weights functionally: MultiheadAttention's out_proj): a scalar c I, c = (1/(|S| |part|)) sum_batches ||g_B||^2 with g_B the part's
gradient of a batch's summed loss at the drawn labels (per-sample gradients at drawn labels have
mean zero and are independent, so ||g_B||^2 is unbiased for the sum of their squared norms: an
estimate of tr G_part / |part|). Cost: one forward and one backward pass over S.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from pipeline import memory
from pipeline.curvature.hessian import gradient_batch_size
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import BlockPart, ParamBlock
from pipeline.tasks import Task, output_logits

__all__ = ["BlockKFAC", "KroneckerPart", "LABELS", "ScalarPart", "unsupported_loss"]

#: sampled: one label per sample drawn from the softmax (one backward pass); exact: the class sum,
#: K backward passes with seeds sqrt(p_c) (e_c - p) (each sample's seeds times a random sign, so the
#: scalar parts' batch squares stay unbiased)
LABELS = ("sampled", "exact")


def unsupported_loss(task: Task) -> str | None:
    """None when K-FAC can draw the task's labels (cross-entropy: a softmax), else why not."""
    loss = getattr(task, "loss", None)
    return None if loss == "cross_entropy" else (
        f"K-FAC draws labels from a softmax (cross-entropy); the task's loss is '{loss}'")


def _seeds(logits: Tensor, labels: str, gen: torch.Generator) -> list[Tensor]:
    """The output-side vectors at the logits whose pullbacks give the deltas: for a drawn label y~,
    p - e_y~ (the cross-entropy's gradient); for the class sum, s_n sqrt(p_c) (e_c - p), s_n = +-1."""
    probs = torch.softmax(logits.to(torch.float64), -1)
    flat = probs.reshape(-1, probs.shape[-1]).cpu()
    k = flat.shape[-1]
    if labels == "sampled":
        drawn = torch.multinomial(flat, 1, generator=gen).squeeze(1)
        seed = flat - F.one_hot(drawn, k).to(flat.dtype)
        return [seed.reshape(logits.shape).to(logits.device, logits.dtype)]
    signs = torch.randint(0, 2, (flat.shape[0], 1), generator=gen).to(flat.dtype) * 2 - 1
    eye = torch.eye(k, dtype=flat.dtype)
    return [(signs * flat[:, c:c + 1].sqrt() * (eye[c][None, :] - flat)).reshape(logits.shape).to(logits.device, logits.dtype)
            for c in range(k)]


@dataclass
class KroneckerPart:
    """Gm_RR (x) A of one weight part, through its eigenbases (rows: the part's rows, columns: A's side)."""

    q_out: Tensor      # (|R|, r): r = |R|, or a thin basis (rows whose outputs never move the loss left out)
    l_out: Tensor      # (|R|,)
    q_in: Tensor       # (k, r): r = k, or a thin basis of A's range (A's other eigenvalues are 0)
    l_in: Tensor       # (r,)

    def _apply(self, v: Tensor, scale: Tensor) -> Tensor:
        mat = v.view(self.q_out.shape[0], -1)
        return (self.q_out @ ((self.q_out.T @ mat @ self.q_in) * scale) @ self.q_in.T).reshape(-1)

    def solve(self, v: Tensor, damping: float) -> Tensor:
        """v / d + Q ((1 / (l_G l_A^T + d) - 1 / d) * Q^T v): A's eigenvalues outside a thin basis are 0."""
        outer = self.l_out[:, None] * self.l_in[None, :]
        return v / damping + self._apply(v, -outer / (damping * (outer + damping)))

    def product(self, v: Tensor) -> Tensor:
        return self._apply(v, self.l_out[:, None] * self.l_in[None, :])


@dataclass
class ScalarPart:
    """c I of one part."""

    scale: float

    def solve(self, v: Tensor, damping: float) -> Tensor:
        return v / (self.scale + damping)

    def product(self, v: Tensor) -> Tensor:
        return self.scale * v


@dataclass
class _LayerSums:
    """The running sums of one layer's factors (float64)."""

    module: nn.Module
    weight: BlockPart | None = None
    bias: BlockPart | None = None
    a: Tensor | None = None           # sum a a^T over samples and positions
    g: Tensor | None = None           # sum delta_R delta_R^T over samples and positions
    gb: Tensor | None = None          # sum (sum_t delta_Rb)(...)^T over samples
    positions: int = 0                # T, positions per sample (after the first batch)
    rows: list[Tensor] | None = None  # a wide Linear's input rows while fewer than its width (the thin route)
    rows_count: int = 0
    calls: int = 0                    # forward calls seen
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)


def _supported(module: nn.Module) -> str | None:
    """None when K-FAC covers the module's weight and bias, else why not."""
    if isinstance(module, nn.Linear):
        return None
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            return "grouped convolution"
        if isinstance(module.padding, str) or module.padding_mode != "zeros":
            return f"convolution padding {module.padding!r} ({module.padding_mode})"
        return None
    return f"no Kronecker factors for {type(module).__name__}"


def _row_count(part: BlockPart | None) -> int:
    """The rows of a part in the block (0 without the part)."""
    return 0 if part is None else part.numel // part.row_size


def _factor_bytes(module: nn.Module, weight: BlockPart | None, bias: BlockPart | None) -> int:
    """The float64 factors of a layer with eigh's work copies (3 of each)."""
    rows, brows = _row_count(weight), _row_count(bias)
    cols = 0 if weight is None else weight.row_size
    return 8 * 3 * (rows * rows + cols * cols + brows * brows)


#: samples whose convolution patches are unfolded at once
_PATCH_SAMPLES = 64
#: a Linear layer wider than this keeps its input rows while they are fewer than its width: A = X^T X / (n T)
#: then has rank <= rows and its eigenbasis comes from the rows' Gram matrix X X^T (exact, and cheaper)
_THIN_MIN_WIDTH = 1024
#: factors (and thin Gram matrices) wider than this are decomposed in float32 (eigh of a 3,136-wide float64
#: factor takes ~10 s on one core, float32 about 4 s; K-FAC is an approximation, its eigenvalues clamped at 0)
_EIGH_FLOAT64_MAX = 1024


def _decompose(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """eigh of a symmetric PSD matrix as a basis of the coordinates its range can reach, in the dtype it ran in:
    a coordinate whose diagonal entry is 0 (an input channel that is always 0, a row whose output never moves the
    loss, a sample row of zeros) has a zero row and column in a PSD matrix, so it only adds the eigenvalue 0 with
    a unit eigenvector; those are left out (the basis is thin: directions outside it have eigenvalue 0, as the
    damped inverse assumes) and eigh runs on the rest, in float32 above ``_EIGH_FLOAT64_MAX`` columns. LAPACK's
    float32 eigh can fail to converge on a matrix with many repeated eigenvalues; float64 is then used."""
    live = matrix.diagonal() > 0
    index = None if bool(live.all()) else live.nonzero().squeeze(1)
    sub = matrix if index is None else matrix[index][:, index]
    work = sub if sub.shape[0] <= _EIGH_FLOAT64_MAX else sub.to(torch.float32)
    try:
        values, vectors = torch.linalg.eigh(work)
    except torch.linalg.LinAlgError:
        if work.dtype == torch.float64:
            raise
        values, vectors = torch.linalg.eigh(sub.to(torch.float64))
    if index is not None:
        full = vectors.new_zeros(matrix.shape[0], vectors.shape[1])
        full[index] = vectors
        vectors = full
    return values, vectors


def _eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """(eigenvalues >= 0, eigenvectors) of a symmetric PSD factor, float64 out (``_decompose``)."""
    values, vectors = _decompose(matrix)
    return values.to(torch.float64).clamp_min(0), vectors.to(torch.float64)


def _thin_eigh(rows: Tensor, divisor: int) -> tuple[Tensor, Tensor]:
    """The nonzero eigenpairs of A = X^T X / divisor from X's m < k rows: X X^T = V diag(s) V^T (``_decompose``)
    gives A's eigenvalues s / divisor and its eigenvectors X^T V s^{-1/2} (float64)."""
    x = rows.to(torch.float64 if rows.shape[0] <= _EIGH_FLOAT64_MAX else torch.float32)
    eps = torch.finfo(x.dtype).eps  # the Gram matrix's rounding
    s, v = _decompose(x @ x.T)
    x = x.to(v.dtype)  # float64 where float32's eigh did not converge
    # below m eps of the largest, an eigenvalue is rounding: X^T v s^{-1/2} would not be a unit vector
    floor = float(s.max()) if s.numel() else 0.0
    keep = s > max(floor, 1e-300) * max(1e-12, x.shape[0] * eps)
    s, v = s[keep], v[:, keep]
    return (s / divisor).to(torch.float64), ((x.T @ v) / s.sqrt()).to(torch.float64)


def _patches(module: nn.Module, a: Tensor) -> Tensor:
    """A layer's input as (B, T, k): Linear rows over their leading positions, a convolution's unfolded patches."""
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(a, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride)
        return cols.transpose(1, 2)
    return a.reshape(a.shape[0], -1, a.shape[-1])


def _output_rows(module: nn.Module, g: Tensor) -> Tensor:
    """A layer's output gradient as (B, T, out)."""
    if isinstance(module, nn.Conv2d):
        return g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2)
    return g.reshape(g.shape[0], -1, g.shape[-1])


class BlockKFAC:
    """K-FAC of G_P(S) on a block (module docstring); ``solve(v, d)`` = (K + d I)^{-1} v on the block's
    flat layout (CPU float64). ``seed`` draws the labels."""

    def __init__(self, model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, *, seed: int,
                 batch_size: int = 1024, labels: str = "sampled"):
        started = time.perf_counter()
        if labels not in LABELS:
            raise ValueError(f"labels must be one of {LABELS} (got {labels!r})")
        why_not = unsupported_loss(task)
        if why_not is not None:
            raise ValueError(why_not)
        if len(data) == 0:
            raise ValueError("K-FAC needs at least one sample")
        self.block = block
        modules = dict(model.named_modules())
        layers: dict[str, _LayerSums] = {}
        self.reasons: dict[str, str] = {}
        room = memory.available_in(memory.current_budget()).bytes / 2
        for part in block.parts:
            owner, _, attr = part.name.rpartition(".")
            module = modules.get(owner)
            why = None if module is None else _supported(module)
            if module is None or attr not in ("weight", "bias"):
                why = "not a layer's weight or bias"
            if why is None:
                layer = layers.setdefault(owner, _LayerSums(module))
                setattr(layer, attr, part)
                if attr == "weight" and isinstance(module, nn.Linear) and module.in_features > _THIN_MIN_WIDTH:
                    layer.rows = []
                continue
            self.reasons[part.name] = why
        for owner in list(layers):
            layer = layers[owner]
            need = _factor_bytes(layer.module, layer.weight, layer.bias)
            if need > room:
                for part in (layer.weight, layer.bias):
                    if part is not None:
                        self.reasons[part.name] = (f"its factors ({memory.format_bytes(need)}) exceed half of what the "
                                                   "memory budget leaves, less the factors kept before it")
                del layers[owner]
            else:
                room -= need
        self._layers = layers
        self._parts: dict[str, KroneckerPart | ScalarPart] = {}
        self.labels = labels
        batch_size = gradient_batch_size(model, task, data, block, batch_size)
        self._accumulate(model, task, data, seed, batch_size, labels)
        self.seconds = time.perf_counter() - started

    # -- the pass ---------------------------------------------------------------------------------
    def _accumulate(self, model: nn.Module, task: Task, data: SampleSet, seed: int, batch_size: int,
                    labels: str) -> None:
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = {n: b.detach() for n, b in model.named_buffers()}
        # the block's parameters as leaves: the layers' outputs then carry gradients; every part's batch squares
        # are summed (the scalar of a part without factors, and of a layer whose forward never runs)
        leaves = {p.name: params[p.name].clone().requires_grad_(True) for p in self.block.parts}
        parts = {p.name: p for p in self.block.parts}
        handles = [layer.module.register_forward_hook(self._hook(layer)) for layer in self._layers.values()]
        squares = {n: 0.0 for n in parts}
        gen = torch.Generator().manual_seed(seed)
        try:
            for batch in data.batches(batch_size):
                for layer in self._layers.values():
                    layer.inputs.clear()
                    layer.outputs.clear()
                args, kwargs = task.model_args(batch)
                with torch.enable_grad():
                    logits = output_logits(functional_call(model, {**params, **leaves, **buffers}, args, kwargs))
                    seeds = _seeds(logits.detach(), labels, gen)
                    outputs = [o for layer in self._layers.values() for o in layer.outputs]
                    wrt = outputs + list(leaves.values())
                    for i, seed_c in enumerate(seeds):
                        grads = torch.autograd.grad(logits, wrt, grad_outputs=seed_c, allow_unused=True,
                                                    retain_graph=i + 1 < len(seeds))
                        it = iter(grads)
                        for layer in self._layers.values():
                            self._add(layer, [next(it) for _ in layer.outputs], inputs=i == 0)
                        for name in leaves:
                            g = next(it)
                            if g is not None:
                                squares[name] += float(parts[name].take(g.detach()).to(torch.float64).pow(2).sum())
        finally:
            for h in handles:
                h.remove()
            for layer in self._layers.values():
                layer.inputs.clear()
                layer.outputs.clear()
        n = len(data)
        for owner, layer in list(self._layers.items()):
            if layer.calls == 0:  # run by its parent without its forward (MultiheadAttention's out_proj): no hook fired
                for part in (layer.weight, layer.bias):
                    if part is not None:
                        self.reasons[part.name] = (f"its module's forward never ran ({type(layer.module).__name__} "
                                                   "called through its parent's functional form)")
                del self._layers[owner]
        for name in self.reasons:
            self._parts[name] = ScalarPart(squares[name] / (n * parts[name].numel))
        for layer in self._layers.values():
            self._factorise(layer, n)

    @staticmethod
    def _hook(layer: _LayerSums) -> Any:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
            layer.calls += 1
            layer.inputs.append(args[0].detach())
            layer.outputs.append(output)
            return output.clone()  # what runs on: an in-place op after the layer (ReLU(inplace=True)) changes the copy
        return hook

    @staticmethod
    def _add(layer: _LayerSums, grads: list[Tensor | None], inputs: bool) -> None:
        """Add one seed's output sums of a batch, and with ``inputs`` the batch's input sums (every call of the
        layer counts as more positions)."""
        deltas = [_output_rows(layer.module, g.detach()) for g in grads if g is not None]
        if not deltas:
            return
        delta = torch.cat(deltas, 1)
        if layer.weight is not None and inputs:
            layer.positions = 0
            for a in layer.inputs:  # a convolution's patches a few samples at a time (T x k floats each)
                for start in range(0, a.shape[0], _PATCH_SAMPLES):
                    act = _patches(layer.module, a[start:start + _PATCH_SAMPLES])
                    flat = act.reshape(-1, act.shape[-1])
                    if layer.rows is not None:  # the thin route while the rows are fewer than the width
                        layer.rows.append(flat.cpu())
                        layer.rows_count += flat.shape[0]
                        if layer.rows_count < flat.shape[1]:
                            continue
                        flat, layer.rows = torch.cat(layer.rows), None
                    a_sum = (flat.T @ flat).to("cpu", torch.float64)
                    layer.a = a_sum if layer.a is None else layer.a + a_sum
                layer.positions += act.shape[1]
        if layer.weight is not None:
            rows = delta if layer.weight.rows is None else delta[..., layer.weight.rows.to(delta.device)]
            flat = rows.reshape(-1, rows.shape[-1])
            g_sum = (flat.T @ flat).to("cpu", torch.float64)
            layer.g = g_sum if layer.g is None else layer.g + g_sum
        if layer.bias is not None:
            rows = delta if layer.bias.rows is None else delta[..., layer.bias.rows.to(delta.device)]
            per_sample = rows.sum(1)
            b_sum = (per_sample.T @ per_sample).to("cpu", torch.float64)
            layer.gb = b_sum if layer.gb is None else layer.gb + b_sum

    def _factorise(self, layer: _LayerSums, n: int) -> None:
        if layer.weight is not None:
            divisor = n * max(layer.positions, 1)
            if layer.rows:  # the thin route: no k x k factor formed
                l_in, q_in = _thin_eigh(torch.cat(layer.rows), divisor)
            else:
                width = layer.weight.row_size
                l_in, q_in = _eigh(torch.zeros(width, width, dtype=torch.float64) if layer.a is None else layer.a / divisor)
            rows = _row_count(layer.weight)
            l_out, q_out = _eigh(torch.zeros(rows, rows, dtype=torch.float64) if layer.g is None else layer.g / n)
            self._parts[layer.weight.name] = KroneckerPart(q_out, l_out, q_in, l_in)
        if layer.bias is not None:
            rows = _row_count(layer.bias)
            gb = torch.zeros(rows, rows, dtype=torch.float64) if layer.gb is None else layer.gb / n
            l_b, q_b = _eigh(gb)
            self._parts[layer.bias.name] = KroneckerPart(q_b, l_b, torch.ones(1, 1, dtype=torch.float64),
                                                         torch.ones(1, dtype=torch.float64))

    # -- use ---------------------------------------------------------------------------------------
    def solve(self, v: Tensor, damping: float) -> Tensor:
        """(K + damping I)^{-1} v, v on the block's flat layout (CPU float64); damping > 0."""
        if not damping > 0:
            raise ValueError(f"the K-FAC inverse needs a positive damping (got {damping:g})")
        v = v.to(torch.float64)
        return torch.cat([self._parts[part.name].solve(piece, damping)
                          for part, piece in zip(self.block.parts, self.block.split(v))])

    def product(self, v: Tensor) -> Tensor:
        """K v on the block's flat layout (CPU float64)."""
        v = v.to(torch.float64)
        return torch.cat([self._parts[part.name].product(piece)
                          for part, piece in zip(self.block.parts, self.block.split(v))])

    def describe(self) -> dict[str, Any]:
        kinds = {part.name: ("kronecker" if isinstance(self._parts[part.name], KroneckerPart) else "scalar")
                 for part in self.block.parts}
        return {"kind": "K-FAC of the Gauss-Newton matrix, " + ("labels drawn from the model's softmax"
                                                                 if self.labels == "sampled" else "the class sum"),
                "parts": kinds, **({"scalar_because": dict(self.reasons)} if self.reasons else {}),
                "seconds": self.seconds}

    def dense(self) -> Tensor:
        """The approximation as a dense matrix (tests, small blocks)."""
        blocks = []
        for part in self.block.parts:
            p = self._parts[part.name]
            if isinstance(p, ScalarPart):
                blocks.append(p.scale * torch.eye(part.numel, dtype=torch.float64))
            else:
                g = p.q_out @ torch.diag(p.l_out) @ p.q_out.T
                a = p.q_in @ torch.diag(p.l_in) @ p.q_in.T
                blocks.append(torch.kron(g, a))
        return torch.block_diag(*blocks)

