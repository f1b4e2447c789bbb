"""NTK scrubbing (Golatkar, Achille, Soatto, "Forgetting Outside the Box: Scrubbing Deep
Networks of Information Accessible from Input-Output Observations", ECCV 2020).

Linearise the network around the pre-training weights w0 (``pipeline.linearized``):
    f_lin(x; w) = f0(x) + J0(x) (w - w0).
The linearised training problem on a data set S (rows stacked over samples and outputs,
r0 = the per-output residual at w0, see below) is the ridge regression
    w_lin(S) = argmin_w ||r0(S) + J0(S)(w - w0)||^2 + c ||w - w0||^2
             = w0 - J0(S)^T (Theta_S + c I)^{-1} r0(S),          Theta_S = J0(S) J0(S)^T.
With the SAME ridge c for D and Dr = D \\ Df, and Theta blocks (rr, rf, ff) over [Dr; Df]:
    delta_w = w_lin(Dr) - w_lin(D) = P J0(Df)^T M V
    P = I - J0(Dr)^T (Theta_rr + cI)^{-1} J0(Dr)
    M = (Theta_ff + cI - Theta_rf^T (Theta_rr + cI)^{-1} Theta_rf)^{-1}
    V = r0(Df) + Theta_rf^T (Theta_rr + cI)^{-1} (-r0(Dr))    [= (f0(Df)-Yf) + Theta_rf^T Theta_rr^-1 (Yr-f0(Dr))]
(block inversion of Theta_D + cI; the sign of V is checked against two direct solves in
tests/test_ntk.py). Two forms of the same w_lin (``form``; auto takes the smaller system):
- kernel (dual): only N K x N K kernel blocks are formed: Theta by per-sample Jacobian chunks
  (``kernel="jacobian"``, when N K |P| floats fit ``jacobian_memory_mb``) or by forward-mode
  products of Jacobian chunks (``kernel="jvp"``, memory |P| * chunk * K); P and J^T are applied
  with JVP/VJP products. No |P| x |P| matrix is built.
- primal (weight space), by the push-through identity J^T (J J^T + cI)^{-1} = (J^T J + cI)^{-1} J^T:
      w_lin(S) = a - (G_S + cI)^{-1} J0(S)^T r0'(S),     G_S = J0(S)^T J0(S)   (|P| x |P|),
  so delta_w = w_lin(Dr) - w_lin(D) is two |P| x |P| solves with G_Dr = G_D - G_Df: the cost
  is linear in N. When the block is the whole last Linear layer of a Sequential (the output
  layer over the frozen features phi(x) of the layers before it), J0(x) = I_K (x) x~^T with
  x~ = (phi(x), 1) for any w0, so G_S = I_K (x) X~_S^T X~_S and every solve is (d+1) x (d+1)
  ("primal-kronecker"); other blocks accumulate G from per-sample Jacobian chunks
  ("primal-jacobian", O(N K |P|^2)).

Ridge, regulariser and loss normalisation. The model is trained on
(1/n) sum_i loss_i + (lambda/2)||w||^2 (weight decay towards 0). Near w0 each per-sample loss
is replaced by a quadratic in the outputs, (h/2)||r_i||^2 with output curvature h I
(``OUTPUT_CURVATURE``); multiplying the objective by 2n/h gives the ridge
    w_lin(S) = argmin_w ||r0(S) + J0(S)(w - w0)||^2 + c ||w - a||^2,     c = n * lambda / h,
with a = 0 (``regulariser="decay"``, default: the regulariser the model was trained with) or
a = w0 (``"proximal"``, the paper's form). With d = a - w0 and v = w - a this is the ridge above
in v with the shifted residual r0' = r0 + J0 d, so
    w_lin(S) = a - J0(S)^T (Theta_S + c I)^{-1} r0'(S)
and delta_w is the closed form above with r0' in V. For the MSE of ``pipeline.tasks`` (mean
over K outputs of squared errors) h = 2/K, so c = n K lambda / 2, and r0 = f0 - Y.
Cross-entropy (the paper's supplement): the output Hessian diag(p) - p p^T is replaced by the
identity (h = 1, c = n lambda) and the targets are one-hot; ``ce_residual`` chooses r0 =
softmax(f0) - onehot(y) ("softmax", the gradient of the loss in the logits: one Gauss-Newton
step of the cross-entropy with identity curvature; default) or r0 = f0 - onehot(y) ("logits":
regress the logits on one-hot targets). The same c is used for D and Dr, as the closed form
requires; in the mean-normalised convention retraining on Dr thus uses lambda n / (n - m).
``ridge`` overrides c.

Trapezium rescaling (seed 001, Fig. 5): the NTK predicts the displacement between the two
linearised optima, not between the real ones; with the leg e = w(D) - w_lin(D)
(= w(D) - w_lin(Dr) + delta_w),
    w_scrub = w(D) + (1 + 2 ||e|| |cos(delta_w, e)| / ||delta_w||) delta_w.
For a model that is exactly linear in w and trained to w(D) = w_lin(D), e = 0, the factor is 1
and w_scrub = w_lin(Dr) is exactly the retrained model. (Using e = w(D) - w_lin(Dr) instead,
as an earlier version did, gives e = -delta_w there and triples the step.)
Defects of the public notebook avoided: Jacobians at w0 (theirs were at w(D)), the same c in
both systems, and an oracle-checked sign of V.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.curvature.linear_layer import layer_order
from pipeline.linearized import LinearizedModel, output_linear, output_targets, outputs_and_inputs
from pipeline.methods.base import (
    MethodSettings, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method,
)
from pipeline.param_block import ParamBlock
from pipeline.prepared import Binding, Prepared
from pipeline.privacy.release import PrivacyRelease


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


# -- loss-dependent pieces (registries, keyed by the task's loss name) --------------------------
#: h(K): the output curvature of the quadratic model of one sample's loss, (h/2)||r||^2.
OUTPUT_CURVATURE: dict[str, Callable[[int], float]] = {
    "mse": lambda k: 2.0 / k,
    "cross_entropy": lambda k: 1.0,
}

Residual = Callable[[Tensor, Tensor], Tensor]  # (f0 of shape (N, K), y) -> r0 of shape (N, K)


def _mse_residual(f0: Tensor, y: Tensor) -> Tensor:
    return f0 - output_targets(y, f0.shape[1], f0.dtype).to(f0.device)


def _ce_softmax_residual(f0: Tensor, y: Tensor) -> Tensor:
    return torch.softmax(f0, dim=1) - output_targets(y, f0.shape[1], f0.dtype).to(f0.device)


RESIDUALS: dict[str, Residual] = {
    "mse": _mse_residual,
    "cross_entropy/softmax": _ce_softmax_residual,
    "cross_entropy/logits": _mse_residual,
}


def residual_for(loss: str, ce_residual: str) -> Residual:
    key = f"{loss}/{ce_residual}" if loss == "cross_entropy" else loss
    if key not in RESIDUALS or loss not in OUTPUT_CURVATURE:
        raise ValueError(f"NTK scrubbing supports the losses {sorted(OUTPUT_CURVATURE)}, not '{loss}'")
    return RESIDUALS[key]


# -- products over data sets -------------------------------------------------------------------
def apply_j(lin: LinearizedModel, data: SampleSet, v: Tensor, batch_size: int) -> Tensor:
    """J(S) v, flat (|S| K), CPU float64."""
    parts = [lin.jvp(b, v)[1].to("cpu", torch.float64).reshape(-1) for b in data.batches(batch_size)]
    return torch.cat(parts)


def apply_jt(lin: LinearizedModel, data: SampleSet, u: Tensor, outputs: int, batch_size: int) -> Tensor:
    """J(S)^T u for flat u (|S| K), CPU float64."""
    out = torch.zeros(lin.dim, dtype=torch.float64)
    rows = u.reshape(len(data), outputs)
    for start, b in zip(range(0, len(data), batch_size), data.batches(batch_size)):
        out += lin.vjp(b, rows[start : start + batch_size]).to("cpu", torch.float64)
    return out


def residuals(lin: LinearizedModel, data: SampleSet, residual: Residual, batch_size: int) -> Tensor:
    """r0(S) flat (|S| K), CPU float64."""
    parts = [residual(lin.base_outputs(b), b["y"]).to("cpu", torch.float64).reshape(-1)
             for b in data.batches(batch_size)]
    return torch.cat(parts)


def _chunks(datasets: Sequence[SampleSet], size: int):
    for data in datasets:
        yield from data.batches(size)


def kernel_by_jacobian(lin: LinearizedModel, datasets: Sequence[SampleSet], chunk: int) -> Tensor:
    """Theta = J J^T over the concatenated data sets, J materialised in per-sample chunks."""
    jac = torch.cat([lin.jacobian(b) for b in _chunks(datasets, chunk)])
    return (jac @ jac.T).to("cpu", torch.float64)


def kernel_by_jvp(lin: LinearizedModel, datasets: Sequence[SampleSet], chunk: int) -> Tensor:
    """Theta column blocks J (J_A^T) by forward-mode products of each Jacobian chunk J_A."""
    cols = []
    for b in _chunks(datasets, chunk):
        rows = lin.jacobian(b)  # (a K) x |P|
        block = torch.cat([lin.jvp_many(c, rows).reshape(rows.shape[0], -1) for c in _chunks(datasets, chunk)], 1)
        cols.append(block.to("cpu", torch.float64))
    theta = torch.cat(cols, 0).T
    return 0.5 * (theta + theta.T)


KERNELS: dict[str, Callable[[LinearizedModel, Sequence[SampleSet], int], Tensor]] = {
    "jacobian": kernel_by_jacobian,
    "jvp": kernel_by_jvp,
}


def _cholesky(a: Tensor, what: str) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) != 0:
        raise ValueError(f"{what} is not positive definite: the ridge c must be > 0 (set settings.ridge or a "
                         "weight decay)")
    return chol


@dataclass
class NTKSystem:
    """Kernel blocks and residuals of the NTK scrub for retained / forgotten data."""

    lin: LinearizedModel
    retain: SampleSet
    forget: SampleSet
    ridge: float
    outputs: int
    theta: Tensor  # (N K)^2 over [retain; forget], CPU float64, without the ridge
    r_retain: Tensor  # r0'(Dr) = r0(Dr) + J0(Dr) d
    r_forget: Tensor  # r0'(Df)
    batch_size: int = 256
    offset: Tensor | None = None  # d = a - w0 (block coordinates, CPU float64); None = 0 (proximal)
    chol_rr: Tensor = field(init=False)

    def __post_init__(self) -> None:
        nr = len(self.retain) * self.outputs
        eye = torch.eye(nr, dtype=torch.float64)
        self.chol_rr = _cholesky(self.theta[:nr, :nr] + self.ridge * eye, "Theta_rr + cI")
        self._nr = nr

    @property
    def theta_rf(self) -> Tensor:
        return self.theta[: self._nr, self._nr :]

    @property
    def theta_ff(self) -> Tensor:
        return self.theta[self._nr :, self._nr :]

    def solve_rr(self, b: Tensor) -> Tensor:
        """(Theta_rr + cI)^{-1} b."""
        return torch.cholesky_solve(b.reshape(self._nr, -1), self.chol_rr).reshape(b.shape)

    def v(self) -> Tensor:
        """V = r0(Df) + Theta_rf^T (Theta_rr + cI)^{-1} (-r0(Dr))."""
        return self.r_forget + self.theta_rf.T @ self.solve_rr(-self.r_retain)

    def m_inverse(self) -> Tensor:
        """M^{-1} = Theta_ff + cI - Theta_rf^T (Theta_rr + cI)^{-1} Theta_rf."""
        nf = self.theta_ff.shape[0]
        s = self.theta_ff + self.ridge * torch.eye(nf, dtype=torch.float64) - self.theta_rf.T @ self.solve_rr(self.theta_rf)
        return 0.5 * (s + s.T)

    def project(self, a: Tensor) -> Tensor:
        """P a = a - J(Dr)^T (Theta_rr + cI)^{-1} J(Dr) a."""
        s = self.solve_rr(apply_j(self.lin, self.retain, a, self.batch_size))
        return a - apply_jt(self.lin, self.retain, s, self.outputs, self.batch_size)

    def delta(self, v: Tensor | None = None) -> Tensor:
        """delta_w = P J(Df)^T M V (CPU float64, block coordinates)."""
        v = self.v() if v is None else v
        mv = torch.cholesky_solve(v.unsqueeze(1), _cholesky(self.m_inverse(), "M^-1")).squeeze(1)
        return self.project(apply_jt(self.lin, self.forget, mv, self.outputs, self.batch_size))

    def retain_displacement(self) -> Tensor:
        """w_lin(Dr) - w0 = d - J(Dr)^T (Theta_rr + cI)^{-1} r0'(Dr)."""
        out = -apply_jt(self.lin, self.retain, self.solve_rr(self.r_retain), self.outputs, self.batch_size)
        return out if self.offset is None else out + self.offset

    def data_displacement(self) -> Tensor:
        """w_lin(D) - w0 = (w_lin(Dr) - w0) - delta_w."""
        return self.retain_displacement() - self.delta()


