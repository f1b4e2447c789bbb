"""Removal methods; importing this package registers every built-in method."""
from pipeline.methods import lfoci_newton  # noqa: F401
from pipeline.methods import fisher_scrub  # noqa: F401
from pipeline.methods import ntk_scrub  # noqa: F401
from pipeline.methods import mixed_linear  # noqa: F401
from pipeline.methods import finetune, gradient_ascent, random_labels, salun  # noqa: F401  (reference baselines)
from pipeline.methods.base import METHODS, RemovalMethod, RemovalOutcome, RemovalProblem, get_method

__all__ = ["METHODS", "RemovalMethod", "RemovalOutcome", "RemovalProblem", "get_method"]
