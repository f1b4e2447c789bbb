"""The privacy seams: secret noise from the OS CSPRNG, the typed release, the hashed streams."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from pipeline.methods.base import MAX_SEED, RandomStream, stream_seed
from pipeline.privacy.noise import secret_gaussian_noise, secret_standard_normal
from pipeline.privacy.release import Guarantee, PrivacyRelease


def test_secret_normal_has_unit_moments_and_never_repeats() -> None:
    z = secret_standard_normal(400_000)
    # standard errors: mean 1/sqrt(N) = 0.0016, variance sqrt(2/N) = 0.0022; 5 sigma margins
    assert abs(float(z.mean())) < 0.008
    assert abs(float(z.var()) - 1.0) < 0.012
    # fourth moment of N(0,1) is 3 (a uniform or a wrong transform would miss it by > 1)
    assert abs(float((z**4).mean()) - 3.0) < 0.1
    assert not torch.equal(secret_standard_normal(1000), secret_standard_normal(1000))
    assert secret_standard_normal((3, 5)).shape == (3, 5)
    scaled = secret_gaussian_noise(200_000, 2.5)
    assert abs(float(scaled.std()) - 2.5) < 0.05
    assert torch.count_nonzero(secret_gaussian_noise(10, 0.0)) == 0


def test_release_claims_are_consistent() -> None:
    certified = PrivacyRelease(mechanism="gaussian", sigma=1.0, sensitivity=0.25, epsilon=1.0, delta=1e-6,
                               calibration="analytic", guarantee=Guarantee.CERTIFIED)
    assert certified.private and certified.noise_multiplier == pytest.approx(4.0)
    classical = PrivacyRelease(mechanism="gaussian", sigma=1.0, epsilon=0.5, delta=1e-5,
                               calibration="classical", guarantee="heuristic", reasons=["blockwise step"])
    assert classical.noise_multiplier == pytest.approx(math.sqrt(2 * math.log(1.25e5)) / 0.5)
    none = PrivacyRelease.non_private()
    assert not none.private and none.epsilon is None and none.model_dump(mode="json")["epsilon"] is None
    with pytest.raises(ValidationError):  # heuristic without a reason
        PrivacyRelease(mechanism="gaussian", sigma=1.0, epsilon=1.0, delta=1e-5, guarantee="heuristic")
    with pytest.raises(ValidationError):  # a claim without noise
        PrivacyRelease(mechanism="none", sigma=0.0, epsilon=1.0, delta=1e-5, guarantee="certified")
    with pytest.raises(ValidationError):  # infinity is not an epsilon
        PrivacyRelease(mechanism="gaussian", sigma=1.0, epsilon=math.inf, delta=1e-5, guarantee="certified")
    with pytest.raises(ValidationError):  # unknown fields (aliases) are refused
        PrivacyRelease.model_validate({"mechanism": "none", "sigma": 0.0, "guarantee": "none", "noise_std": 1.0})


def test_stream_seeds_are_distinct_and_take_any_63_bit_seed() -> None:
    seeds = {stream_seed(s, r) for s in (0, 1, 2, 10**13 * 2, MAX_SEED) for r in RandomStream}
    assert len(seeds) == 5 * len(RandomStream)
    assert all(0 <= v <= MAX_SEED for v in seeds)
    assert stream_seed(7, RandomStream.PROBE) == stream_seed(7, RandomStream.PROBE)
    for bad in (-1, MAX_SEED + 1):
        with pytest.raises(ValueError, match="seed"):
            stream_seed(bad, RandomStream.PROBE)