def build_system(lin: LinearizedModel, retain: SampleSet, forget: SampleSet, *, ridge: float,
                 residual: Residual, kernel: str = "auto", chunk: int = 64,
                 jacobian_memory_mb: float = 512.0, batch_size: int = 256,
                 offset: Tensor | None = None) -> tuple[NTKSystem, str]:
    """Kernel blocks and residuals at the base point of ``lin``; returns (system, kernel used).
    ``offset`` d = a - w0 moves the ridge's centre a (block coordinates): None = w0 (proximal),
    -w0 = decay towards 0; the residuals become r0' = r0 + J0 d."""
    if ridge <= 0:
        raise ValueError(f"the NTK ridge c must be > 0, got {ridge}")
    first = next(forget.batches(1))
    outputs = int(lin.base_outputs(first).shape[1])
    if kernel == "auto":
        itemsize = torch.empty(0, dtype=lin.dtype).element_size()
        need_mb = (len(retain) + len(forget)) * outputs * lin.dim * itemsize / 2**20
        kernel = "jacobian" if need_mb <= jacobian_memory_mb else "jvp"
    if kernel not in KERNELS:
        raise ValueError(f"kernel '{kernel}' is unknown; choose one of {sorted(KERNELS)} or 'auto'")
    theta = KERNELS[kernel](lin, [retain, forget], chunk)
    r_retain, r_forget = residuals(lin, retain, residual, batch_size), residuals(lin, forget, residual, batch_size)
    if offset is not None:
        offset = offset.to("cpu", torch.float64)
        r_retain = r_retain + apply_j(lin, retain, offset, batch_size)
        r_forget = r_forget + apply_j(lin, forget, offset, batch_size)
    system = NTKSystem(lin, retain, forget, ridge, outputs, theta, r_retain, r_forget, batch_size, offset)
    return system, kernel


