"""Drift of the streaming fast path on the convex digits model (bench/stream_drift.py, small
instance) against two oracles: the retrained optimum of the retained data (L-BFGS + autograd
Newton in float64 to ||grad|| <= 1e-10) and the chain of from-scratch lfoci-newton removals
(``pipeline.removal.remove``, what the service publishes without the fast path)."""
from __future__ import annotations

import pytest

from bench.stream_drift import ORACLE_TOL, run


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    # 24 single-sample requests in batches of 4; a refresh at least every 3 batches (the last
    # batch, index 5, ends on a refresh), drift threshold 1e-5 as in configs/stream/linear-digits.yaml
    return run(requests=24, batch=4, seed=1, workdir=tmp_path_factory.mktemp("drift"),
               settings_override={"refresh_every": 3})


def test_every_published_version_is_within_the_threshold_of_the_retrained_optimum(drift):
    lam = drift["model"]["weight_decay"]
    threshold = drift["threshold"]["distance"]
    assert threshold == pytest.approx(1e-5 / lam)
    assert drift["paths"]["fast"] >= 1                      # the fast path itself was exercised
    for row in drift["steps"]:
        assert row["oracle_gradient_norm"] <= ORACLE_TOL
        assert row["stream_to_optimum"] <= threshold
        # the recorded bound ||grad F_R|| / lambda holds against the oracle
        assert row["stream_to_optimum"] <= row["distance_to_target_bound"] * (1 + 1e-6) + ORACLE_TOL / lam
        if row["path"] == "refresh":                          # refresh_tol 1e-9 -> within 1e-9 / lambda
            assert row["stream_to_optimum"] <= 1e-9 / lam


def test_after_streamed_removals_and_a_refresh_the_stream_equals_from_scratch_and_retrain(drift):
    last, refreshed = drift["steps"][-1], drift["after_final_refresh"]
    assert last["n_retained"] == drift["model"]["n_train"] - 24
    assert drift["removal_moved_the_layer_by"] > 0.05       # there was something to move
    assert refreshed["converged"] and refreshed["residual_after"] <= 1e-9
    assert refreshed["stream_to_optimum"] <= 1e-7
    assert last["from_scratch_to_optimum"] <= 1e-7
    assert refreshed["stream_to_from_scratch"] <= 2e-7


def test_without_refreshes_the_same_stream_drifts_much_further(drift):
    """The control (no refresh ever) ends orders of magnitude further from the optimum than the
    refreshed stream: the refresh, not luck, keeps the distance down."""
    last, refreshed = drift["steps"][-1], drift["after_final_refresh"]
    assert last["no_refresh_to_optimum"] >= 1e3 * max(refreshed["stream_to_optimum"], 1e-12)
    assert last["no_refresh_to_optimum"] >= 1e-4
