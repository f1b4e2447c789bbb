"""bench.rewind_curve: the recipe resumed from its first checkpoint on D \\ U is Retrain itself (Avg. Gap and KL 0),
from its last the original; the timeline reads every recorded checkpoint; bad epochs are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import rewind_curve


def test_the_smoke_curve_runs_from_retrain_to_the_original(tmp_path: Path) -> None:
    out = tmp_path / "curve.json"
    assert rewind_curve.main(["--smoke", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    epochs = d["epochs"]
    assert [t["epoch"] for t in d["timeline"]] == list(range(epochs + 1))
    assert all(0.0 <= t[k] <= 100.0 for t in d["timeline"] for k in ("forget_accuracy", "retained_accuracy",
                                                                       "test_accuracy"))
    first, last = d["rewind"][0], d["rewind"][-1]
    assert first["epoch"] == 0 and last["epoch"] == epochs
    assert first["AvgGap"] == 0.0 and first["KL_forget"] == 0.0 and first["KL_test"] == 0.0  # Retrain, bitwise
    original = d["references"]["original"]
    for key in ("UA", "RA", "TA", "MIA", "AvgGap", "KL_forget"):
        assert last[key] == pytest.approx(original[key], abs=1e-9), key  # nothing left to run: the original
    assert d["retrain_seconds"] > 0
    assert all(r["seconds"] >= 0 and r["retrain_share"] >= 0 for r in d["rewind"])
    assert d["forget_set"]["role"] == "tuning" and d["m"] == len(d["forget_set"]["sample_ids"])


def test_checkpoints_are_read_at_the_recorders_epochs() -> None:
    """Every ceil(E / C) epochs and the last (pipeline.trajectory.TrajectoryRecorder): 10 epochs, 4 checkpoints."""
    assert rewind_curve.checkpoint_epochs(10, 4, 5) == [0, 3, 6, 9, 10]
    assert rewind_curve.checkpoint_epochs(16, 16, 17) == list(range(17))
    with pytest.raises(ValueError, match="recorder keeps 5"):
        rewind_curve.checkpoint_epochs(10, 4, 6)


def test_an_epoch_without_a_checkpoint_is_refused_by_name(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        rewind_curve.main(["--smoke", "--epochs", "0,7", "--out", str(tmp_path / "x.json")])
    assert stop.value.code == 2
    assert "--epochs: [7] are not recorded checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