# -- the primal (weight-space) form -------------------------------------------------------------
@dataclass
class PrimalSystem:
    """w_lin(S) - w0 = d - (G_S + cI)^{-1} b_S, b_S = J0(S)^T r0'(S), for S = Dr and S = D (module
    docstring); G and b are kept per part (retained, forgotten), so G_D = G_Dr + G_Df. In the
    Kronecker layout the Gram is X~^T X~ ((d+1) x (d+1)) and b is (d+1) x K; ``to_flat`` maps a
    solution in the Gram's layout to the block's flat order."""

    gram_retain: Tensor
    gram_forget: Tensor
    b_retain: Tensor
    b_forget: Tensor
    ridge: float
    to_flat: Callable[[Tensor], Tensor]
    offset: Tensor | None  # d = a - w0 (block order); None = 0 (proximal)
    form: str

    def _displacement(self, gram: Tensor, b: Tensor) -> Tensor:
        eye = torch.eye(gram.shape[0], dtype=torch.float64)
        chol = _cholesky(gram + self.ridge * eye, "G + cI")
        u = -self.to_flat(torch.cholesky_solve(b.reshape(gram.shape[0], -1), chol))
        return u if self.offset is None else u + self.offset

    def retain_displacement(self) -> Tensor:
        """w_lin(Dr) - w0."""
        return self._displacement(self.gram_retain, self.b_retain)

    def data_displacement(self) -> Tensor:
        """w_lin(D) - w0."""
        return self._displacement(self.gram_retain + self.gram_forget, self.b_retain + self.b_forget)

    @property
    def size(self) -> int:
        return int(self.gram_retain.shape[0])


