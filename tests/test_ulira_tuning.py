"""bench/ulira_tuning.py: a removal's settings chosen by the U-LiRA game on a declared tuning set.

  (a) the criterion: the worst of the game on U and on the two control sets; no reading where one is missing; the
      least worst chosen, the first of equals;
  (b) oracle, end to end through ``unlearn eval``'s code on a small CNN: suffix-retrain over the whole network with the
      recipe's own epochs is Retrain (every decision a tie: 50.0 on U and on both controls), a third of the epochs
      differs from Retrain on every sample (above 50 on its controls); the harness chooses the exact one though it
      comes second in the grid, plays the scenario's declared tuning set (disjoint from the reported one), and writes
      every point's readings.
"""
from __future__ import annotations

import json

import pytest
import yaml

from bench.ulira_tuning import choose, main, worst_reading

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = {"optimizer": "sgd", "epochs": 3, "lr": 0.05, "batch_size": 64, "momentum": 0.9, "weight_decay": 5e-4,
          "seed": 3}
CNN = {"channels": [8, 16], "pool": [1, 2], "hidden": [32], "image_size": 8}


def _game(on_u: float, retained: float | None, test: float) -> dict:
    controls = {"test": {"rows": {"m": {"accuracy": test}}}}
    if retained is not None:
        controls["retained"] = {"rows": {"m": {"accuracy": retained}}}
    return {"rows": {"m": {"accuracy": on_u}}, "controls": controls}


def test_the_criterion_is_the_worst_reading_and_the_least_of_them_is_chosen():
    assert worst_reading(_game(51.0, 59.2, 52.8), "m") == 59.2
    assert worst_reading(_game(58.2, 52.3, 52.3), "m") == 58.2
    assert worst_reading(_game(51.0, None, 52.8), "m") is None           # a control not played: no reading
    assert worst_reading(_game(51.0, 52.0, 52.0), "other") is None       # the row has no game
    assert choose([{"worst": 59.2}, {"worst": 58.2}, {"worst": None}, {"worst": 77.5}]) == 1
    assert choose([{"worst": 55.0}, {"worst": 55.0}]) == 0
    assert choose([{"worst": None}]) is None


def test_the_harness_chooses_the_exact_retrain_on_the_declared_tuning_set(tmp_path):
    from tests import kit

    model_dir = kit.trained_model_dir(tmp_path / "cnn", "cnn", CNN, data_options={"flatten": False}, recipe=RECIPE)
    grid = {"model_dir": str(model_dir), "scenario": "identity", "reported_sets": 1, "tuning_sets": 1,
            "tuning_set": 0, "method": "suffix-retrain", "base": {"scope_cost_share": 1.0},
            "grid": [{"epochs": 1}, {}], "ulira_shadows": 3, "ulira_controls": 16}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    out = tmp_path / "tuning.json"
    assert main(["--grid", str(path), "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    brief, exact = result["points"]
    assert exact["on_U"]["accuracy"] == 50.0 and exact["worst"] == 50.0
    assert all(exact["controls"][key]["suffix-retrain"]["accuracy"] == 50.0 for key in ("retained", "test"))
    assert brief["controls"]["retained"]["suffix-retrain"]["accuracy"] > 55.0
    assert result["chosen"] == 1 and result["chosen_settings"] == {"scope_cost_share": 1.0}
    tuning = result["tuning_set"]
    assert tuning["role"] == "tuning" and tuning["label"] not in tuning["reported_labels"]
    assert result["original_on_controls"]["retained"]["accuracy"] is not None


def test_a_grid_missing_a_field_exits_1_naming_it(tmp_path, capsys):
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"model_dir": "x", "scenario": "identity"}))
    assert main(["--grid", str(path), "--out", str(tmp_path / "o.json")]) == 1
    assert "reported_sets" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def _result(index: int, worst: list[float | None], settings: list[dict] | None = None) -> dict:
    settings = settings or [{"epochs": e} for e in (4, 6, 8)][: len(worst)]
    return {"method": "suffix-retrain", "model_dir": "m", "ulira_shadows": 16, "ulira_controls": 96,
            "tuning_set": {"index": index, "label": 20 + index, "scenario": "identity"},
            "points": [{"settings": s, "worst": w} for s, w in zip(settings, worst)]}


def test_runs_on_several_tuning_sets_choose_by_the_mean_worst_reading(tmp_path):
    paths = []
    for i, worst in enumerate(([68.0, 59.2, 58.2], [60.0, 62.0, 57.0])):
        paths.append(tmp_path / f"set{i}.json")
        paths[-1].write_text(json.dumps(_result(i, worst)))
    out = tmp_path / "chosen.json"
    assert main(["--combine", str(paths[0]), "--combine", str(paths[1]), "--out", str(out)]) == 0
    chosen = json.loads(out.read_text())
    assert [p["worst"] for p in chosen["points"]] == [64.0, 60.6, 57.6]
    assert chosen["chosen"] == 2 and chosen["chosen_settings"] == {"epochs": 8}
    assert [s["index"] for s in chosen["tuning_sets"]] == [0, 1]


@pytest.mark.parametrize("second, field", [
    (_result(0, [60.0, 62.0, 57.0]), "each set once"),
    (_result(1, [60.0, 62.0, 57.0], [{"epochs": 4}, {"epochs": 6}, {"epochs": 12}]), "another grid"),
    ({**_result(1, [60.0, 62.0, 57.0]), "ulira_shadows": 32}, "ulira_shadows"),
    ({**_result(1, [60.0, 62.0, 57.0]), "tuning_set": {"index": 1, "label": None, "scenario": "random_1pct"}},
     "scenario"),
])
def test_combining_other_grids_or_one_set_twice_exits_1_naming_why(tmp_path, capsys, second, field):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "o.json"
    a.write_text(json.dumps(_result(0, [68.0, 59.2, 58.2])))
    b.write_text(json.dumps(second))
    assert main(["--combine", str(a), "--combine", str(b), "--out", str(out)]) == 1
    assert field in capsys.readouterr().err and not out.exists()


def test_the_committed_grids_read_and_a_point_no_removal_can_take_is_named_before_any_runs(tmp_path, capsys):
    from bench.common import ROOT
    from bench.ulira_tuning import grid_configs, read_grid

    paths = sorted((ROOT / "configs" / "evaluate" / "tuning").glob("*.yaml"))
    assert len(paths) >= 2
    for path in paths:
        grid = read_grid(path)
        configs = grid_configs(grid, {"scenario": "class", "classes": [0]}, str(tmp_path))
        assert len(configs) == len(grid["grid"]) and all(c.ulira_controls > 0 for c in configs), path
    assert read_grid(paths[0], tuning_set=1)["tuning_set"] == 1
    bad = tmp_path / "grid.yaml"
    bad.write_text(yaml.safe_dump({**grid, "model_dir": str(tmp_path / "no-model"), "grid": [{"epochs": 0}]}))
    with pytest.raises(ValueError, match=r"grid\[0\].*suffix-retrain"):
        grid_configs(read_grid(bad), {"scenario": "class", "classes": [0]}, str(tmp_path))
