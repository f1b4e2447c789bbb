"""Streaming removals on a decision layer: a warm state updated per request without a curvature pass.

The block is the whole last Linear layer (weight W, bias b; K classes, inputs x in R^d) of a
model under softmax cross-entropy (label smoothing allowed), with the modules before it frozen
and their outputs on D cached (``pipeline.frozen_prefix``). Parameters theta = (W, b), flat in
the block order of ``ParamBlock`` (W row-major, then b); x~ = (x, 1). Per sample i:

    g_i(theta) = (p_i - t_i) (kron) x~_i            (p = softmax(W x + b), t the target)
    H_i(theta) = M_i (kron) x~_i x~_i^T,            M = diag(p) - p p^T

The retained objective (the project's convention, ``pipeline.methods.lfoci_newton``):
F_R(theta) = (1/n_R) sum_{i in R} loss_i + (lambda/2)||theta||^2, target grad F_R = a. The target
term a is grad F_D(theta_0) at the build (the weights as they are: nothing removed yet) and is
set by each removal (``remove(..., target=)``): 0 for the minimiser of F_R, or grad F_R(theta_T)
for a target point theta_T (``pipeline.target``: the recipe replay), whose unique minimiser of
F_R - <a, .> is theta_T (F_R is strictly convex).

State, at the refresh point theta_ref (the weights of the last refresh), over the retained set R:
    G_R = sum_{i in R} g_i(theta_ref),   S_R = sum_{i in R} H_i(theta_ref)   (dense, p x p)
and the first-order model of the retained gradient at any theta (exact at theta_ref):
    g^_R(theta) = (G_R + S_R (theta - theta_ref)) / n_R + lambda theta.
A removal of U (m samples) is O(m p K + m p^2 + p^2), no pass over n:
    G_R -= sum_U g_j(theta_ref),  S_R -= sum_U H_j(theta_ref)  (rank K per sample),  n_R -= m,
    theta <- theta - H_R^{-1} (g^_R(theta) - a),   H_R = S_R / n_R + lambda I,
solved by conjugate gradients preconditioned with H^{-1} factorised at the last refresh (a
Cholesky fallback). It is the exact minimiser of the quadratic model of F_R - <a, theta> around
theta_ref; right after a refresh it is one undamped Newton step of lfoci-newton (retained form).

Drift bound (recorded with every removal). For softmax, ||M(z') - M(z)||_2 <= 3 ||z' - z||_2
(dM = diag(q) - q p^T - p q^T with q = p o (u - <p, u>), ||q||_2 <= ||u||_2), and
||z' - z|| <= ||theta' - theta||_2 ||x~||, ||J|| = ||x~||, so H_i is Lipschitz with 3 ||x~_i||^3 and
    ||grad F_R(theta) - g^_R(theta)|| <= C_R ||theta - theta_ref||^2,
    C_R = (3 / (2 n_R)) sum_{i in R} ||x~_i||^3.
After a fast step the tracked residual g^_R - a is ~0 (solver tolerance r_s), so the true residual
is at most ``gradient_error_bound`` = C_R ||theta - theta_ref||^2 + r_s and, F_R - <a, .> being
lambda-strongly convex, ||theta - theta*_R|| <= that / lambda (``distance_bound``).

Refresh (converged to ||grad F_R - a|| <= refresh_tol by a chord iteration on the state's own
curvature with exact gradients, then one exact pass over R at the result: G_R, S_R, Cholesky of
H_R; Newton steps with fresh curvature only if the chord did not get there): every
``refresh_every`` removals, or when the drift after a fast step exceeds ``drift_threshold``, or
when asked (``refresh()``). The drift is the a-priori bound above (``drift_measure: lipschitz``,
O(1)) or the exact residual ||grad F_R(theta) - a|| on the cached inputs (``gradient``: one
O(n K d) product, 1/(K (d+1)) of a curvature pass; the a-priori bound is recorded either way);
``distance_bound`` = drift / lambda. Each removal returns a ``StreamStep`` saying which path it
took.

``publish_dtype`` (e.g. float32 for a float32 model): a fast step's weights are rounded to it
before the drift is measured, so the state holds, and the drift measure is of, the weights as they
will be published (the residual of the rounded weights, one pass, not one before and one after
rounding). A refresh's result is left in float64.

The exact gradient runs over every cached row with the removed rows weighted 0 (no copy of the
retained rows per call).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from pipeline.curvature import DenseOperator, cg_solve
from pipeline.curvature.solve import inverse_from_cholesky
from pipeline.curvature.linear_layer import closed_form_layer, linear_cross_entropy_hessian
from pipeline.data.sampleset import SampleSet
from pipeline.decision_layer import DecisionLayerState
from pipeline.param_block import BlockPart, ParamBlock
from pipeline.tasks import Task

__all__ = ["StreamSettings", "StreamStep", "DecisionLayerStream", "SOFTMAX_HESSIAN_LIPSCHITZ"]

SOFTMAX_HESSIAN_LIPSCHITZ = 3.0  # ||M(z') - M(z)||_2 <= 3 ||z' - z||_2 (module docstring)


@dataclass(frozen=True)
class StreamSettings:
    """refresh_every: K, removals between exact refreshes (1 = every removal is a refresh);
    drift_threshold: refresh once the drift passes this (inf = never on drift);
    drift_measure: "lipschitz" = the a-priori bound C_R ||theta - theta_ref||^2 + tracked residual
    (O(1) per removal, rigorous, pessimistic: it assumes every sample at the worst curvature
    change); "gradient" = the exact residual ||grad F_R(theta) - a|| on the cached inputs (one
    O(n K d) product over R per removal, no curvature pass; the tightest rigorous measure);
    refresh_tol: a refresh converges to ||grad F_R - a|| <= this; refresh_max_steps: its Newton
    steps with fresh curvature at most (chord steps: 4x this); solve_rtol: relative residual of
    every Newton system."""

    refresh_every: int = 100
    drift_threshold: float = 1e-4
    refresh_tol: float = 1e-9
    refresh_max_steps: int = 8
    solve_rtol: float = 1e-10
    drift_measure: str = "lipschitz"

    def __post_init__(self) -> None:
        if self.drift_measure not in ("lipschitz", "gradient"):
            raise ValueError(f"drift_measure must be 'lipschitz' or 'gradient' (got {self.drift_measure!r})")
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1 (got {self.refresh_every}); 1 refreshes at every removal")
        if not self.drift_threshold > 0:
            raise ValueError(f"drift_threshold must be > 0 (got {self.drift_threshold}); use .inf for 'never on drift'")
        if not self.refresh_tol > 0 or self.refresh_max_steps < 1 or not self.solve_rtol > 0:
            raise ValueError("refresh_tol and solve_rtol must be > 0 and refresh_max_steps >= 1")


@dataclass
class StreamStep:
    """What one removal did: ``path`` "fast" (incremental) or "refresh" (exact full pass), why."""

    sample_ids: list[int]
    path: str
    reason: str
    n_before: int
    n_after: int
    drift: float                    # the measure compared with drift_threshold (before any refresh)
    drift_measure: str              # "lipschitz" or "gradient"
    gradient_error_bound: float     # a priori: C_R ||theta - theta_ref||^2 + tracked residual >= ||grad F_R - a||
    residual_measured: float | None  # "gradient": ||grad F_R(theta) - a|| exactly (None otherwise)
    distance_bound: float           # drift / lambda: ||theta - theta*_R|| at most this (before any refresh)
    distance_from_refresh: float    # ||theta - theta_ref||
    step_norm: float                # ||theta_after - theta_before|| of this removal
    residual_after: float           # ||grad F_R - a||: tracked (fast) or exact (refresh)
    solver: dict[str, Any]
    seconds: float
    refresh: dict[str, Any] | None = None

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Refresh:
    theta: Tensor            # theta_ref
    inverse: Tensor          # H_R(theta_ref)^{-1} at the refresh
    n: int


class DecisionLayerStream:
    """The warm state (see the module docstring). Build it with ``from_model`` or directly from
    cached features ``x`` (n, d), labels ``y`` (n,), ``sample_ids`` (n,), the layer's ``weight``
    (K, d) and ``bias`` (K,). Everything is float64 on the CPU."""

    def __init__(self, x: Tensor, y: Tensor, sample_ids: Tensor, weight: Tensor, bias: Tensor, weight_decay: float,
                 *, label_smoothing: float = 0.0, settings: StreamSettings | None = None,
                 publish_dtype: torch.dtype | None = None) -> None:
        if not weight_decay > 0:
            raise ValueError("the streaming state needs weight_decay > 0 (a strongly convex block objective); "
                             f"got {weight_decay}")
        if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1] or bias.shape != (weight.shape[0],):
            raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                             f"bias {tuple(bias.shape)}")
        self.settings = settings or StreamSettings()
        self.publish_dtype = None if publish_dtype in (None, torch.float64) else publish_dtype
        self.x = x.detach().to("cpu", torch.float64).contiguous()
        self.y = y.detach().to("cpu", torch.long)
        self.sample_ids = sample_ids.detach().to("cpu", torch.long)
        self.k, self.d = weight.shape
        self.p = self.k * (self.d + 1)
        self.lam = float(weight_decay)
        self.smoothing = float(label_smoothing)
        self._position = {int(i): j for j, i in enumerate(self.sample_ids.tolist())}
        if len(self._position) != len(self.sample_ids):
            raise ValueError("sample_ids must be unique")
        self.retained = torch.ones(len(self.sample_ids), dtype=torch.bool)
        self.n = len(self.sample_ids)
        self.cube = (self.x.pow(2).sum(dim=1) + 1.0).pow(1.5)          # ||x~_i||^3
        self.cube_sum = float(self.cube.sum())
        self.theta = torch.cat([weight.detach().reshape(-1), bias.detach()]).to("cpu", torch.float64)
        self.block = ParamBlock([BlockPart("weight", (self.k, self.d)), BlockPart("bias", (self.k,))])
        self.removals_since_refresh = 0
        self.total_removed = 0
        self.refreshes = 0
        self.G = torch.zeros(self.p, dtype=torch.float64)
        self.S = torch.zeros(self.p, self.p, dtype=torch.float64)
        self._ref: _Refresh | None = None
        # a = grad F_D(theta_0), exact at the build weights: the state holds them until a removal sets its target
        self.anchor = self._gradient_sum(self.x, self.y, self.theta) / self.n + self.lam * self.theta
        self.build_record = self.refresh(converge=False, reason="build")

    # -- construction from a model ---------------------------------------------------------
    @classmethod
    def from_state(cls, prepared: DecisionLayerState, model: nn.Module, task: Task, train: SampleSet,
                   weight_decay: float, *, settings: StreamSettings | None = None,
                   publish_dtype: torch.dtype | None = None) -> tuple["DecisionLayerStream", Any]:
        """The stream over the decision layer of ``prepared`` (the state the decision-layer methods
        prepare for ``model`` and ``train``: the same cached prefix outputs); returns it and the
        frozen prefix's split (None when the layer is the whole model): ``split.prefix(model, batch)``
        maps a batch of inputs to the layer's inputs."""
        suffix, task, data = prepared.suffix_and_data(model, task, train)
        assert prepared.block is not None
        layer = closed_form_layer(suffix, task, prepared.block)
        assert layer is not None and layer.bias is not None  # DecisionLayerState.build checked both
        x = data.columns["x"].reshape(len(data), -1)
        smoothing = float(getattr(task, "loss_options", {}).get("label_smoothing", 0.0))
        state = cls(x, data.columns["y"], data.sample_ids, layer.weight, layer.bias, weight_decay,
                    label_smoothing=smoothing, settings=settings, publish_dtype=publish_dtype)
        return state, (None if prepared.prefix is None else prepared.prefix.split)

    @classmethod
    def from_model(cls, model: nn.Module, task: Task, train: SampleSet, parameters: Sequence[str],
                   weight_decay: float, *, settings: StreamSettings | None = None,
                   batch_size: int = 4096, publish_dtype: torch.dtype | None = None,
                   ) -> tuple["DecisionLayerStream", nn.Module | None]:
        """``from_state`` of the decision-layer state prepared for ``model`` (the decision-layer
        methods' own preparation, ``pipeline.methods.base.prepare``), its layer named by ``parameters``.
        Raises ``ValueError`` naming the fix when they are not the whole weight and bias of the last
        Linear layer of a Sequential under cross-entropy."""
        from pipeline.methods.base import TrainedModel, get_method, prepare

        method = get_method("decision-layer-newton")
        settings_ = method.Settings(parameters=list(parameters))
        prepared, _ = prepare(method, TrainedModel(model, task, train, weight_decay, batch_size), settings_)
        return cls.from_state(prepared, model, task, train, weight_decay, settings=settings,
                              publish_dtype=publish_dtype)

    # -- closed forms ------------------------------------------------------------------------
    def _probs_targets(self, x: Tensor, y: Tensor, theta: Tensor) -> tuple[Tensor, Tensor]:
        w = theta[: self.k * self.d].reshape(self.k, self.d)
        b = theta[self.k * self.d:]
        p = torch.softmax(x @ w.T + b, dim=1)
        t = torch.full_like(p, self.smoothing / self.k)
        t[torch.arange(len(y)), y] += 1.0 - self.smoothing
        return p, t

    def _gradient_sum(self, x: Tensor, y: Tensor, theta: Tensor, weights: Tensor | None = None) -> Tensor:
        """sum_i w_i (p_i - t_i) (kron) x~_i in block order (loss only, no ridge; w_i = 1 by default)."""
        p, t = self._probs_targets(x, y, theta)
        r = p - t
        if weights is not None:
            r.mul_(weights.to(r.dtype)[:, None])
        return torch.cat([(r.T @ x).reshape(-1), r.sum(dim=0)])

    def _hessian_factor(self, x: Tensor, y: Tensor, theta: Tensor) -> Tensor:
        """U (p, m K) with U U^T = sum_j H_j(theta): M = Q Q^T, Q = diag(sqrt p) - p sqrt(p)^T,
        so H_j = (Q (kron) x~_j)(Q (kron) x~_j)^T."""
        p, _ = self._probs_targets(x, y, theta)
        s = p.sqrt()
        q = torch.diag_embed(s) - p[:, :, None] * s[:, None, :]             # (m, K, K): M_j = Q_j Q_j^T
        u_w = q[:, :, None, :] * x[:, None, :, None]                         # (m, K, d, K)
        u = torch.cat([u_w.reshape(len(x), self.k * self.d, self.k), q], dim=1)   # (m, p, K)
        return u.permute(1, 0, 2).reshape(self.p, len(x) * self.k)

    def _curvature_sum(self, x: Tensor, theta: Tensor) -> Tensor:
        """sum_i H_i(theta) over the rows of x (``pipeline.curvature.linear_layer``, no ridge)."""
        w = theta[: self.k * self.d].reshape(self.k, self.d)
        b = theta[self.k * self.d:]
        return linear_cross_entropy_hessian(w, b, {"weight": "weight", "bias": "bias"}, self.block, x,
                                            weight_decay=0.0, reduction="sum")

    def _full_pass(self) -> None:
        """Exact G_R, S_R at the current weights over R (the one pass over n)."""
        x, y = self.x[self.retained], self.y[self.retained]
        self.G = self._gradient_sum(x, y, self.theta)
        self.S = self._curvature_sum(x, self.theta)

    def system(self) -> Tensor:
        """H_R = S_R / n_R + lambda I (the Hessian of F_R at theta_ref, dense)."""
        h = self.S / self.n
        h.diagonal().add_(self.lam)
        return h

    # -- what the state says --------------------------------------------------------------
    def tracked_gradient(self) -> Tensor:
        """g^_R(theta) = (G_R + S_R (theta - theta_ref)) / n_R + lambda theta."""
        assert self._ref is not None
        return (self.G + self.S @ (self.theta - self._ref.theta)) / self.n + self.lam * self.theta

    def exact_gradient(self, theta: Tensor | None = None) -> Tensor:
        """grad F_R(theta), a full pass (for refreshes, tests and audits)."""
        theta = self.theta if theta is None else theta
        return self._gradient_sum(self.x, self.y, theta, self.retained) / self.n + self.lam * theta

    def drift_constant(self) -> float:
        """C_R = (3 / (2 n_R)) sum_R ||x~_i||^3."""
        return SOFTMAX_HESSIAN_LIPSCHITZ * self.cube_sum / (2.0 * self.n)

    def gradient_error_bound(self) -> float:
        """Bound on ||grad F_R(theta) - g^_R(theta)||: C_R ||theta - theta_ref||^2."""
        assert self._ref is not None
        return self.drift_constant() * float(torch.linalg.vector_norm(self.theta - self._ref.theta)) ** 2

    def publishable(self, theta: Tensor) -> Tensor:
        """``theta`` rounded to ``publish_dtype`` (as float64); unchanged without one."""
        return theta if self.publish_dtype is None else theta.to(self.publish_dtype).to(torch.float64)

    @property
    def weight(self) -> Tensor:
        return self.theta[: self.k * self.d].reshape(self.k, self.d)

    @property
    def bias(self) -> Tensor:
        return self.theta[self.k * self.d:]

    def retained_ids(self) -> Tensor:
        return self.sample_ids[self.retained]

    def positions(self, sample_ids: Sequence[int], field: str = "sample_ids") -> Tensor:
        """Positions of retained ids; an unknown or already removed id is a ValueError naming ``field``."""
        out = []
        for i in sample_ids:
            j = self._position.get(int(i))
            if j is None:
                raise ValueError(f"{field}: sample id {int(i)} is not in the training set of this state")
            if not bool(self.retained[j]):
                raise ValueError(f"{field}: sample id {int(i)} was already removed")
            out.append(j)
        if len(set(out)) != len(out):
            raise ValueError(f"{field}: a sample id appears twice")
        return torch.tensor(out, dtype=torch.long)

    # -- the two paths -----------------------------------------------------------------------
    def _solve(self, h: Tensor, rhs: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """H x = rhs by CG preconditioned with the refresh's inverse; Cholesky if CG stalls."""
        assert self._ref is not None
        inv = self._ref.inverse
        x, info = cg_solve(DenseOperator(h), rhs, precondition=lambda r: inv @ r, rtol=self.settings.solve_rtol,
                           max_iter=50, solver="pcg-refresh-inverse")
        if info.converged:
            return x, {"solver": "pcg-refresh-inverse", "iterations": info.iterations,
                       "relative_residual": info.relative_residual}
        x = torch.cholesky_solve(rhs[:, None], torch.linalg.cholesky(h)).squeeze(1)
        rel = float(torch.linalg.vector_norm(h @ x - rhs) / max(float(torch.linalg.vector_norm(rhs)), 1e-300))
        return x, {"solver": "cholesky", "iterations": 1, "relative_residual": rel}

    def refresh(self, *, converge: bool = True, reason: str = "asked") -> dict[str, Any]:
        """Exact pass at the current weights; sets theta_ref = theta. With ``converge``, first a
        chord iteration theta <- theta - H_R^{-1} (grad F_R(theta) - a) with the state's own
        (incremental) curvature factorised once and an exact gradient per step (O(n K d) each),
        until ||grad F_R - a|| <= refresh_tol; then the one curvature pass at the result; should
        the residual still be above the tolerance, Newton steps with a fresh curvature each."""
        started = time.perf_counter()
        steps: list[dict[str, Any]] = []
        theta_start = self.theta.clone()
        tol, budget = self.settings.refresh_tol, self.settings.refresh_max_steps
        if converge and self._ref is not None:
            chol = torch.linalg.cholesky(self.system())
            for _ in range(4 * budget):
                residual = self.exact_gradient() - self.anchor
                norm = float(torch.linalg.vector_norm(residual))
                if norm <= tol:
                    break
                step = torch.cholesky_solve(residual[:, None], chol).squeeze(1)
                self.theta = self.theta - step
                steps.append({"kind": "chord", "residual_before": norm, "step_norm": float(torch.linalg.vector_norm(step))})
        while True:
            self._full_pass()
            chol = torch.linalg.cholesky(self.system())
            residual = self.G / self.n + self.lam * self.theta - self.anchor
            norm = float(torch.linalg.vector_norm(residual))
            self._ref = _Refresh(self.theta.clone(), inverse_from_cholesky(chol), self.n)
            newton = sum(s["kind"] == "newton" for s in steps)
            if not converge or norm <= tol or newton >= budget:
                break
            step = torch.cholesky_solve(residual[:, None], chol).squeeze(1)
            self.theta = self.theta - step
            steps.append({"kind": "newton", "residual_before": norm, "step_norm": float(torch.linalg.vector_norm(step))})
        self.removals_since_refresh = 0
        self.refreshes += 1
        return {"reason": reason, "chord_steps": sum(s["kind"] == "chord" for s in steps),
                "newton_steps": sum(s["kind"] == "newton" for s in steps), "residual_after": norm,
                "converged": norm <= tol, "moved": float(torch.linalg.vector_norm(self.theta - theta_start)),
                "history": steps, "seconds": time.perf_counter() - started}

    def remove(self, sample_ids: Sequence[int], *, field: str = "sample_ids", force_refresh: bool = False,
               target: "Callable[[DecisionLayerStream], Tensor] | None" = None) -> StreamStep:
        """Remove ``sample_ids`` (retained, distinct): the fast path, then a refresh when K removals
        have passed since the last one, when the drift bound passes the threshold, or when forced.
        ``target(state)``, called once the samples are out of the retained set, gives the new target
        term a (0: the minimiser of F_R; grad F_R(theta_T): the point theta_T); None keeps a."""
        started = time.perf_counter()
        assert self._ref is not None
        pos = self.positions(sample_ids, field)
        m = len(pos)
        if m == 0:
            raise ValueError(f"{field}: no sample ids to remove")
        if m >= self.n:
            raise ValueError(f"{field}: removing {m} samples would leave none of the {self.n} retained; retrain")
        n_before, theta_before = self.n, self.theta.clone()
        x, y = self.x[pos], self.y[pos]
        self.G -= self._gradient_sum(x, y, self._ref.theta)
        u = self._hessian_factor(x, y, self._ref.theta)
        self.S.addmm_(u, u.T, alpha=-1.0)
        self.retained[pos] = False
        self.n -= m
        self.cube_sum -= float(self.cube[pos].sum())
        self.total_removed += m
        self.removals_since_refresh += 1
        if target is not None:
            self.anchor = target(self).to(torch.float64)
        # the fast step: the minimiser of the quadratic model of F_R - <a, theta>
        residual = self.tracked_gradient() - self.anchor
        delta, solver = self._solve(self.system(), residual)
        self.theta = self.publishable(self.theta - delta)
        tracked = float(torch.linalg.vector_norm(self.tracked_gradient() - self.anchor))
        bound = self.gradient_error_bound() + tracked
        measured = (float(torch.linalg.vector_norm(self.exact_gradient() - self.anchor))
                    if self.settings.drift_measure == "gradient" else None)
        drift = bound if measured is None else measured
        distance = float(torch.linalg.vector_norm(self.theta - self._ref.theta))
        reason = ("forced" if force_refresh else
                  "every_k" if self.removals_since_refresh >= self.settings.refresh_every else
                  "drift" if drift > self.settings.drift_threshold else "")
        refreshed = self.refresh(reason=reason) if reason else None
        return StreamStep(
            sample_ids=[int(i) for i in sample_ids], path="refresh" if refreshed else "fast", reason=reason or "within_bound",
            n_before=n_before, n_after=self.n, drift=drift, drift_measure=self.settings.drift_measure,
            gradient_error_bound=bound, residual_measured=measured, distance_bound=drift / self.lam,
            distance_from_refresh=distance, step_norm=float(torch.linalg.vector_norm(self.theta - theta_before)),
            residual_after=refreshed["residual_after"] if refreshed else tracked, solver=solver,
            seconds=time.perf_counter() - started, refresh=refreshed)

    def describe(self) -> dict[str, Any]:
        return {"classes": self.k, "inputs": self.d, "block_numel": self.p, "n_retained": self.n,
                "removed": self.total_removed, "refreshes": self.refreshes,
                "target_term_norm": float(torch.linalg.vector_norm(self.anchor)), "weight_decay": self.lam,
                "settings": asdict(self.settings), "drift_constant": self.drift_constant(),
                "publish_dtype": None if self.publish_dtype is None else str(self.publish_dtype).removeprefix("torch."),
                "removals_since_refresh": self.removals_since_refresh}