def _kronecker_pieces(lin: LinearizedModel, layer: nn.Linear, data: SampleSet, residual: Residual,
                      offset_rows: Tensor | None, batch_size: int) -> tuple[Tensor, Tensor]:
    """(X~^T X~, X~^T R') over ``data``: R' = r0 + X~ D^T with D = the offset in (K, d+1) rows."""
    d1 = layer.in_features + 1
    gram = torch.zeros(d1, d1, dtype=torch.float64)
    b = torch.zeros(d1, layer.out_features, dtype=torch.float64)
    for batch in data.batches(batch_size):
        f0, x = outputs_and_inputs(lin, layer, batch)
        r = residual(f0, batch["y"]).to("cpu", torch.float64)
        if offset_rows is not None:
            r = r + x @ offset_rows.T
        gram += x.T @ x
        b += x.T @ r
    return gram, b


def _jacobian_pieces(lin: LinearizedModel, data: SampleSet, residual: Residual, offset: Tensor | None,
                     chunk: int) -> tuple[Tensor, Tensor]:
    """(J0^T J0, J0^T r0') over ``data`` from per-sample Jacobian chunks."""
    gram = torch.zeros(lin.dim, lin.dim, dtype=torch.float64)
    b = torch.zeros(lin.dim, dtype=torch.float64)
    for batch in data.batches(chunk):
        jac = lin.jacobian(batch).to("cpu", torch.float64)
        r = residual(lin.base_outputs(batch), batch["y"]).to("cpu", torch.float64).reshape(-1)
        if offset is not None:
            r = r + jac @ offset
        gram += jac.T @ jac
        b += jac.T @ r
    return gram, b


