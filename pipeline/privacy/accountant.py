"""Privacy budget of a model, composed across its removals.

Each published removal carries a typed ``PrivacyRelease`` (``pipeline.privacy.release``) in its
record as ``record["release"]``; ``release_from_record`` is the one reader (pydantic
validation, no key aliases; records from before typed releases are read with one strict legacy
schema and never count as certified). A private release is a Gaussian mechanism: noise of standard
deviation sigma on an update of L2 sensitivity gamma, noise multiplier z = sigma / gamma
(without gamma, z is recovered from the release's own calibration of (epsilon, delta): classical
z = sqrt(2 ln(1.25/delta)) / eps, analytic the smallest z of Balle & Wang's exact condition).
A model's releases are composed with one named rule (``COMPOSITION``):

  basic  epsilon_total = sum of the releases' epsilons, delta_total = sum of their deltas
         (the basic composition theorem; loose but assumption-free).
  pld    the exact privacy-loss distribution of the composed Gaussian mechanisms, in closed
         form: the privacy loss of a Gaussian mechanism with multiplier z is N(mu^2/2, mu^2)
         with mu = 1/z, and losses of composed mechanisms add, so k releases compose to ONE
         Gaussian mechanism with mu = sqrt(sum_i 1/z_i^2) (Dong, Roth, Su 2019, Cor. 3.3).
         Its exact curve (Balle & Wang 2018, Thm. 8)
             delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)
         is inverted at the budget's delta by bisection, in log space (no overflow for huge
         epsilon, O(1) memory). This is the value dp-accounting's discretised PLD accountant
         approaches from above as its grid is refined; that accountant's memory grows like
         mu^2 / interval (epsilon 100 needs 1.2 GB; 10000 would need hundreds of GB).
  rdp    dp-accounting's Renyi-DP accountant over the same mechanisms, converted to
         (epsilon, delta) at the budget's delta (an upper bound: pld <= rdp).

A removal without noise (guarantee ``none``) is non-private: it spends an infinite budget.
With a finite budget it is refused unless ``allow_non_private`` is set; then it is recorded,
and the limit is checked on the composition of the private releases only (``Spend.epsilon``
stays infinite, written null in JSON, so no report can show a finite guarantee for such a
model). Certified and heuristic releases compose alike (the noise is the same mechanism), but
``Spend`` counts them apart: a heuristic release's epsilon is not a theorem. Rolled-back
versions still count: a published version has been released.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from pipeline.privacy.release import Guarantee, PrivacyRelease

Rule = Literal["basic", "pld", "rdp"]

LEGACY_REASON = "legacy release without a stated guarantee: counted as heuristic"


@dataclass(frozen=True)
class Release:
    """Legacy untyped form of a Gaussian release (sigma, sensitivity, epsilon, delta); the
    accountant converts it to a ``PrivacyRelease`` (guarantee heuristic: nothing says the
    theorem holds). New code passes ``PrivacyRelease`` objects."""

    sigma: float
    sensitivity: float | None
    epsilon: float
    delta: float
    guarantee: Guarantee = Guarantee.HEURISTIC
    reasons: tuple[str, ...] = field(default=(LEGACY_REASON,))

    @property
    def private(self) -> bool:
        return self.sigma > 0 and math.isfinite(self.epsilon) and self.epsilon > 0

    @property
    def noise_multiplier(self) -> float:
        return as_privacy_release(self).noise_multiplier

    @classmethod
    def from_privacy(cls, release: PrivacyRelease) -> "Release":
        return cls(release.sigma, release.sensitivity,
                   release.epsilon if release.private else math.inf, release.delta or 0.0,
                   release.guarantee, tuple(release.reasons))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Release":
        """``release_from_record`` in the legacy form."""
        return cls.from_privacy(release_from_record(record))

    def to_privacy(self) -> PrivacyRelease:
        return as_privacy_release(self)

    def to_json(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "sensitivity": self.sensitivity, "epsilon": self.epsilon,
                "delta": self.delta, "noise_multiplier": self.noise_multiplier, "private": self.private,
                "guarantee": Guarantee(self.guarantee).value, "reasons": list(self.reasons)}


AnyRelease = Union[PrivacyRelease, Release]


class LegacyCalibration(BaseModel):
    """``record["noise"]`` as lfoci-newton wrote it before records carried a typed release
    (``NoiseCalibration.as_record``): one name per field, nothing else accepted."""

    model_config = ConfigDict(extra="forbid")
    epsilon: float | None
    delta: float
    gamma: float = Field(ge=0)
    sigma: float = Field(ge=0)
    lipschitz_loss: float | None = None
    hessian_lipschitz: float | None = None
    strong_convexity: float | None = None
    m: int | None = None
    n: int | None = None


LEGACY_CALIBRATION_REASON = ("record without a typed 'release' (legacy lfoci-newton calibration): the theorem's "
                             "conditions are not recorded, counted as heuristic")


def release_from_record(record: dict[str, Any]) -> PrivacyRelease:
    """The removal's typed release: ``PrivacyRelease.model_validate(record["release"])``, the one
    reader. Only for records written before releases were typed, ``record["noise"]`` is read
    with the strict ``LegacyCalibration`` schema and counted heuristic (never certified). A
    record with neither claims nothing: non-private."""
    raw = record.get("release")
    if isinstance(raw, PrivacyRelease):
        return raw
    if raw is not None:
        return PrivacyRelease.model_validate(raw)
    if isinstance(record.get("noise"), dict):
        legacy = LegacyCalibration.model_validate(record["noise"])
        if legacy.sigma > 0 and legacy.epsilon is not None and math.isfinite(legacy.epsilon):
            return PrivacyRelease(mechanism="gaussian", sigma=legacy.sigma, sensitivity=legacy.gamma or None,
                                  epsilon=legacy.epsilon, delta=legacy.delta, calibration="classical",
                                  guarantee=Guarantee.HEURISTIC, reasons=[LEGACY_CALIBRATION_REASON])
        return PrivacyRelease.non_private()
    return PrivacyRelease.non_private("the removal record carries no 'release': counted as non-private")


def as_privacy_release(release: AnyRelease) -> PrivacyRelease:
    """A ``PrivacyRelease`` as is; a legacy ``Release`` converted (heuristic when private)."""
    if isinstance(release, PrivacyRelease):
        return release
    if not release.private:
        return PrivacyRelease.non_private()
    guarantee = Guarantee(release.guarantee)
    if guarantee is Guarantee.NONE:
        guarantee = Guarantee.HEURISTIC
    reasons = list(release.reasons) or [LEGACY_REASON]
    # (a legacy release's epsilon >= 1 can only have come from the analytic calibration)
    return PrivacyRelease(mechanism="gaussian", sigma=release.sigma, sensitivity=release.sensitivity or None,
                          epsilon=release.epsilon, delta=release.delta if 0 < release.delta < 1 else 1e-5,
                          calibration="classical" if release.epsilon < 1 else "analytic", guarantee=guarantee,
                          reasons=reasons)


@dataclass(frozen=True)
class Spend:
    rule: str
    epsilon: float
    epsilon_private: float
    delta: float
    releases: int
    non_private: int
    certified: int = 0
    heuristic: int = 0

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: an infinite epsilon is written null."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}


# -- the exact Gaussian curve ------------------------------------------------------------------
def _log_ndtr(x: float) -> float:
    from scipy.special import log_ndtr

    return float(log_ndtr(x))


def gaussian_delta(mu: float, epsilon: float) -> float:
    """delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) of a Gaussian mechanism with
    mu = sensitivity / sigma (Balle & Wang 2018, Thm. 8), computed in log space."""
    a = _log_ndtr(mu / 2.0 - epsilon / mu)
    b = epsilon + _log_ndtr(-mu / 2.0 - epsilon / mu)
    if b >= a:
        return 0.0
    return math.exp(a) * -math.expm1(b - a)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest eps >= 0 with gaussian_delta(mu, eps) <= delta, by bisection. delta(eps) is
    decreasing; the privacy loss is N(mu^2/2, mu^2), so eps = mu^2/2 + mu sqrt(2 ln(1/delta))
    bounds it from above (a Gaussian tail bound)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie strictly between 0 and 1, got {delta}")
    if mu <= 0:
        return 0.0
    if gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, mu * mu / 2.0 + mu * math.sqrt(2.0 * math.log(1.0 / delta))
    while gaussian_delta(mu, hi) > delta:  # the bound holds; this only guards rounding
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gaussian_delta(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return hi


# -- composition rules ---------------------------------------------------------------------------
Composer = Callable[[Sequence[PrivacyRelease], float], "tuple[float, float]"]


def _basic(releases: Sequence[PrivacyRelease], delta: float) -> tuple[float, float]:
    return sum(float(r.epsilon) for r in releases), sum(float(r.delta) for r in releases)  # type: ignore[arg-type]


def _pld(releases: Sequence[PrivacyRelease], delta: float) -> tuple[float, float]:
    if not releases:
        return 0.0, 0.0
    mu = math.sqrt(sum(1.0 / r.noise_multiplier ** 2 for r in releases))
    return gaussian_epsilon(mu, delta), delta


@functools.lru_cache(maxsize=256)
def _rdp_epsilon(multipliers: tuple[float, ...], delta: float) -> float:
    import dp_accounting
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant()
    for z in multipliers:
        accountant.compose(dp_accounting.GaussianDpEvent(z))
    return float(accountant.get_epsilon(delta))


def _rdp(releases: Sequence[PrivacyRelease], delta: float) -> tuple[float, float]:
    if not releases:
        return 0.0, 0.0
    return _rdp_epsilon(tuple(r.noise_multiplier for r in releases), delta), delta


COMPOSITION: dict[str, Composer] = {"basic": _basic, "pld": _pld, "rdp": _rdp}


def compose(releases: Sequence[AnyRelease], rule: str, delta: float) -> Spend:
    """Total spend of ``releases`` under ``rule`` (``delta``: the target delta of pld/rdp)."""
    if rule not in COMPOSITION:
        raise ValueError(f"composition rule '{rule}' is unknown; choose one of {sorted(COMPOSITION)}")
    typed = [as_privacy_release(r) for r in releases]
    private = [r for r in typed if r.private]
    eps, total_delta = COMPOSITION[rule](private, delta)
    non_private = len(typed) - len(private)
    certified = sum(r.guarantee is Guarantee.CERTIFIED for r in private)
    return Spend(rule, math.inf if non_private else eps, eps, total_delta, len(typed), non_private,
                 certified, len(private) - certified)


class Budget(BaseModel):
    """A model's privacy budget. ``epsilon: null`` means no limit (spend is still recorded)."""

    model_config = ConfigDict(extra="forbid")
    epsilon: float | None = Field(default=None, gt=0, description="total epsilon allowed for the model")
    delta: float = Field(default=1e-5, gt=0, lt=1, description="total delta allowed (target delta of pld/rdp)")
    composition: Rule = Field(default="pld", description="basic | pld | rdp")
    allow_non_private: bool = Field(default=False, description="accept removals without noise (epsilon = inf)")
    require_certified: bool = Field(default=False, description="refuse releases whose guarantee is not 'certified'")


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str | None
    before: Spend
    after: Spend


