"""Privacy budget of a model, composed across its removals.

Each published removal is a ``Release``: Gaussian noise of standard deviation ``sigma`` added to
an update whose L2 sensitivity is ``gamma`` - a Gaussian mechanism with noise multiplier
``z = sigma / gamma`` - plus the (epsilon, delta) the method calibrated it to
(sigma = gamma / epsilon * sqrt(2 ln(1.25 / delta)), Sekhari et al.). A model's releases are
composed with one named rule (``COMPOSITION``):

  basic  epsilon_total = sum of the releases' epsilons, delta_total = sum of their deltas
         (the basic composition theorem; loose but assumption-free).
  pld    dp-accounting's privacy-loss-distribution accountant over Gaussian mechanisms with
         multipliers z_i; epsilon_total at delta_total = the budget's delta (tight).
  rdp    dp-accounting's Renyi-DP accountant over the same mechanisms, converted to
         (epsilon, delta) at the budget's delta (slightly looser than pld, fast).

When a record gives (epsilon, delta) but not gamma, z is recovered from the calibration
formula, z = sqrt(2 ln(1.25 / delta)) / epsilon. A removal without noise (sigma = 0 or
epsilon = inf) is non-private: it spends an infinite budget. With a finite budget it is refused
unless ``allow_non_private`` is set; then it is recorded with epsilon = inf, and the limit is
checked on the composition of the private releases only (``Spend.epsilon`` stays inf, so no
report can show a finite guarantee for such a model). Rolled-back versions still count: a
published version has been released.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

Rule = Literal["basic", "pld", "rdp"]


@dataclass(frozen=True)
class Release:
    """One Gaussian mechanism: noise std ``sigma`` on an update of sensitivity ``sensitivity``."""

    sigma: float
    sensitivity: float | None
    epsilon: float
    delta: float

    @property
    def private(self) -> bool:
        return self.sigma > 0 and math.isfinite(self.epsilon) and self.epsilon > 0

    @property
    def noise_multiplier(self) -> float:
        if not self.private:
            return 0.0
        if self.sensitivity and self.sensitivity > 0:
            return self.sigma / self.sensitivity
        return math.sqrt(2.0 * math.log(1.25 / self.delta)) / self.epsilon

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Release":
        """From a removal record: keys ``sigma``, ``sensitivity`` (or ``gamma``), ``epsilon``,
        ``delta`` under ``record['noise']`` (lfoci-newton's calibration), ``record['privacy']`` or
        at the top level. Missing noise, sigma = 0 or epsilon None/inf = non-private."""
        nested = [record[k] for k in ("noise", "privacy") if isinstance(record.get(k), dict)]
        src = nested[0] if nested else record

        def pick(*names: str) -> float | None:
            for name in names:
                value = src.get(name)
                if value is not None:
                    return float(value)
            return None

        sigma = pick("sigma", "noise_sigma", "noise_std") or 0.0
        epsilon = pick("epsilon", "eps")
        delta = pick("delta") or 0.0
        if sigma <= 0 or epsilon is None or not math.isfinite(epsilon):
            return cls(0.0, pick("sensitivity", "gamma"), math.inf, delta)
        return cls(sigma, pick("sensitivity", "gamma"), epsilon, delta)

    def to_json(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "sensitivity": self.sensitivity, "epsilon": self.epsilon,
                "delta": self.delta, "noise_multiplier": self.noise_multiplier, "private": self.private}


@dataclass(frozen=True)
class Spend:
    rule: str
    epsilon: float
    epsilon_private: float
    delta: float
    releases: int
    non_private: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _basic(zs: Sequence[Release], delta: float) -> tuple[float, float]:
    return sum(r.epsilon for r in zs), sum(r.delta for r in zs)


def _with_accountant(make: Callable[[], Any]) -> Callable[[Sequence[Release], float], tuple[float, float]]:
    @functools.lru_cache(maxsize=256)
    def epsilon(multipliers: tuple[float, ...], delta: float) -> float:
        import dp_accounting

        accountant = make()
        for z in multipliers:
            accountant.compose(dp_accounting.GaussianDpEvent(z))
        return float(accountant.get_epsilon(delta))

    def compose(zs: Sequence[Release], delta: float) -> tuple[float, float]:
        if not zs:
            return 0.0, 0.0
        return epsilon(tuple(r.noise_multiplier for r in zs), delta), delta

    return compose


def _pld() -> Any:
    from dp_accounting import pld

    return pld.PLDAccountant()


def _rdp() -> Any:
    from dp_accounting import rdp

    return rdp.RdpAccountant()


COMPOSITION: dict[str, Callable[[Sequence[Release], float], tuple[float, float]]] = {
    "basic": _basic,
    "pld": _with_accountant(_pld),
    "rdp": _with_accountant(_rdp),
}


def compose(releases: Sequence[Release], rule: str, delta: float) -> Spend:
    """Total spend of ``releases`` under ``rule`` (``delta``: the target delta of pld/rdp)."""
    if rule not in COMPOSITION:
        raise ValueError(f"composition rule '{rule}' is unknown; choose one of {sorted(COMPOSITION)}")
    private = [r for r in releases if r.private]
    eps, total_delta = COMPOSITION[rule](private, delta)
    non_private = len(releases) - len(private)
    return Spend(rule, math.inf if non_private else eps, eps, total_delta, len(releases), non_private)


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


def check_budget(history: Sequence[Release], new: Release, budget: Budget) -> Decision:
    """Would adding ``new`` to the model's ``history`` stay within ``budget``?"""
    before = compose(history, budget.composition, budget.delta)
    after = compose([*history, new], budget.composition, budget.delta)
    if budget.epsilon is None:
        return Decision(True, None, before, after)
    if not new.private and not budget.allow_non_private:
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