def build_primal_system(lin: LinearizedModel, retain: SampleSet, forget: SampleSet, *, ridge: float,
                        residual: Residual, chunk: int = 64, batch_size: int = 256,
                        offset: Tensor | None = None) -> PrimalSystem:
    """G and b of retained and forgotten data at the base point of ``lin`` (Kronecker layout
    when the block is the output Linear layer, else dense |P| x |P|)."""
    if ridge <= 0:
        raise ValueError(f"the NTK ridge c must be > 0, got {ridge}")
    offset = None if offset is None else offset.to("cpu", torch.float64)
    layer = output_linear(lin.model, lin.block)
    if layer is not None:
        k, d = layer.out_features, layer.in_features
        names = {n: ("weight" if p is layer.weight else "bias") for n, p in lin.model.named_parameters()
                 if p is layer.weight or p is layer.bias}
        order = layer_order(lin.block, names, k, d)
        rows_offset = None
        if offset is not None:
            laid = torch.empty(k * (d + 1), dtype=torch.float64)
            laid[order] = offset
            rows_offset = laid.reshape(k, d + 1)
        g_r, b_r = _kronecker_pieces(lin, layer, retain, residual, rows_offset, batch_size)
        g_f, b_f = _kronecker_pieces(lin, layer, forget, residual, rows_offset, batch_size)
        return PrimalSystem(g_r, g_f, b_r, b_f, ridge, lambda t: t.T.reshape(-1)[order], offset, "primal-kronecker")
    g_r, b_r = _jacobian_pieces(lin, retain, residual, offset, chunk)
    g_f, b_f = _jacobian_pieces(lin, forget, residual, offset, chunk)
    return PrimalSystem(g_r, g_f, b_r, b_f, ridge, lambda t: t.reshape(-1), offset, "primal-jacobian")


def choose_form(lin: LinearizedModel, n: int, outputs: int, form: str) -> str:
    """auto: the smaller system: primal when its size ((d+1) for an output Linear block, |P|
    otherwise) is below the kernel form's N K; else the kernel form."""
    if form != "auto":
        return form
    layer = output_linear(lin.model, lin.block)
    primal_size = layer.in_features + 1 if layer is not None else lin.dim
    return "primal" if primal_size < n * outputs else "kernel"


