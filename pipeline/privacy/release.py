"""The typed privacy release of one removal: what noise was added and what it may claim.

Every removal method returns a ``PrivacyRelease`` in ``RemovalOutcome.release``; the record,
the ledger and the accountant read it back by ``PrivacyRelease.model_validate`` only (no key
aliases). A release claims ``certified`` only where the theorem behind its calibration holds
(Sekhari et al. 2021: a full-parameter Newton step from the exact minimiser of a strongly
convex, smooth loss with the stated constants); anything else with noise is ``heuristic`` with
the reasons listed, and a removal without noise is ``none`` (non-private, epsilon = null).
Strict JSON: infinite or missing epsilons are written as null, never ``Infinity``.
"""
from __future__ import annotations

import math
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Guarantee(str, Enum):
    CERTIFIED = "certified"   # the bound's conditions hold: (epsilon, delta) is a theorem
    HEURISTIC = "heuristic"   # noise calibrated by the bound, but its conditions do not hold
    NONE = "none"             # no noise: no privacy claim at all


class PrivacyRelease(BaseModel):
    """One Gaussian mechanism N(0, sigma^2 I) on an update of L2 sensitivity ``sensitivity``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mechanism: Literal["gaussian", "none"]
    sigma: float = Field(ge=0)
    sensitivity: float | None = Field(None, ge=0, description="gamma: L2 sensitivity the noise covers")
    epsilon: float | None = Field(None, gt=0, description="null = no privacy claim")
    delta: float | None = Field(None, gt=0, lt=1)
    calibration: Literal["classical", "analytic", "none"] = "none"
    guarantee: Guarantee
    reasons: list[str] = Field(default_factory=list, description="why the claim is heuristic or absent")
    comparator: str | None = Field(
        None, description="what the release is (epsilon, delta)-indistinguishable from, for a certified one")

    @model_validator(mode="after")
    def _consistent(self) -> "PrivacyRelease":
        if self.epsilon is not None and not math.isfinite(self.epsilon):
            raise ValueError("epsilon must be finite or null (null = no privacy claim)")
        private = self.mechanism == "gaussian" and self.sigma > 0 and self.epsilon is not None
        if private and self.delta is None:
            raise ValueError("a private release needs delta")
        if not private and self.guarantee is not Guarantee.NONE:
            raise ValueError("a release without noise or without epsilon can only have guarantee 'none'")
        if private and self.guarantee is Guarantee.NONE:
            raise ValueError("a release with calibrated noise must say 'certified' or 'heuristic'")
        if self.guarantee is Guarantee.HEURISTIC and not self.reasons:
            raise ValueError("a heuristic release must list the reasons the theorem does not apply")
        return self

    @property
    def private(self) -> bool:
        return self.guarantee is not Guarantee.NONE

    @property
    def noise_multiplier(self) -> float:
        """z = sigma / sensitivity; without a sensitivity, the z its own calibration gives for
        (epsilon, delta): classical sqrt(2 ln(1.25/delta)) / epsilon, analytic the smallest z of
        Balle & Wang's exact condition (never the classical formula for an analytic release: at
        epsilon 4 it would count 3.51 for 4.0)."""
        if not self.private:
            return 0.0
        if self.sensitivity:
            return self.sigma / self.sensitivity
        if self.calibration == "analytic":
            from pipeline.privacy.noise import analytic_gaussian_sigma

            return analytic_gaussian_sigma(self.epsilon, self.delta, 1.0)  # type: ignore[arg-type]
        return math.sqrt(2.0 * math.log(1.25 / self.delta)) / self.epsilon  # type: ignore[operator]

    @classmethod
    def non_private(cls, reason: str = "no noise was added (epsilon = infinity)") -> "PrivacyRelease":
        return cls(mechanism="none", sigma=0.0, guarantee=Guarantee.NONE, reasons=[reason])
