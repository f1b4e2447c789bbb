"""Privacy: noise calibration (``noise``) and the composition of epsilon across a model's
removals (``accountant``)."""
from pipeline.privacy.accountant import (
    COMPOSITION, Budget, Decision, Release, Spend, as_privacy_release, check_budget, compose, gaussian_delta,
    gaussian_epsilon, release_from_record,
)
from pipeline.privacy.noise import (
    NoiseCalibration, calibrate, secret_gaussian_noise, secret_standard_normal, validate_budget,
)
from pipeline.privacy.release import Guarantee, PrivacyRelease

__all__ = [
    "COMPOSITION", "Budget", "Decision", "Release", "Spend", "as_privacy_release", "check_budget", "compose",
    "gaussian_delta", "gaussian_epsilon", "release_from_record",
    "NoiseCalibration", "calibrate", "secret_gaussian_noise", "secret_standard_normal", "validate_budget",
    "Guarantee", "PrivacyRelease",
]