# -- rescaling ----------------------------------------------------------------------------------
def trapezium_scale(delta: Tensor, e: Tensor) -> float:
    """1 + 2 ||e|| |cos(delta, e)| / ||delta|| = 1 + 2 |<delta, e>| / ||delta||^2."""
    dd = float(delta @ delta)
    return 1.0 + 2.0 * abs(float(delta @ e)) / dd if dd > 0 else 1.0


RESCALES: dict[str, Callable[[Tensor, Tensor], float]] = {
    "trapezium": trapezium_scale,
    "none": lambda delta, e: 1.0,
}


# -- the method ----------------------------------------------------------------------------------
class NTKScrubSettings(MethodSettings):
    parameters: Literal["all"] | list[str] = Field(
        "all", description='"all" or qualified parameter names (linearised at w0); others keep their values')
    ridge: float | None = Field(None, gt=0, description="c; default n * lambda / h (see module docstring)")
    ce_residual: Literal["softmax", "logits"] = Field(
        "softmax", description="cross-entropy residual: softmax(f0) - onehot or f0 - onehot")
    regulariser: Literal["decay", "proximal"] = Field(
        "decay", description="ridge centre: decay (towards 0, as the model was trained) or proximal (towards w0)")
    rescale: Literal["trapezium", "none"] = Field("trapezium", description="trapezium rescaling of delta_w")
    form: Literal["auto", "kernel", "primal"] = Field(
        "auto", description="kernel: the (NK)^2 dual system; primal: the |P| x |P| weight-space system (the "
                            "same w_lin); auto: primal for an output Linear block or when |P| < N K")
    max_system: int = Field(
        12_000, gt=0, description="largest linear system (kernel N K, or primal |P|) to form and factor; above it the "
                                  "scrub refuses with a clear error (a (12,000)^2 float64 system is 1.15 GB)")
    kernel: Literal["auto", "jacobian", "jvp"] = Field("auto", description="kernel form: how Theta is formed")
    jacobian_memory_mb: float = Field(512.0, gt=0, description="auto: materialise J up to this size")
    chunk_size: int = Field(64, gt=0, description="samples per Jacobian chunk")
    w0_path: str | None = Field(
        None, description="checkpoint (safetensors) of the pre-training weights w0; null = the start the model "
                          "card's recipe trained from (its seeded initialisation plus its init checkpoint)")


@dataclass
class PretrainingWeights(Prepared):
    """w0, the weights NTK scrubbing linearises at: the checkpoint ``w0_path`` names, or the start
    of the model card's recipe (``pipeline.recipe.start_weights``)."""

    w0: dict[str, Tensor] = field(default_factory=dict)

    what = "w0: the pre-training weights the network is linearised at"


def pretraining_weights(trained: TrainedModel, settings: NTKScrubSettings) -> dict[str, Tensor]:
    if settings.w0_path:
        from pipeline.checkpoint import read_state_dict

        return dict(read_state_dict(settings.w0_path))
    if trained.card is not None:
        from pipeline.recipe import start_weights

        return start_weights(trained.card)
    raise ValueError(
        "NTK scrubbing linearises the network around its pre-training weights w0 and needs them: give "
        "settings.w0_path (a safetensors checkpoint of w0), or remove from a model directory whose card records "
        "the recipe")


def _block(model: nn.Module, parameters: Literal["all"] | list[str]) -> ParamBlock:
    if parameters == "all":
        return ParamBlock.all_parameters(model)
    if not parameters:
        raise ValueError('parameters must be "all" or a non-empty list of qualified parameter names')
    return ParamBlock.from_rows(model, {name: None for name in parameters})