def check_budget(history: Sequence[AnyRelease], new: AnyRelease, budget: Budget) -> Decision:
    """Would adding ``new`` to the model's ``history`` stay within ``budget``?"""
    new_typed = as_privacy_release(new)
    before = compose(history, budget.composition, budget.delta)
    after = compose([*history, new_typed], budget.composition, budget.delta)
    if budget.epsilon is None:
        return Decision(True, None, before, after)
    if not new_typed.private and not budget.allow_non_private:
        return Decision(False, (
            "the removal adds no noise (epsilon = inf), which a finite privacy budget cannot pay for; "
            "configure the method with a finite epsilon, or set limits.budget.allow_non_private: true"
        ), before, after)
    if after.epsilon_private > budget.epsilon:
        return Decision(False, (
            f"privacy budget exceeded: epsilon would reach {after.epsilon_private:.4g} ({budget.composition} composition "
            f"of {after.releases - after.non_private} releases) > budget {budget.epsilon:g}; retrain the model from scratch "
            "without the requested samples, or raise limits.budget.epsilon"
        ), before, after)
    if budget.composition == "basic" and after.delta > budget.delta:
        return Decision(False, (
            f"privacy budget exceeded: delta would reach {after.delta:.3g} > budget {budget.delta:g} (basic composition); "
            "retrain from scratch or raise limits.budget.delta"
        ), before, after)
    return Decision(True, None, before, after)
