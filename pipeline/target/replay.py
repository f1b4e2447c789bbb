"""Recipe replay: where Retrain (the card's SGD recipe from the card's w_init, run on R = D \\ U)
puts a parameter block on average over its shuffles, computed without retraining.

1. Heavy-ball SGD (v <- beta v + grad L(w); w <- w - eta_k v), averaged over shuffles, follows the
   same recursion with the full-batch gradient (the mean-field run) closely: on digits the
   mean-field run of the recipe lands 0.4-0.5 spreads from the mean of 8 SGD retrains, closer than
   any single retrain (about 1.06). The target is that run on R, on R's own schedule
   (``epochs * ceil(|R| / B)`` steps at the cosine rates):
       v <- beta v + grad L_R(w);   w <- w - eta_k v,   k < N_R,   from w_init with v = 0.      (1)
2. grad L_R(w) is replaced by the Gauss-Newton model of a base b (Martens 2010; the exact Hessian of
   a ReLU network makes (1) unstable: negative curvature amplified by momentum):
       grad L_R(w) ~ g_R(b) + G(b) (w - b) + lambda w.                                         (2)
   On a window with one base, (1)+(2) is linear: each eigen-mode h of G(b) + lambda I is multiplied
   by the heavy-ball filter of the window's rates, about (1 - exp(-h tau)) / h (the training-budget
   filter: 1/h for stiff modes, tau for flat ones). The exact minimiser applies 1/h to every mode
   and the anchored point grad L_R = grad L_D(w0) the unfiltered shift: both overshoot where
   training had not converged.
3. Bases: checkpoints c_j of the mean-field run on D, prepared once per model (independent of U):
   c_j, g_D(c_j), G_D(c_j); a removal corrects their gradients with one pass over U,
   g_R(c_j) = (n g_D(c_j) - m g_U(c_j)) / (n - m), and keeps G_D(c_j). Model (2) is trusted while
   the output residual it implies stays right on a fixed probe of retained samples: the RMS over
   the probe of p(z(w)) - [p_b + (diag p_b - p_b p_b^T) J_b (w - b)] (the softmax's and the
   network's linearisation both; raw outputs for a loss that is quadratic in them). When no
   neighbouring base is within ``threshold``, g_R and G_R are evaluated at the current point (a
   refresh: one gradient and one curvature pass over R) and that point becomes a base. Random
   forget sets stay in the checkpoints' trust region; a whole class leaves it (Retrain never learns
   the class) and takes a few refreshes. The checkpoints are placed by the same rule on D.

Cost, P = block size: preparation K checkpoints (one gradient and one curvature pass over D each)
and a probe forward per step; a removal K gradient passes over U, M refreshes over R, probe checks
and N_R dense P x P products. Everything is float64 on the CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

__all__ = ["Base", "Oracle", "ReplayCost", "ReplayPrepared", "ReplaySchedule", "prepare_replay", "replay_target"]


@dataclass(frozen=True)
class ReplaySchedule:
    """The SGD recipe the replay follows (``pipeline.training.fit_sgd``): heavy ball with momentum
    ``momentum``, CosineAnnealingLR(T_max=epochs) stepped once per epoch, ``ceil(n / batch_size)``
    steps per epoch, weight decay ``weight_decay`` on the block."""

    epochs: int
    lr: float
    momentum: float
    batch_size: int
    weight_decay: float

    def epoch_rates(self) -> list[float]:
        """lr (1 + cos(pi e / E)) / 2 for e < E."""
        return [self.lr * (1 + math.cos(math.pi * e / self.epochs)) / 2 for e in range(self.epochs)]

    def step_rates(self, n: int) -> list[float]:
        per = (n + self.batch_size - 1) // self.batch_size
        return [rate for rate in self.epoch_rates() for _ in range(per)]

    def training_time(self, n: int) -> float:
        """tau = sum_k eta_k (1 - beta^(k+1)) / (1 - beta): the sum of rates heavy ball applies on n
        samples (the training budget; a mode of curvature h is trained to 1 - exp(-h tau))."""
        beta = self.momentum
        return sum(a * (1 - beta ** (k + 1)) / (1 - beta) for k, a in enumerate(self.step_rates(n)))


class Oracle(Protocol):
    """The mean loss on a parameter block at block weights w (1-D float64, P entries) over sample
    positions ``idx`` of D (0 .. n-1); weight decay is not included."""

    n: int
    outputs_are_logits: bool  # softmax cross-entropy (probabilities judge the trust region) or raw outputs

    def grad(self, w: Tensor, idx: Tensor) -> Tensor:
        """mean over idx of the per-sample loss gradient, (P,)"""

    def curvature(self, w: Tensor, idx: Tensor) -> Tensor:
        """mean over idx of the per-sample Gauss-Newton matrix J^T H_out J, (P, P)"""

    def outputs(self, w: Tensor, idx: Tensor) -> Tensor:
        """outputs on idx, (len(idx), C)"""

    def jvp(self, w: Tensor, idx: Tensor, v: Tensor) -> Tensor:
        """J(w) v on idx, (len(idx), C)"""


@dataclass
class ReplayCost:
    """Work in samples through the model; ``passes()`` in passes over D."""

    n: int
    gradient_samples: int = 0
    curvature_samples: int = 0
    probe_samples: int = 0
    refreshes: int = 0
    checkpoints: int = 0
    steps: int = 0

    def as_record(self) -> dict[str, float | int]:
        return {"gradient_passes": self.gradient_samples / self.n, "curvature_passes": self.curvature_samples / self.n,
                "probe_passes": self.probe_samples / self.n, "refreshes": self.refreshes,
                "checkpoints": self.checkpoints, "steps": self.steps}


@dataclass
class Base:
    progress: float   # epochs of training when taken
    w: Tensor
    g: Tensor         # mean loss gradient of the base's set at w (no weight decay)
    G: Tensor         # its Gauss-Newton matrix at w


@dataclass
class ReplayPrepared:
    """What a removal needs that does not depend on U: the mean-field run of the recipe on D."""

    schedule: ReplaySchedule
    w_init: Tensor
    checkpoints: list[Base]
    probe: Tensor              # positions in D of the trust-region probe
    threshold: float           # the preparation's trust region (a removal uses 2x)
    w_mean_field: Tensor       # where the mean-field run on D ends (the denoised original)
    cost: ReplayCost
    seconds: float = 0.0
    memory_bytes: int = field(default=0)


def _residual_error(z_w: Tensor, z_b: Tensor, jv: Tensor, logits: bool) -> float:
    """RMS over the probe of the output residual's departure from the base's linear model."""
    if not logits:
        return float((z_w - z_b - jv).pow(2).sum(-1).mean().sqrt())
    p_w, p_b = torch.softmax(z_w, -1), torch.softmax(z_b, -1)
    linear = p_b + p_b * jv - p_b * (p_b * jv).sum(-1, keepdim=True)
    return float((p_w - linear).pow(2).sum(-1).mean().sqrt())


def _run(oracle: Oracle, schedule: ReplaySchedule, w_init: Tensor, n_set: int,
         neighbours: Callable[[float], Sequence[Base]], exact: Callable[[Tensor, float], Base],
         probe: Tensor, threshold: float, cost: ReplayCost, progress: Callable[[int, int], None] | None,
         forced: int = 0) -> Tensor:
    """Recursion (1) on the schedule of a set of ``n_set`` samples, the gradient from model (2) of the
    nearest neighbouring base while its probe error is within ``threshold``, else of a fresh exact
    base (``exact``). The probe is checked every step near the trust boundary, every 2-4 steps far
    inside it (the error grows about quadratically with the distance). ``forced``: also a fresh exact
    base at ``forced`` evenly spaced steps."""
    rates = schedule.step_rates(n_set)
    steps = len(rates)
    beta, lam = schedule.momentum, schedule.weight_decay
    w, v = w_init.clone(), torch.zeros_like(w_init)
    last: Base | None = None
    best: Base | None = None
    base_outputs: dict[int, Tensor] = {}

    def outputs_at(b: Base) -> Tensor:
        if id(b) not in base_outputs:
            base_outputs[id(b)] = oracle.outputs(b.w, probe)
            cost.probe_samples += len(probe)
        return base_outputs[id(b)]

    next_check = 0
    every = steps // forced if forced > 0 else 0
    for k, eta in enumerate(rates):
        at = schedule.epochs * k / steps
        near_bases = list(neighbours(at))
        near = min(near_bases, key=lambda b: float((w - b.w).norm())) if near_bases else None
        if every and k % every == 0:
            best = last = exact(w, at)
            next_check = k + 1
        elif math.isinf(threshold) and near is not None:
            best = near
        elif best is None or k >= next_check:
            pool = ([near] if near is not None else []) + ([last] if last is not None else [])
            best, error = None, math.inf
            if pool:
                z_w = oracle.outputs(w, probe)
                cost.probe_samples += len(probe)
                for b in pool:
                    cost.probe_samples += len(probe)
                    e = _residual_error(z_w, outputs_at(b), oracle.jvp(b.w, probe, w - b.w), oracle.outputs_are_logits)
                    if e < error:
                        best, error = b, e
            if best is None or error > threshold:
                best = last = exact(w, at)
                error = 0.0
            gap = 1
            if best is not last:
                gap = 1 if error > threshold / 2 else 2 if error > threshold / 4 else 4
            next_check = k + gap
        elif best is not last and near is not None:
            best = near
        assert best is not None
        v = beta * v + best.g + best.G @ (w - best.w) + lam * w
        w = w - eta * v
        if progress is not None:
            progress(k + 1, steps)
    cost.steps += steps
    return w


def _neighbours(bases: list[Base], at: float) -> list[Base]:
    """the checkpoints just before and just after training progress ``at``"""
    before = [b for b in bases if b.progress <= at]
    after = [b for b in bases if b.progress > at]
    return ([before[-1]] if before else []) + ([after[0]] if after else [])


def prepare_replay(oracle: Oracle, schedule: ReplaySchedule, w_init: Tensor, *, threshold: float = 0.02,
                   probe_size: int = 64, seed: int = 0, progress: Callable[[int, int], None] | None = None
                   ) -> ReplayPrepared:
    """The mean-field run of the recipe on D with checkpoints placed by the trust-region rule."""
    import time

    started = time.perf_counter()
    n = oracle.n
    probe = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:probe_size]
    cost = ReplayCost(n)
    every = torch.arange(n)
    checkpoints: list[Base] = []

    def exact(w: Tensor, at: float) -> Base:
        cost.gradient_samples += n
        cost.curvature_samples += n
        base = Base(at, w.clone(), oracle.grad(w, every), oracle.curvature(w, every))
        checkpoints.append(base)
        return base

    w_end = _run(oracle, schedule, w_init.to(torch.float64), n, lambda at: [], exact, probe, threshold, cost, progress)
    cost.checkpoints = len(checkpoints)
    size = sum(b.G.numel() * b.G.element_size() for b in checkpoints)
    return ReplayPrepared(schedule, w_init.to(torch.float64).clone(), checkpoints, probe, threshold, w_end, cost,
                          time.perf_counter() - started, size)


#: Exact refreshes at evenly spaced steps when a removal takes every sample of a class: Retrain never
#: learns that class, its logit falls all along the path, and a probe of retained samples (which
#: give it little probability) can miss the linear model's failure (measured on R8's decision layer:
#: no refresh, the class still recognised). 12 evenly spaced refreshes alone put digits' classes at
#: 0.54-0.70 spreads, 6 at 1.3-1.9; the trust region's own refreshes come on top.
CLASS_REFRESHES = 8


def replay_target(oracle: Oracle, prepared: ReplayPrepared, forget: Tensor, *, threshold: float | None = None,
                  progress: Callable[[int, int], None] | None = None, labels: Tensor | None = None
                  ) -> tuple[Tensor, ReplayCost]:
    """The mean-field Retrain on R = D \\ forget (positions in D), from ``prepared``'s checkpoints
    (gradients corrected over U) and refreshes where they no longer model the gradient. ``labels``
    (class labels of D, when the task has them): a removal that leaves a class of D with no retained
    sample also refreshes at ``CLASS_REFRESHES`` evenly spaced steps."""
    n = oracle.n
    threshold = 2 * prepared.threshold if threshold is None else threshold
    forget = torch.as_tensor(forget, dtype=torch.long)
    m = len(forget)
    if m >= n:
        raise ValueError("the forget set is the whole training set: Retrain has nothing to train on")
    keep = torch.ones(n, dtype=torch.bool)
    keep[forget] = False
    retained = torch.nonzero(keep).flatten()
    probe = prepared.probe[keep[prepared.probe]]
    if len(probe) == 0:
        probe = retained[:64]
    cost = ReplayCost(n, checkpoints=len(prepared.checkpoints))
    bases: list[Base] = []
    for c in prepared.checkpoints:
        if m == 0:
            bases.append(c)
            continue
        g_forget = oracle.grad(c.w, forget)
        cost.gradient_samples += m
        bases.append(Base(c.progress, c.w, (n * c.g - m * g_forget) / (n - m), c.G))

    def exact(w: Tensor, at: float) -> Base:
        cost.refreshes += 1
        cost.gradient_samples += n - m
        cost.curvature_samples += n - m
        return Base(at, w.clone(), oracle.grad(w, retained), oracle.curvature(w, retained))

    absent = labels is not None and bool((~torch.isin(torch.unique(labels), torch.unique(labels[keep]))).any())
    w = _run(oracle, prepared.schedule, prepared.w_init, n - m, lambda at: _neighbours(bases, at), exact, probe,
             threshold, cost, progress, forced=CLASS_REFRESHES if absent else 0)
    return w, cost
