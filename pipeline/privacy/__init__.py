"""Privacy: noise calibration (``noise``) and the composition of epsilon across a model's
removals (``accountant``)."""
from pipeline.privacy.accountant import COMPOSITION, Budget, Decision, Release, Spend, check_budget, compose
from pipeline.privacy.noise import NoiseCalibration, calibrate, gaussian_noise, validate_budget

__all__ = [
    "COMPOSITION", "Budget", "Decision", "Release", "Spend", "check_budget", "compose",
    "NoiseCalibration", "calibrate", "gaussian_noise", "validate_budget",
]
