"""Gaussian noise for certified removal (Sekhari, Acharya, Kamath, Suresh, NeurIPS 2021,
Algorithm 2; used by Mehta et al. 2022 for the L-FOCI Newton update).

Removing m of n samples from a lambda-strongly convex objective whose loss is L-Lipschitz with
an M-Lipschitz Hessian moves the Newton estimate at most
    gamma = 2 M L^2 m^2 / (lambda^3 n^2)
from the retrained optimum; adding N(0, sigma^2 I) with
    sigma = (gamma / epsilon) * sqrt(2 ln(1.25 / delta))
makes the removal (epsilon, delta)-indistinguishable (the Gaussian mechanism).
epsilon = infinity means no noise (and no privacy guarantee).
"""
from __future__ import annotations

import math
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
        return NoiseCalibration(epsilon, delta, 0.0, 0.0, lipschitz_loss, hessian_lipschitz, strong_convexity, m, n)
    if not strong_convexity > 0:
        raise ValueError(
            "strong_convexity (lambda, the weight decay) must be > 0 for a finite epsilon: the "
            "noise bound gamma = 2 M L^2 m^2 / (lambda^3 n^2) is infinite otherwise"
        )
    gamma = 2.0 * hessian_lipschitz * lipschitz_loss**2 * m**2 / (strong_convexity**3 * n**2)
    sigma = gamma / epsilon * math.sqrt(2.0 * math.log(1.25 / delta))
    return NoiseCalibration(epsilon, delta, gamma, sigma, lipschitz_loss, hessian_lipschitz, strong_convexity, m, n)


def gaussian_noise(size: int, sigma: float, generator: torch.Generator) -> Tensor:
    """N(0, sigma^2 I) of the given size, CPU float64, from an explicit generator."""
    if sigma == 0.0:
        return torch.zeros(size, dtype=torch.float64)
    return sigma * torch.randn(size, generator=generator, dtype=torch.float64)
