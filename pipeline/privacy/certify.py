"""When a Newton removal's Gaussian noise may claim (epsilon, delta): Sekhari et al.'s conditions.

Sekhari, Acharya, Kamath, Suresh (NeurIPS 2021, Thm 3.2): removing m of n samples by a full-
parameter Newton step from the exact minimiser of a lambda-strongly convex objective whose loss is
L-Lipschitz with an M-Lipschitz Hessian lands within gamma = 2 M L^2 m^2 / (lambda^3 n^2) of the
retrained optimum; N(0, sigma^2 I) calibrated to gamma (``pipeline.privacy.noise``) then makes the
release (epsilon, delta)-indistinguishable from the exact retrained optimum plus the same noise.

``PrivacySettings`` holds the settings every Newton method with that noise reads; ``release`` says
``certified`` only where every condition holds, else ``heuristic`` with each reason listed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from pipeline.privacy.noise import DEFAULT_HESSIAN_LIPSCHITZ, DEFAULT_LIPSCHITZ_LOSS, NoiseCalibration, calibrate
from pipeline.privacy.release import Guarantee, PrivacyRelease
from pipeline.tasks import Task

if TYPE_CHECKING:
    from pipeline.data.sampleset import SampleSet

__all__ = ["COMPARATOR", "NOISE_FREE_STEP_KEYS", "DataBounds", "published_history", "PrivacySettings", "calibration", "constants_below_bounds", "convex_model_reason",
           "data_bounds", "release", "rounding_allowance"]

# Model classes whose loss is convex in the parameters: a single affine map (after flattening)
# under a loss that is convex in the logits.
_AFFINE_ONLY = (nn.Sequential, nn.Flatten, nn.Identity, nn.Linear)
_CONVEX_LOSSES = {"cross_entropy", "mse", "bce_multilabel"}


class PrivacySettings(BaseModel):
    """The settings of the Sekhari noise, a base of the Newton methods' settings."""

    model_config = ConfigDict(extra="forbid")

    exact_start_tol: float = Field(1e-8, gt=0, description="certification: ||grad L_D(w)|| below this counts "
                                                           "as the exact minimiser")
    epsilon: float = Field(math.inf, description="privacy budget of this removal; inf = no noise")
    delta: float = Field(1e-5)
    lipschitz_loss: float = Field(DEFAULT_LIPSCHITZ_LOSS, gt=0)
    hessian_lipschitz: float = Field(DEFAULT_HESSIAN_LIPSCHITZ, gt=0)
    strong_convexity: float | None = Field(None, gt=0, description="lambda of the bound; default: weight decay")

    @field_validator("epsilon")
    @classmethod
    def _eps(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("epsilon must be > 0 (use .inf for no noise)")
        return v

    @field_validator("delta")
    @classmethod
    def _delta(cls, v: float) -> float:
        if not 0 < v < 1:
            raise ValueError("delta must lie strictly between 0 and 1")
        return v


@dataclass(frozen=True)
class DataBounds:
    """Constants of the loss bounded from the model and its data (a convex model: one Linear map
    over inputs x, x~ = (x, 1), R = max ||x~|| over the data): ``lipschitz_loss`` L and
    ``hessian_lipschitz`` M of the per-sample loss in the weights, ``what`` says how.
      cross-entropy   grad = (p - t) (x) x~ with ||p - t|| <= sqrt(2): L = sqrt(2) R; the Hessian
                      M(z) (x) x~ x~^T with ||M(z') - M(z)|| <= 3 ||z' - z|| <= 3 ||w' - w|| R: M = 3 R^3
      mse             the Hessian (2/K) I (x) x~ x~^T does not depend on w: M = 0 (gamma = 0 whatever L)"""

    lipschitz_loss: float | None
    hessian_lipschitz: float
    what: str


def data_bounds(model: nn.Module, task: Task, data: "SampleSet") -> DataBounds | None:
    """Bounds of L and M for a convex model (``convex_model_reason`` None) under cross-entropy or
    MSE on dense inputs, from one pass over ``data``; None where none is known."""
    if convex_model_reason(model, task) is not None or "x" not in data.columns:
        return None
    x = data.columns["x"].reshape(len(data), -1).to(torch.float64)
    radius = float(torch.sqrt((x * x).sum(dim=1) + 1.0).max())
    if task.loss == "cross_entropy":
        return DataBounds(math.sqrt(2.0) * radius, 3.0 * radius ** 3,
                          f"softmax cross-entropy over inputs of max ||x~|| = {radius:.4g}: L = sqrt(2) R, M = 3 R^3")
    if task.loss == "mse":
        return DataBounds(None, 0.0, "squared loss of a linear map: its Hessian is constant, M = 0")
    return None


def calibration(settings: PrivacySettings, m: int, n: int, weight_decay: float) -> NoiseCalibration:
    """gamma and sigma for removing m of n samples with the settings' constants (user inputs: the
    release checks them against what the data bounds before it claims anything)."""
    return calibrate(epsilon=settings.epsilon, delta=settings.delta, m=m, n=n,
                     strong_convexity=settings.strong_convexity or weight_decay,
                     lipschitz_loss=settings.lipschitz_loss, hessian_lipschitz=settings.hessian_lipschitz)


def constants_below_bounds(settings: PrivacySettings, bounds: DataBounds | None) -> str | None:
    """Why the settings' L and M cannot serve the one-step theorem (None: they are at least the
    data's bounds)."""
    if bounds is None:
        return "the loss's constants L and M are not bounded from the data for this model and loss"
    low = []
    if bounds.lipschitz_loss is not None and settings.lipschitz_loss < bounds.lipschitz_loss:
        low.append(f"lipschitz_loss {settings.lipschitz_loss:g} < {bounds.lipschitz_loss:.4g}")
    if settings.hessian_lipschitz < bounds.hessian_lipschitz:
        low.append(f"hessian_lipschitz {settings.hessian_lipschitz:g} < {bounds.hessian_lipschitz:.4g}")
    if low:
        return f"the settings' constants are below what the data bounds ({bounds.what}): " + ", ".join(low)
    return None


def rounding_allowance(model: nn.Module, lipschitz: float, weight_decay: float) -> float:
    """What the rounding of a retained gradient computed in the model's precision may hide: 16
    eps of that precision times the gradient's scale (the loss's Lipschitz constant plus lambda
    ||w||), added to a measured ||grad|| before it certifies a distance."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    eps = max(torch.finfo(p.dtype).eps for p in params)
    norm = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in params))
    return 16.0 * eps * (lipschitz + weight_decay * norm)


#: what a record may say of a Newton step of a noised release (no norm of an iterate before the noise)
NOISE_FREE_STEP_KEYS = ("step", "step_length", "damping", "solver", "iterations", "relative_residual")


def published_history(history: list[dict], noised: bool) -> list[dict]:
    """The Newton steps as a record may give them: whole without noise; with noise, without the
    norms of the iterates before it (with the published weights they would reveal the noise draw)."""
    return history if not noised else [{k: v for k, v in h.items() if k in NOISE_FREE_STEP_KEYS} for h in history]


COMPARATOR = ("the exact minimiser of the retained objective L_{D\\U} (mean loss + (lambda/2)||w||^2) plus the same "
              "Gaussian noise N(0, sigma^2 I); not a same-recipe retrain")


def convex_model_reason(model: nn.Module, task: Task) -> str | None:
    """None when the objective is convex in the trainable parameters (one Linear map, convex
    loss); otherwise why that cannot be claimed."""
    loss = getattr(task, "loss", None)
    if loss not in _CONVEX_LOSSES:
        return f"loss '{loss}' is not known to be convex in the parameters"
    other = sorted({type(m).__name__ for m in model.modules() if not isinstance(m, _AFFINE_ONLY)})
    if other:
        return f"the model is not one affine map (it has {', '.join(other)}): its loss is not convex in the weights"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        return f"the model composes {len(linears)} Linear layers: its loss is not convex in the weights"
    return None


def release(
    model: nn.Module, task: Task, weight_decay: float, settings: PrivacySettings, cal: NoiseCalibration, *,
    full_block: bool, steps: int, damping_used: float, subsampled: bool, shortened: bool,
    start_gradient_norm: float, final_gradient_norm: float, inexact_solve: str | None = None,
    other_reasons: list[str] | None = None, bounds: DataBounds | None = None,
) -> PrivacyRelease:
    """``certified`` only where Sekhari et al. (2021, Thm 3.2) holds: a full-parameter step on a
    convex model with weight decay lambda > 0 (strong convexity no larger than lambda), and
    either (a) one undamped Newton step with the exact Hessian from the exact minimiser
    (||grad L_D|| <= exact_start_tol) with the settings' constants at least what the data bounds
    (``bounds``; without bounds this path is closed), or (b) a result whose
    retained gradient proves it lies within gamma of the retrained optimum:
    ||w - w*|| <= (||grad L_{D\\U}(w)|| + rounding) / lambda <= gamma (lambda-strong convexity),
    the gradient's rounding in the model's precision allowed for (``rounding_allowance``).
    Otherwise ``heuristic`` with every reason (``other_reasons``: the method's own, e.g.
    parameters moved outside the noised block). No reason quotes a number computed from the
    solution before the noise (that would publish what the noise hides)."""
    if math.isinf(cal.epsilon) or cal.sigma == 0.0:
        return PrivacyRelease.non_private()
    lam = weight_decay
    reasons: list[str] = []
    if not full_block:
        reasons.append("blockwise step: the bound covers a full-parameter Newton step")
    reasons.extend(other_reasons or [])
    convex = convex_model_reason(model, task)
    if convex:
        reasons.append(convex)
    if not lam > 0:
        reasons.append("no weight decay: the objective is not strongly convex")
    elif cal.strong_convexity > lam:
        reasons.append(f"strong_convexity {cal.strong_convexity} exceeds the weight decay {lam}: "
                       "not a property of the objective")
    one_step: list[str] = []
    constants = constants_below_bounds(settings, bounds)
    if constants:
        one_step.append(constants)
    if steps != 1:
        one_step.append(f"{steps} Newton steps (the one-step bound covers one)")
    if damping_used > 0:
        one_step.append(f"damped solve (damping {damping_used:.3g})")
    if shortened:
        one_step.append("a Newton step was shortened by the line search")
    if subsampled:
        one_step.append("curvature estimated on a subsample")
    if inexact_solve:
        one_step.append(inexact_solve)
    if not start_gradient_norm <= settings.exact_start_tol:
        one_step.append(f"start is not the exact minimiser (||grad L_D|| > {settings.exact_start_tol:g}): a sequential "
                        "or SGD-trained model")
    if one_step and lam > 0:
        allowance = rounding_allowance(model, cal.lipschitz_loss, lam)
        if not (final_gradient_norm + allowance) / lam <= cal.gamma:
            reasons.extend(one_step)
            reasons.append("the a-posteriori distance bound (||grad L_D\\U|| + rounding) / lambda exceeds gamma: the "
                           "release is not proven within the sensitivity its noise covers")
    elif one_step:
        reasons.extend(one_step)
    return PrivacyRelease(
        mechanism="gaussian", sigma=cal.sigma, sensitivity=cal.gamma, epsilon=cal.epsilon, delta=cal.delta,
        calibration=cal.calibration,  # type: ignore[arg-type]
        guarantee=Guarantee.HEURISTIC if reasons else Guarantee.CERTIFIED, reasons=reasons,
        comparator=None if reasons else COMPARATOR,
    )
