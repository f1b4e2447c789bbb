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

from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from pipeline.privacy.noise import DEFAULT_HESSIAN_LIPSCHITZ, DEFAULT_LIPSCHITZ_LOSS, NoiseCalibration, calibrate
from pipeline.privacy.release import Guarantee, PrivacyRelease
from pipeline.tasks import Task

__all__ = ["PrivacySettings", "calibration", "convex_model_reason", "release"]

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


def calibration(settings: PrivacySettings, m: int, n: int, weight_decay: float) -> NoiseCalibration:
    """gamma and sigma of the settings for removing m of n samples."""
    return calibrate(epsilon=settings.epsilon, delta=settings.delta, m=m, n=n,
                     strong_convexity=settings.strong_convexity or weight_decay,
                     lipschitz_loss=settings.lipschitz_loss, hessian_lipschitz=settings.hessian_lipschitz)


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
    other_reasons: list[str] | None = None,
) -> PrivacyRelease:
    """``certified`` only where Sekhari et al. (2021, Thm 3.2) holds: a full-parameter step on a
    convex model with weight decay lambda > 0 (strong convexity no larger than lambda), and
    either (a) one undamped Newton step with the exact Hessian from the exact minimiser
    (||grad L_D|| <= exact_start_tol), or (b) a result whose retained gradient proves it lies
    within gamma of the retrained optimum: ||w - w*|| <= ||grad L_{D\\U}(w)|| / lambda <= gamma
    (lambda-strong convexity). Otherwise ``heuristic`` with every reason (``other_reasons``: the
    method's own, e.g. parameters moved outside the noised block)."""
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
        one_step.append(f"start is not the exact minimiser (||grad L_D|| = {start_gradient_norm:.3g} > "
                        f"{settings.exact_start_tol:g}): a sequential or SGD-trained model")
    if one_step and lam > 0:
        bound = final_gradient_norm / lam
        if not bound <= cal.gamma:
            reasons.extend(one_step)
            reasons.append(f"the a-posteriori distance bound ||grad L_D\\U||/lambda = {bound:.3g} exceeds "
                           f"gamma = {cal.gamma:.3g}")
    elif one_step:
        reasons.extend(one_step)
    return PrivacyRelease(
        mechanism="gaussian", sigma=cal.sigma, sensitivity=cal.gamma, epsilon=cal.epsilon, delta=cal.delta,
        calibration=cal.calibration,  # type: ignore[arg-type]
        guarantee=Guarantee.HEURISTIC if reasons else Guarantee.CERTIFIED, reasons=reasons,
    )
