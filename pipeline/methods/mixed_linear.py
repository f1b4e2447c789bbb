"""Mixed-Linear forgetting (Golatkar, Achille, Ravichandran, Polito, Soatto, "Mixed-Privacy
Forgetting in Deep Networks", CVPR 2021).

Model: core weights w_c (trained normally on core data, never touched by forgetting) and
user weights w_u of the first-order Taylor model around w_c (``pipeline.linearized``):
    f_ML(x) = f_{w_c}(x) + J_{w_c}(x) w_u,
with w_u restricted to a block of parameters (by default those of the last module). The
user weights minimise, on user data D (N samples, K outputs),
    L_D(w_u) = (1/(N K)) sum_i ||f_{w_c}(x_i) + J_i w_u - y_i||^2 + (lambda/2) ||w_u||^2,
the MSE of ``pipeline.tasks`` (mean over samples AND outputs) plus weight decay. It is
quadratic, with
    grad L_D(w_u) = (2/(N K)) J^T (f_{w_c} + J w_u - Y) + lambda w_u,
    H_D           = (2/(N K)) J^T J + lambda I         (exactly, not an approximation).
Note the factor 2/(N K): the paper writes J^T J / N + lambda I for a loss with a 1/2 and no
mean over outputs; using a Hessian whose scale differs from the loss's (e.g. J^T J/(N K))
makes the "exact" step miss the retrained weights (tests/test_mixed_linear.py shows it).

Training and forgetting are both one exact Newton step on this quadratic, solved matrix-free
by conjugate gradient on Jacobian-vector (``torch.func.jvp``) and vector-Jacobian
(``torch.func.vjp``) products, to a relative residual ``rtol``:
    train:   w_u = w_init - H_D^{-1} grad L_D(w_init)       (any w_init; default 0)
    forget:  w_u <- w_u - H_Dr^{-1} grad L_Dr(w_u)  (+ sigma * N(0, I), secret)
so forgetting D_f lands on the weights retrained on D_r = D \\ D_f up to the CG tolerance,
and sequential requests compose exactly. Forgetting all user data is w_u = 0 (the core model).

Data parallelism: every sum over samples (J^T r, J^T J v, squared residuals, the sample
count) is computed on this process's shard and then passed through ``allreduce`` (identity by
default). To run across ranks, pass e.g.
    def allreduce(t): torch.distributed.all_reduce(t); return t
The tensors handed to ``allreduce`` are float64 on the model's device (NCCL supports float64).
Vectors (w_u, CG iterates) are CPU float64 and identical on every rank, so CG stays in step.
Noise is secret (OS CSPRNG, ``pipeline.privacy.noise.secret_standard_normal``): the root rank
draws it and the others contribute zeros to one ``allreduce``, so every rank adds the same
draw and nothing (no seed, no record) can regenerate it. ``run_data_parallel`` is the whole
data-parallel job of one rank (load the core model and the user data, shard, train and/or
forget); ``cluster.deepspeed_mixed_linear`` supplies the process group, the reduction and the
ZeRO store of the weights.

Binding: user weights are only meaningful for the lambda and the data they were trained on.
``UserWeights`` carries both (the file ``USER_WEIGHTS_FILE`` keeps them in its metadata), and a
forget against another lambda or other data is refused (``UserWeightsBindingError``).

Defects of the one public reimplementation avoided: it crashes at the forgetting step, trains
with SGD instead of solving, has a Hessian scale mismatch and adds no noise.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from pipeline.curvature import LinearOperator, SolveInfo, cg_solve
from pipeline.data.sampleset import SampleSet
from pipeline.linearized import BatchProducts, LinearizedModel, batch_products, output_linear, output_targets
from pipeline.methods.base import (
    MethodSettings, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, register_method,
)
from pipeline.mixed_linear_prepared import PreparedUserSums, UserWeightsBindingError
from pipeline.prepared import Binding, Prepared
from pipeline.param_block import ParamBlock
from pipeline.privacy.noise import secret_standard_normal
from pipeline.privacy.release import Guarantee, PrivacyRelease

Allreduce = Callable[[Tensor], Tensor]

#: Prefix of the user-weight entries in ``RemovalOutcome.new_parameters`` (full parameter
#: shapes, zero outside the block's rows); the core parameters are never changed.
USER_WEIGHT_PREFIX = "mixed_linear.user."

#: Mixed-Linear models keep their user weights w_u beside the core weights, in this file of
#: the model directory (full parameter shapes, zero outside the user block; the metadata holds
#: the lambda and the sample ids they were trained on).
USER_WEIGHTS_FILE = "user_weights.safetensors"

#: The flat block-coordinate vector inside a user-weights file written by the data-parallel job.
FLAT_KEY = "mixed_linear.flat"

_FORMAT = "mixed-linear-user-weights/1"


@dataclass
class UserWeights:
    """w_u (per-parameter full-shaped tensors, or a flat block vector) and what they are bound
    to: the weight decay lambda and the ids of the user data they minimise L_D on."""

    weights: dict[str, Tensor] | Tensor
    weight_decay: float
    sample_ids: list[int]

    def check(self, weight_decay: float, sample_ids: Sequence[int]) -> None:
        """Refuse a use against another lambda or other data (``UserWeightsBindingError``)."""
        if not math.isclose(self.weight_decay, weight_decay, rel_tol=1e-12, abs_tol=0.0):
            raise UserWeightsBindingError(
                f"the user weights were trained with weight decay {self.weight_decay!r} but this forget uses "
                f"{weight_decay!r}: forget with the lambda they were trained with, or retrain the user weights")
        trained, given = set(self.sample_ids), {int(i) for i in sample_ids}
        if trained != given:
            extra, missing = sorted(given - trained), sorted(trained - given)
            raise UserWeightsBindingError(
                "the user weights were trained on other data than this model's training set "
                f"({len(missing)} of their samples are missing here, e.g. {missing[:5]}; {len(extra)} samples "
                f"here were never trained on, e.g. {extra[:5]}): retrain the user weights on this data")


def save_user_weights(path: str | Path, user: UserWeights) -> str:
    """Write ``user`` (a dict of tensors) with its binding in the safetensors metadata."""
    from pipeline.checkpoint import save_safetensors

    if isinstance(user.weights, Tensor):
        raise TypeError("save per-parameter tensors (user_state(...)), not a flat vector")
    metadata = {"format": _FORMAT, "weight_decay": repr(float(user.weight_decay)),
                "sample_ids": json.dumps(sorted(int(i) for i in user.sample_ids))}
    return save_safetensors(user.weights, path, metadata=metadata)


def read_user_weights(path: str | Path) -> UserWeights:
    """A user-weights file and its binding; a file without one is refused."""
    from safetensors import safe_open

    from pipeline.checkpoint import read_state_dict

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    if meta.get("format") != _FORMAT:
        raise UserWeightsBindingError(
            f"{path} does not say which lambda and data its user weights were trained on; "
            "retrain them (unlearn mixed-linear-dist) or save them with pipeline.methods.mixed_linear.save_user_weights")
    return UserWeights(read_state_dict(path), weight_decay=float(meta["weight_decay"]),
                       sample_ids=[int(i) for i in json.loads(meta["sample_ids"])])


def no_allreduce(t: Tensor) -> Tensor:
    """The single-process reduction: the identity."""
    return t


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


# -- the quadratic objective --------------------------------------------------------------
@dataclass
class UserObjective:
    """L(w_u) = (1/(N K)) sum_i ||f_c(x_i) + J_i w_u - y_i||^2 + (lambda/2)||w_u||^2 over the
    samples of all shards (this process holds ``data``; N = allreduce(local count)).

    ``outputs`` (K) is read from the model when the shard is not empty; pass it for a rank
    whose shard may be empty. ``cache`` keeps each batch's traced linearisation (activations)
    in memory, which makes the repeated CG products tens of times faster; turn it off when
    the shard's activations do not fit.
    """

    lin: LinearizedModel
    data: SampleSet
    weight_decay: float
    allreduce: Allreduce = no_allreduce
    batch_size: int = 256
    outputs: int | None = None
    cache: bool = True
    count: int = field(init=False)
    parts: list[BatchProducts] = field(init=False)
    targets: list[Tensor] = field(init=False)

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        local = torch.tensor([float(len(self.data))], dtype=torch.float64, device=self.lin.device)
        self.count = int(round(float(self.allreduce(local)[0])))
        self.parts = batch_products(self.lin, self.data, self.batch_size, cache=self.cache)
        if self.outputs is None:
            if not self.parts:
                raise ValueError("this shard is empty: pass outputs=K so the loss normalisation is known")
            self.outputs = int(self.parts[0].base.shape[1])
        self.targets = [output_targets(p.batch["y"], int(self.outputs), p.base.dtype).to(p.base.device)
                        for p in self.parts]

    @property
    def scale(self) -> float:
        """2 / (N K): the factor of J^T r in the gradient and of J^T J in the Hessian."""
        if self.count == 0:
            raise ValueError("no samples on any shard: the user objective is undefined (forget all = zero w_u)")
        return 2.0 / (self.count * int(self.outputs))

    def _reduce(self, local: Tensor) -> Tensor:
        return self.allreduce(local).to("cpu", torch.float64)

    def residual_products(self, w_u: Tensor) -> tuple[Tensor, float]:
        """(sum_i J_i^T r_i, sum_i ||r_i||^2) over all shards, r_i = f_c + J_i w_u - y_i."""
        jtr = torch.zeros(self.lin.dim, dtype=torch.float64, device=self.lin.device)
        sq = torch.zeros(1, dtype=torch.float64, device=self.lin.device)
        for part, y in zip(self.parts, self.targets):
            r = part.base + part.jvp(w_u) - y
            jtr += part.vjp(r).to(torch.float64)
            sq += r.to(torch.float64).pow(2).sum()
        both = self._reduce(torch.cat([jtr, sq]))
        return both[:-1], float(both[-1])

    def gradient(self, w_u: Tensor) -> Tensor:
        """grad L(w_u) = (2/(N K)) J^T (f_c + J w_u - Y) + lambda w_u   (CPU float64)."""
        jtr, _ = self.residual_products(w_u)
        return self.scale * jtr + self.weight_decay * w_u.to("cpu", torch.float64)

    def value_and_gradient(self, w_u: Tensor) -> tuple[float, Tensor]:
        jtr, sq = self.residual_products(w_u)
        w = w_u.to("cpu", torch.float64)
        value = 0.5 * self.scale * sq + 0.5 * self.weight_decay * float(w @ w)
        return value, self.scale * jtr + self.weight_decay * w

    def hessian(self) -> "GaussNewtonOperator":
        return GaussNewtonOperator(self)


class GaussNewtonOperator(LinearOperator):
    """H v = scale * allreduce(sum_shard J^T J v) + lambda v, scale = 2/(N K): the exact
    Hessian of ``UserObjective`` (one JVP and one VJP per batch)."""

    def __init__(self, objective: UserObjective, scale: float | None = None):
        self.objective = objective
        self.dim = objective.lin.dim
        self.scale = objective.scale if scale is None else scale
        self.products = 0

    def matvec(self, v: Tensor) -> Tensor:
        obj = self.objective
        acc = torch.zeros(self.dim, dtype=torch.float64, device=obj.lin.device)
        for part in obj.parts:
            acc += part.vjp(part.jvp(v)).to(torch.float64)
        self.products += 1
        return self.scale * obj._reduce(acc) + obj.weight_decay * v.to("cpu", torch.float64)


# -- results and the public functions -------------------------------------------------------
@dataclass
class MixedLinearResult:
    """New user weights (CPU float64, block coordinates), the CG report and a JSON-ready record."""

    user_weights: Tensor
    solve: SolveInfo | None
    record: dict[str, Any]


def newton_step(objective: UserObjective, w_u: Tensor, *, operator: LinearOperator | None = None,
                rtol: float = 1e-10, max_iter: int | None = None) -> tuple[Tensor, SolveInfo, Tensor]:
    """w_u - H^{-1} grad L(w_u), H solved by CG (``operator`` defaults to the exact Hessian).
    Returns (new w_u, solve info, the gradient at w_u)."""
    w = w_u.to("cpu", torch.float64)
    g = objective.gradient(w)
    op = operator if operator is not None else objective.hessian()
    step, info = cg_solve(op, g, rtol=rtol, max_iter=max_iter)
    if not info.converged:
        info.notes.append(f"CG stopped at relative residual {info.relative_residual:.2e} > rtol {rtol:.1e}: "
                          "raise cg_max_iter; the result is not the exact optimum")
    return w - step, info, g


def train_user_weights(
    lin: LinearizedModel, data: SampleSet, weight_decay: float, *,
    init: Tensor | None = None, rtol: float = 1e-10, max_iter: int | None = None,
    allreduce: Allreduce = no_allreduce, batch_size: int = 256, outputs: int | None = None,
    cache: bool = True,
) -> MixedLinearResult:
    """Minimise the Mixed-Linear user objective on ``data`` (this rank's shard): one exact
    Newton step from ``init`` (default 0), i.e. w_u = w_init - H_D^{-1} grad L_D(w_init)."""
    t = time.perf_counter()
    objective = UserObjective(lin, data, weight_decay, allreduce, batch_size, outputs, cache)
    w0 = torch.zeros(lin.dim, dtype=torch.float64) if init is None else init.to("cpu", torch.float64)
    w, info, g0 = newton_step(objective, w0, rtol=rtol, max_iter=max_iter)
    value, g1 = objective.value_and_gradient(w)
    record = {
        "samples": objective.count, "outputs": objective.outputs, "user_dim": lin.dim,
        "hessian_scale": objective.scale, "weight_decay": weight_decay,
        "objective": value, "gradient_norm_before": _norm(g0), "gradient_norm_after": _norm(g1),
        "solver": info.__dict__, "seconds": time.perf_counter() - t,
    }
    return MixedLinearResult(w, info, record)


def forget_user_data(
    lin: LinearizedModel, user_weights: Tensor, retain: SampleSet, weight_decay: float, *,
    sigma: float = 0.0, root: bool = True, rtol: float = 1e-10,
    max_iter: int | None = None, allreduce: Allreduce = no_allreduce, batch_size: int = 256,
    outputs: int | None = None, cache: bool = True,
) -> MixedLinearResult:
    """Forget everything not in ``retain`` (this rank's retained user samples):
    w_u <- w_u - H_Dr^{-1} grad L_Dr(w_u) + sigma * N(0, I). Exact (up to ``rtol``) for the
    quadratic; apply it again for a later request. The noise is secret: the ``root`` rank
    draws it from the OS CSPRNG and ``allreduce`` hands the same draw to every rank."""
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma}")
    t = time.perf_counter()
    objective = UserObjective(lin, retain, weight_decay, allreduce, batch_size, outputs, cache)
    if objective.count == 0:
        zero = forget_all_user_data(user_weights)
        return MixedLinearResult(zero, None, {"samples": 0, "forgot_all": True, "user_dim": lin.dim})
    w, info, g0 = newton_step(objective, user_weights, rtol=rtol, max_iter=max_iter)
    g_exact = objective.gradient(w)
    noise = torch.zeros_like(w)
    if sigma > 0:
        local = sigma * secret_standard_normal(w.numel()) if root else torch.zeros_like(w)
        noise = allreduce(local.to(lin.device)).to("cpu", torch.float64)
    record = {
        "samples_retained": objective.count, "outputs": objective.outputs, "user_dim": lin.dim,
        "hessian_scale": objective.scale, "weight_decay": weight_decay,
        "retain_gradient_norm_before": _norm(g0), "retain_gradient_norm_after": _norm(g_exact),
        "step_norm": _norm(w - user_weights.to("cpu", torch.float64)),
        "noise": {"sigma": sigma, "source": "os-csprng" if sigma > 0 else None},
        "solver": info.__dict__,
        "seconds": time.perf_counter() - t,
    }
    return MixedLinearResult(w + noise, info, record)


def forget_all_user_data(user_weights: Tensor) -> Tensor:
    """Forgetting every user sample: w_u = 0, so f_ML = f_{w_c} exactly (the core model)."""
    return torch.zeros_like(user_weights, dtype=torch.float64, device="cpu")


def user_block(model: nn.Module, parameters: list[str] | None = None, last_modules: int = 1) -> ParamBlock:
    """The user-weight block: the named parameters, or else every parameter of the last
    ``last_modules`` modules that own parameters (in registration order)."""
    if parameters:
        return ParamBlock.from_rows(model, {name: None for name in parameters})
    owners = [name for name, mod in model.named_modules()
              if any(p.requires_grad for p in mod.parameters(recurse=False))]
    if last_modules < 1 or last_modules > len(owners):
        raise ValueError(f"user_last_modules must lie in [1, {len(owners)}] for this model, got {last_modules}")
    chosen = set(owners[-last_modules:])
    names = [n for n, p in model.named_parameters() if p.requires_grad and n.rpartition(".")[0] in chosen]
    return ParamBlock.from_rows(model, {name: None for name in names})


def user_state(block: ParamBlock, model: nn.Module, w_u: Tensor) -> dict[str, Tensor]:
    """w_u as full-shaped tensors per parameter (zero outside the block's rows)."""
    zeros = {part.name: torch.zeros(part.shape, dtype=w_u.dtype) for part in block.parts}
    return block.insert(zeros, w_u.to("cpu"))


def user_vector(block: ParamBlock, weights: Tensor | Mapping[str, Tensor]) -> Tensor:
    """Flat block-coordinate user weights from a flat tensor or a per-parameter dict."""
    if isinstance(weights, Tensor):
        flat = weights.reshape(-1)
    else:
        missing = sorted({part.name for part in block.parts} - set(weights))
        if missing:
            raise KeyError(f"user_weights lacks the user parameters {missing}")
        flat = block.gather({k: v.detach().cpu() for k, v in weights.items()})
    if flat.numel() != block.numel:
        raise ValueError(f"user_weights has {flat.numel()} entries but the user block has {block.numel}")
    return flat.to("cpu", torch.float64)


# -- the RemovalMethod wrapper ------------------------------------------------------------------
class MixedLinearSettings(MethodSettings):
    """The one settings model of Mixed-Linear forgetting (``unlearn forget``, campaigns, the
    stream service and ``unlearn mixed-linear-dist`` all use it)."""

    user_parameters: list[str] = Field(
        default_factory=list, description="qualified names of the user parameters; empty: the last modules")
    user_last_modules: int = Field(1, ge=1, description="user block = parameters of the last k modules")
    sigma: float = Field(0.0, ge=0, description="std of the secret Gaussian noise added after the Newton step")
    cg_rtol: float = Field(1e-10, gt=0, description="CG stops at ||r|| <= cg_rtol ||b||")
    cg_max_iter: int | None = Field(None, gt=0, description="CG iteration cap (default 2 * block size)")


def _release(sigma: float) -> PrivacyRelease:
    if sigma <= 0:
        return PrivacyRelease.non_private()
    return PrivacyRelease(mechanism="gaussian", sigma=sigma, guarantee=Guarantee.NONE,
                          reasons=["Mixed-Linear noise is not calibrated to a privacy budget: no (epsilon, delta) claim"])


@dataclass
class MixedLinearPrepared(Prepared):
    """The user sums G_D, C_D of D (``pipeline.mixed_linear_prepared``) when the user block is the
    core's output Linear layer (a removal is then exact in closed form, with no pass over D_r);
    None for other user blocks, which forget by CG over D_r."""

    sums: PreparedUserSums | None = None

    what = "the user sums X~^T X~, X~^T (Y - F_c) of D (prepared Mixed-Linear forgetting)"

    def after_removal(self, trained: Any, removed: torch.Tensor, outcome: Any,
                      binding: Binding) -> "MixedLinearPrepared | None":
        """The sums of D \\ U, which the removal computed (its ``retained_sums``)."""
        retained = getattr(outcome, "retained_sums", None)
        if self.sums is None or retained is None:
            return None
        return MixedLinearPrepared(binding, 0.0, {"updated_from_removal": True}, retained)


@register_method
class MixedLinear(RemovalMethod):
    """``problem.model`` holds the core weights w_c, ``problem.train`` the user data D and
    ``problem.user_weights`` the trained user weights (a ``UserWeights`` bound to lambda and to
    exactly the ids of D, as ``train_user_weights`` made them). The outcome's ``new_parameters``
    holds the new user weights under ``USER_WEIGHT_PREFIX + name`` (full parameter shapes) and its
    ``user_weights`` the new ``UserWeights`` (flat vector, bound to the retained ids). The core
    weights are not changed. Prepared: the sums of D for an output-layer user block."""

    name = "mixed-linear"
    Settings = MixedLinearSettings
    PREPARED_FROM = ("user_parameters", "user_last_modules")

    def prepare(self, trained: TrainedModel, settings: MixedLinearSettings,  # type: ignore[override]
                binding: Binding) -> MixedLinearPrepared:
        block = user_block(trained.model, settings.user_parameters or None, settings.user_last_modules)
        lin = LinearizedModel(trained.model, trained.task, block)
        if output_linear(trained.model, block) is None:
            return MixedLinearPrepared(binding, details={"sums": "none: the user block is not the core's output "
                                                                 "Linear layer; removals forget by CG over D_r"})
        sums = PreparedUserSums.prepare(lin, trained.train, trained.weight_decay, batch_size=trained.batch_size)
        return MixedLinearPrepared(binding, sums=sums)

    def remove(self, problem: RemovalProblem, settings: MixedLinearSettings,  # type: ignore[override]
               prepared: MixedLinearPrepared) -> RemovalOutcome:
        user = problem.user_weights
        if user is None:
            raise ValueError(
                "Mixed-Linear forgetting needs the trained user weights w_u (RemovalProblem.user_weights; a model "
                "directory's user_weights.safetensors): train them with pipeline.methods.mixed_linear.train_user_weights")
        if not isinstance(user, UserWeights):
            raise UserWeightsBindingError(
                "RemovalProblem.user_weights must be a UserWeights: the weights together with the weight decay "
                "and the sample ids they were trained on")
        user.check(problem.weight_decay, problem.train.sample_ids.tolist())
        model = problem.model
        timings: dict[str, float] = {}
        block = user_block(model, settings.user_parameters or None, settings.user_last_modules)
        w_u = user_vector(block, user.weights)
        retained_sums = None
        if prepared.sums is not None:  # (bound by the seam; the sums' own binding checked too)
            prepared.sums.check(problem.weight_decay, problem.train.sample_ids.tolist(), model)
        with problem.stage("forget", timings):
            lin = LinearizedModel(model, problem.task, block)
            if prepared.sums is not None:  # exact in closed form from the prepared sums (no pass over D_r)
                result, retained_sums = _forget_prepared(prepared.sums, lin, w_u, problem, settings.sigma)
            else:
                result = forget_user_data(
                    lin, w_u, problem.retain, problem.weight_decay, sigma=settings.sigma,
                    rtol=settings.cg_rtol, max_iter=settings.cg_max_iter, batch_size=problem.batch_size)
        keep = torch.ones(len(problem.train), dtype=torch.bool)
        keep[problem.forget_positions] = False
        retained = problem.train.sample_ids[keep].tolist()  # (not problem.retain: no copy of the retained data)
        state = user_state(block, model, result.user_weights)
        new_parameters = {USER_WEIGHT_PREFIX + k: v for k, v in state.items()}
        record = {"user_block": block.describe() if block.numel <= 100_000 else len(block.parts),
                  "forgotten": problem.m, **result.record, "timings": timings}
        outcome = RemovalOutcome(new_parameters, record, release=_release(settings.sigma),
                                 user_weights=UserWeights(result.user_weights, problem.weight_decay, retained))
        outcome.retained_sums = retained_sums  # type: ignore[attr-defined]
        return outcome


def _forget_prepared(prepared: PreparedUserSums, lin: LinearizedModel, w_u: Tensor, problem: RemovalProblem,
                     sigma: float) -> tuple[MixedLinearResult, PreparedUserSums]:
    """The exact Newton step of L_Dr from the prepared sums (``pipeline.mixed_linear_prepared``),
    plus the secret noise; also the sums of D_r (the next version's preparation)."""
    started = time.perf_counter()
    w, retained, record = prepared.forget(lin, w_u, problem.forget, batch_size=problem.batch_size)
    noise = sigma * secret_standard_normal(w.numel()) if sigma > 0 else torch.zeros_like(w)
    record.update({"weight_decay": problem.weight_decay, "noise": {"sigma": sigma, "source": "os-csprng" if sigma > 0
                                                                   else None},
                   "seconds": time.perf_counter() - started})
    return MixedLinearResult(w + noise, None, record), retained


# -- the data-parallel job of one rank ----------------------------------------------------------
class WeightStore(Protocol):
    """Where the user-weight vector lives between the steps (a ZeRO engine across ranks)."""

    def read(self) -> Tensor: ...

    def write(self, w: Tensor) -> None: ...


class LocalWeightStore:
    """The single-process store: a CPU float64 copy."""

    def __init__(self, dim: int) -> None:
        self.w = torch.zeros(dim, dtype=torch.float64)

    def read(self) -> Tensor:
        return self.w.clone()

    def write(self, w: Tensor) -> None:
        self.w = w.detach().to("cpu", torch.float64).clone()


class UserDataRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str | None = Field(None, description="a registered data source; null = the model card's")
    options: dict[str, Any] = Field(default_factory=dict, description="the source's options")
    split: str = Field("train", description="the split holding the user data")
    sample_ids: list[int] | None = Field(None, description="the user samples; null = the whole split")


class ForgetRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sample_ids: list[int] = Field(default_factory=list, description="user sample ids to forget")


class DataParallelJob(BaseModel):
    """One Mixed-Linear run across ranks: train the user weights (or load them), then forget."""

    model_config = ConfigDict(extra="forbid")
    model: Path = Field(description="model directory holding the core weights w_c")
    output: Path = Field(description="folder to write (must not exist)")
    user_data: UserDataRef = Field(default_factory=UserDataRef)
    forget: ForgetRef = Field(default_factory=ForgetRef)
    init_user_weights: Path | None = Field(None, description="user_weights.safetensors of an earlier run: forget only")
    settings: MixedLinearSettings = Field(default_factory=MixedLinearSettings)
    weight_decay: float = Field(0.01, ge=0, allow_inf_nan=False, description="lambda of the user objective")
    dtype: Literal["float32", "float64"] = Field("float64", description="dtype of the core model AND the user data")
    batch_size: int = Field(256, gt=0)


def contiguous_shard(n: int, rank: int, world: int) -> Tensor:
    """Positions [rank n / world, (rank+1) n / world) (possibly empty)."""
    return torch.arange(rank * n // world, (rank + 1) * n // world)


def _load_core(model_dir: Path, dtype: torch.dtype) -> tuple[nn.Module, Any, Any]:
    from pipeline.checkpoint import load_into, read_state_dict
    from pipeline.models.card import WEIGHTS_FILE, read_card
    from pipeline.models.registry import build

    card = read_card(model_dir)
    model, task = build(card.preset, card.options)
    model = model.to(dtype)
    load_into(model, read_state_dict(model_dir / WEIGHTS_FILE), source=str(model_dir))
    return model.eval(), task, card


def _user_data(job: DataParallelJob, card: Any, dtype: torch.dtype) -> SampleSet:
    from pipeline.data import load_source

    ref = job.user_data
    source = ref.source or card.data.source
    options = ref.options if ref.source else (ref.options or card.data.options)
    splits = load_source(source, options)
    if ref.split not in splits:
        raise ValueError(f"user_data.split '{ref.split}' is not a split of '{source}' (has {sorted(splits)})")
    user = splits[ref.split]
    if ref.sample_ids is not None:
        user = user.take(user.positions_of(ref.sample_ids, field="user_data.sample_ids"))
    return user.astype(dtype)


def run_data_parallel(
    job: DataParallelJob, *, rank: int = 0, world: int = 1, device: torch.device | str = "cpu",
    allreduce: Allreduce = no_allreduce, store_factory: Callable[[int], WeightStore] = LocalWeightStore,
    context: Mapping[str, Any] | None = None, log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """This rank's part of a data-parallel Mixed-Linear run; returns the record. Every rank
    loads the core model and the user data in ``job.dtype``, keeps its contiguous shard and
    passes every sum over samples through ``allreduce``; rank 0 writes
    OUTPUT/user_weights.safetensors (bound to lambda and the final data) and
    OUTPUT/mixed_linear.json, atomically."""
    from pipeline.checkpoint import save_safetensors  # noqa: F401  (checked importable before work)

    started = time.perf_counter()
    dtype = getattr(torch, job.dtype)
    model, task, card = _load_core(Path(job.model), dtype)
    model = model.to(device)
    s = job.settings
    block = user_block(model, s.user_parameters or None, s.user_last_modules)
    lin = LinearizedModel(model, task, block)
    user = _user_data(job, card, dtype)
    first = next(user.batches(1))
    outputs = int(lin.base_outputs({k: v.to(device) for k, v in first.items()}).shape[1])
    store = store_factory(block.numel)
    common: dict[str, Any] = dict(rtol=s.cg_rtol, max_iter=s.cg_max_iter, allreduce=allreduce,
                                  batch_size=job.batch_size, outputs=outputs)
    record: dict[str, Any] = {**(context or {}), "world_size": world, "device": str(device), "dtype": job.dtype,
                              "user_dim": block.numel, "user_samples": len(user), "user_block": block.describe(),
                              "weight_decay": job.weight_decay}
    user_ids = user.sample_ids.tolist()
    if job.init_user_weights:
        loaded = read_user_weights(job.init_user_weights)
        loaded.check(job.weight_decay, user_ids)
        w = user_vector(block, {k: v for k, v in loaded.weights.items() if k != FLAT_KEY})
        record["train"] = {"loaded_from": str(job.init_user_weights)}
    else:
        shard = user.take(contiguous_shard(len(user), rank, world)).to(device)
        result = train_user_weights(lin, shard, job.weight_decay, **common)
        w = result.user_weights
        record["train"] = result.record
    store.write(w)
    final_ids = user_ids
    if job.forget.sample_ids:
        retain = user.without(user.positions_of(job.forget.sample_ids, field="forget.sample_ids"))
        shard = retain.take(contiguous_shard(len(retain), rank, world)).to(device)
        result = forget_user_data(lin, store.read(), shard, job.weight_decay, sigma=s.sigma, root=rank == 0, **common)
        store.write(result.user_weights)
        record["forget"] = {"sample_ids": list(job.forget.sample_ids), **result.record}
        final_ids = retain.sample_ids.tolist()
    final = store.read()
    record["seconds"] = time.perf_counter() - started
    if rank == 0:
        tensors = {k: v.contiguous() for k, v in user_state(block, model, final).items()}
        tensors[FLAT_KEY] = final
        _write_outputs(Path(job.output), UserWeights(tensors, job.weight_decay, final_ids), record)
        log(f"rank 0 of {world}: wrote {job.output} ({record['seconds']:.1f} s)")
    return record


def _write_outputs(output: Path, user: UserWeights, record: dict[str, Any]) -> None:
    import os
    import shutil
    import tempfile

    from pipeline.jsonio import dumps

    if output.exists():
        raise FileExistsError(f"output {output} already exists: choose a new output directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        save_user_weights(staging / USER_WEIGHTS_FILE, user)
        (staging / "mixed_linear.json").write_text(dumps(record))
        os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