@register_method
class NTKScrub(RemovalMethod):
    """w_scrub = w(D) + scale * delta_w on the block; changes ``problem.model`` in place and
    returns the block's new parameter values."""

    name = "ntk"
    Settings = NTKScrubSettings

    PREPARED_FROM = ("w0_path",)

    def prepare(self, trained: TrainedModel, settings: NTKScrubSettings,  # type: ignore[override]
                binding: Binding) -> PretrainingWeights:
        return PretrainingWeights(binding, w0=pretraining_weights(trained, settings))

    def remove(self, problem: RemovalProblem, settings: NTKScrubSettings,  # type: ignore[override]
               prepared: PretrainingWeights) -> RemovalOutcome:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        model, task = problem.model, problem.task
        w0 = prepared.w0
        block = _block(model, settings.parameters)
        missing = sorted(part.name for part in block.parts if part.name not in w0)
        if missing:
            raise KeyError(f"the pre-training weights w0 lack the parameters {missing[:5]}")
        # Linearise at w0 on the block; parameters outside it keep their current values.
        lin = LinearizedModel(model, task, block, base={part.name: w0[part.name] for part in block.parts})
        residual = residual_for(task.loss, settings.ce_residual)
        retain, forget = problem.retain, problem.forget
        outputs = int(lin.base_outputs(next(forget.batches(1))).shape[1])
        h = OUTPUT_CURVATURE[task.loss](outputs)
        ridge = settings.ridge if settings.ridge is not None else problem.n * problem.weight_decay / h
        w_block = block.gather({n: p.detach() for n, p in model.named_parameters()}).to("cpu", torch.float64)
        w0_block = block.gather(lin.params).to("cpu", torch.float64)
        offset = -w0_block if settings.regulariser == "decay" else None  # d = a - w0, a = 0 or w0
        form = choose_form(lin, problem.n, outputs, settings.form)
        layer = output_linear(model, block)
        size = problem.n * outputs if form == "kernel" else (block.numel if layer is None else layer.in_features + 1)
        if size > settings.max_system:
            raise ValueError(
                f"NTK scrub ({form} form) would factor a {size} x {size} system, above max_system = "
                f"{settings.max_system}: choose form: {'kernel' if form == 'primal' else 'primal'} if that system is "
                "smaller, a smaller block (parameters: the output layer's weight and bias), or raise max_system")
        system: NTKSystem | PrimalSystem
        with problem.stage("kernel", timings):
            if form == "primal":
                system = build_primal_system(lin, retain, forget, ridge=ridge, residual=residual,
                                             chunk=settings.chunk_size, batch_size=problem.batch_size, offset=offset)
                kernel = system.form
            else:
                system, kernel = build_system(
                    lin, retain, forget, ridge=ridge, residual=residual, kernel=settings.kernel,
                    chunk=settings.chunk_size, jacobian_memory_mb=settings.jacobian_memory_mb,
                    batch_size=problem.batch_size, offset=offset)
        with problem.stage("solve", timings):
            w_lin_retain = w0_block + system.retain_displacement()
            w_lin_all = w0_block + system.data_displacement()
            delta = w_lin_retain - w_lin_all  # delta = w_lin(Dr) - w_lin(D)
        with problem.stage("update", timings):
            e = w_block - w_lin_all          # the trapezium's leg: w(D) - w_lin(D)
            scale = RESCALES[settings.rescale](delta, e)
            block.add_to_model(model, scale * delta)

        params = dict(model.named_parameters())
        new_parameters = {part.name: params[part.name].detach().clone() for part in block.parts}
        dn, en = _norm(delta), _norm(e)
        release = PrivacyRelease.non_private("NTK scrubbing adds no noise: no (epsilon, delta) claim")
        record: dict[str, Any] = {
            "block": {"numel": block.numel,
                      "parts": block.describe() if block.numel <= 100_000 else len(block.parts)},
            "ridge": {"c": ridge, "derived": settings.ridge is None,
                      "rule": "c = n * lambda / h, h = output curvature", "output_curvature": h,
                      "n": problem.n, "weight_decay": problem.weight_decay,
                      "regulariser": settings.regulariser,
                      "centre": "0 (weight decay)" if settings.regulariser == "decay" else "w0"},
            "loss": task.loss, "ce_residual": settings.ce_residual if task.loss == "cross_entropy" else None,
            "form": form,
            "kernel": {"strategy": kernel, "size": size, "outputs": outputs},
            "rescale": settings.rescale, "scale": scale,
            "norms": {"delta_w": dn, "e": en, "e_definition": "w(D) - w_lin(D)",
                      "cos_delta_e": float(delta @ e) / (dn * en) if dn * en > 0 else 0.0,
                      "w_minus_w0": _norm(w_block - w0_block), "applied_step": scale * dn},
            "seconds": {**timings, "total": time.perf_counter() - t0},
            "release": release.model_dump(mode="json"),
        }
        return RemovalOutcome(new_parameters, record, release)
