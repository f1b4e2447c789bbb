"""Gaussian noise for certified removal (Sekhari, Acharya, Kamath, Suresh, NeurIPS 2021,
Algorithm 2; used by Mehta et al. 2022 for the L-FOCI Newton update).

Removing m of n samples from a lambda-strongly convex objective whose loss is L-Lipschitz with
an M-Lipschitz Hessian moves the Newton estimate at most
    gamma = 2 M L^2 m^2 / (lambda^3 n^2)
from the retrained optimum; adding N(0, sigma^2 I) with
    sigma = (gamma / epsilon) * sqrt(2 ln(1.25 / delta))
makes the removal (epsilon, delta)-indistinguishable (the classical Gaussian mechanism; Dwork &
Roth 2014, Theorem A.1). That calibration is a theorem only for epsilon < 1. For epsilon >= 1
the analytic Gaussian mechanism (Balle & Wang, ICML 2018, Theorem 8) is used: N(0, sigma^2 I) on
an update of L2 sensitivity D is (epsilon, delta)-DP iff
    Phi(D/(2 sigma) - epsilon sigma/D) - e^epsilon Phi(-D/(2 sigma) - epsilon sigma/D) <= delta,
and sigma is the smallest such value, found by bisection (the left side decreases in sigma).
epsilon = infinity means no noise (and no privacy guarantee).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

DEFAULT_LIPSCHITZ_LOSS = 1.0
DEFAULT_HESSIAN_LIPSCHITZ = 1.0


@dataclass(frozen=True)
class NoiseCalibration:
    epsilon: float
    delta: float
    gamma: float
    sigma: float
    lipschitz_loss: float
    hessian_lipschitz: float
    strong_convexity: float
    m: int
    n: int
    calibration: str = "classical"  # "classical" (epsilon < 1), "analytic" (Balle & Wang), "none"

    def as_record(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def validate_budget(epsilon: float, delta: float) -> None:
    if not (epsilon > 0) or math.isnan(epsilon):
        raise ValueError(f"epsilon must be > 0 (use infinity for no noise), got {epsilon}")
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie strictly between 0 and 1, got {delta}")


def calibrate(
    *, epsilon: float, delta: float, m: int, n: int, strong_convexity: float,
    lipschitz_loss: float = DEFAULT_LIPSCHITZ_LOSS, hessian_lipschitz: float = DEFAULT_HESSIAN_LIPSCHITZ,
) -> NoiseCalibration:
    """gamma and sigma of the formulas above; inputs validated with errors naming the field."""
    validate_budget(epsilon, delta)
    if not 0 < m < n:
        raise ValueError(f"need 0 < m < n removed samples, got m={m}, n={n}")
    if lipschitz_loss <= 0 or hessian_lipschitz <= 0:
        raise ValueError("lipschitz_loss and hessian_lipschitz must be > 0")
    if math.isinf(epsilon):
        return NoiseCalibration(epsilon, delta, 0.0, 0.0, lipschitz_loss, hessian_lipschitz, strong_convexity, m, n,
                                calibration="none")
    if not strong_convexity > 0:
        raise ValueError(
            "strong_convexity (lambda, the weight decay) must be > 0 for a finite epsilon: the "
            "noise bound gamma = 2 M L^2 m^2 / (lambda^3 n^2) is infinite otherwise"
        )
    gamma = 2.0 * hessian_lipschitz * lipschitz_loss**2 * m**2 / (strong_convexity**3 * n**2)
    if epsilon < 1.0:
        sigma, how = classical_gaussian_sigma(epsilon, delta, gamma), "classical"
    else:
        sigma, how = analytic_gaussian_sigma(epsilon, delta, gamma), "analytic"
    return NoiseCalibration(epsilon, delta, gamma, sigma, lipschitz_loss, hessian_lipschitz, strong_convexity, m, n,
                            calibration=how)


def classical_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """sigma = D sqrt(2 ln(1.25/delta)) / epsilon (Dwork & Roth 2014, Thm A.1; epsilon < 1 only)."""
    validate_budget(epsilon, delta)
    if not epsilon < 1.0:
        raise ValueError(
            f"the classical Gaussian calibration holds only for epsilon < 1 (got {epsilon}); use "
            "analytic_gaussian_sigma (Balle & Wang 2018)"
        )
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def gaussian_delta(epsilon: float, sigma: float, sensitivity: float) -> float:
    """The exact delta(epsilon) of N(0, sigma^2) on sensitivity D (Balle & Wang 2018, Thm 8):
    Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D); the second term in log space."""
    from scipy.special import log_ndtr, ndtr

    if sigma <= 0:
        return 1.0
    if sensitivity == 0:
        return 0.0
    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    first = float(ndtr(a - b))
    second = math.exp(epsilon + float(log_ndtr(-a - b))) if epsilon + float(log_ndtr(-a - b)) > -745 else 0.0
    return max(first - second, 0.0)


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float, *, rtol: float = 1e-12) -> float:
    """Smallest sigma with ``gaussian_delta(epsilon, sigma, D) <= delta`` (Balle & Wang 2018),
    by bisection on sigma (the delta curve decreases in sigma); valid for every epsilon > 0."""
    validate_budget(epsilon, delta)
    if math.isinf(epsilon) or sensitivity == 0.0:
        return 0.0
    lo, hi = 0.0, sensitivity
    while gaussian_delta(epsilon, hi, sensitivity) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e12 * sensitivity:
            raise ValueError(f"no noise level reaches delta={delta} at epsilon={epsilon}")
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if gaussian_delta(epsilon, mid, sensitivity) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def secret_standard_normal(size: int | tuple[int, ...]) -> Tensor:
    """N(0, I) of the given shape, CPU float64, from the OS CSPRNG (``os.urandom``).

    Privacy noise must be secret: it is never drawn from a seeded generator, and nothing in a
    record or seed can regenerate it. Box-Muller on 53-bit uniforms built from urandom bytes:
    z = sqrt(-2 ln u1) cos(2 pi u2), u1 in (0, 1], u2 in [0, 1)."""
    shape = (size,) if isinstance(size, int) else tuple(size)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=torch.float64)
    pairs = (count + 1) // 2
    raw = torch.frombuffer(bytearray(os.urandom(16 * pairs)), dtype=torch.int64).reshape(2, pairs)
    bits = (raw >> 11) & ((1 << 53) - 1)  # 53 random bits, non-negative
    scale = 1.0 / float(1 << 53)
    u1 = (bits[0].to(torch.float64) + 1.0) * scale
    u2 = bits[1].to(torch.float64) * scale
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = 2.0 * math.pi * u2
    z = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]
    return z.reshape(shape)


def secret_gaussian_noise(size: int, sigma: float) -> Tensor:
    """N(0, sigma^2 I) of the given size, CPU float64, from the OS CSPRNG (see above)."""
    if sigma == 0.0:
        return torch.zeros(size, dtype=torch.float64)
    return sigma * secret_standard_normal(size)
