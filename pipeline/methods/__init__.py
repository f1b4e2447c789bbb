"""Removal methods; importing this package registers every built-in method."""
from pipeline.methods import lfoci_newton  # noqa: F401
from pipeline.methods import decision_layer_newton, head_gauss_newton  # noqa: F401
from pipeline.methods import fisher_scrub  # noqa: F401
from pipeline.methods import ntk_scrub  # noqa: F401
from pipeline.methods import mixed_linear  # noqa: F401
from pipeline.methods import finetune, gradient_ascent, random_labels, salun  # noqa: F401  (reference baselines)
from pipeline.methods import l1_sparse, neggrad_plus, scrub  # noqa: F401  (reference baselines)
# networks trained end to end
from pipeline.methods import block_gauss_newton, suffix_retrain, trajectory_refit  # noqa: F401
from pipeline.methods.base import (
    METHODS, MethodRef, RemovalMethod, RemovalOutcome, RemovalProblem, TrainedModel, get_method, run_removal,
)

__all__ = ["METHODS", "MethodRef", "RemovalMethod", "RemovalOutcome", "RemovalProblem", "TrainedModel", "get_method",
           "run_removal"]
