"""`unlearn train` and `unlearn eval` end to end on the convex digits set-up (fast), plus
config validation that names the field."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from pipeline.evaluate.protocol import EvalConfig, evaluate
from jobs.train import command as train_command
from pipeline.models.card import read_card

TRAIN_CONFIG = {
    # 4x4 digits (16 features, 170 parameters): exact dense Newton steps cost well under a second.
    "model": {"preset": "linear", "options": {"in_features": 16, "num_classes": 10}},
    "data": {"source": "digits", "options": {"image_size": 4, "channels": 1}},
    "recipe": {"optimizer": "lbfgs", "weight_decay": 0.01, "max_steps": 6, "tolerance": 1e-5, "seed": 0},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    (root / "train.yaml").write_text(yaml.safe_dump(TRAIN_CONFIG))
    result = CliRunner().invoke(train_command, [str(root / "train.yaml"), "--output", str(root / "model")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["n"] == 1437 and summary["test_accuracy"] > 60
    return root / "model"


def test_train_writes_a_complete_card(model_dir):
    card = read_card(model_dir)
    assert card.preset == "linear" and card.data.source == "digits"
    assert card.training.n == 1437 and card.training.weight_decay == 0.01
    assert card.training.extra["recipe"]["optimizer"] == "lbfgs"
    assert card.training.extra["seeds"]["init"] == 0
    assert (model_dir / "model.safetensors").exists()


@pytest.mark.parametrize("patch, field", [
    ({"recipe": {"optimizer": "adamw"}}, "recipe.optimizer"),
    ({"model": {"preset": "linear", "colour": "red"}}, "model.colour"),
    ({"model": {"preset": "resnet-9000"}}, "model.preset"),
    ({"data": {"source": "imagenet"}}, "data.source"),
])
def test_train_config_errors_name_the_field(tmp_path, patch, field):
    config = {**TRAIN_CONFIG, **patch}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(train_command, [str(tmp_path / "bad.yaml"), "-o", str(tmp_path / "m")])
    assert result.exit_code != 0 and field in result.output


def test_eval_random_scenario_against_retrain_with_cache(model_dir, tmp_path):
    config = EvalConfig.model_validate({
        "model_dir": str(model_dir), "forget": {"scenario": "random", "count": 12, "seed": 3},
        "methods": {"lfoci-newton": {"selection": "all"}}, "finetune": {"epochs": 1},
        "lira_shadows": 2, "curve": {"method": "lfoci-newton", "step": 4, "steps": 2},
        "cache_dir": str(tmp_path / "cache"), "out": str(tmp_path / "eval.json"), "plots": str(tmp_path / "plots"),
    })
    result = evaluate(config)
    rows = result["rows"]
    assert set(rows) >= {"original", "retrain", "finetune", "lfoci-newton"}
    for row in rows.values():
        assert {"UA", "RA", "TA", "MIA", "AvgGap", "seconds", "KL_forget_vs_retrain", "LiRA_member_rate"} <= set(row)
    assert rows["retrain"]["AvgGap"] == 0 and rows["retrain"]["KL_forget_vs_retrain"] == pytest.approx(0, abs=1e-12)
    newton = rows["lfoci-newton"]
    # Convex model, all parameters: one Newton step lands close to Retrain. Measured: relative
    # distance 0.107 and KL 1.2e-7 against the original's 1.8e-5 (ratio 0.007). The float64
    # oracle (tests/test_newton_oracles.py) reaches < 1%; here the CLI trains in float32 (a tighter
    # recipe tolerance, 1e-9 and 20 steps, gave the same 0.107), so the likely cause is float32
    # optimisation error in the original and in Retrain, not the step (not measured apart).
    # 0.2 keeps a 2x margin over 0.107; the item-1 retained-gradient step may allow tightening.
    assert newton["relative_distance_to_retrain"] < 0.2
    assert newton["KL_forget_vs_retrain"] < 0.05 * rows["original"]["KL_forget_vs_retrain"]
    assert len(result["sample_ids"]) == 12 and result["curve"]["removed"] == [0, 4, 8]
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["rows"]["retrain"]["UA"] == pytest.approx(rows["retrain"]["UA"])
    assert (tmp_path / "plots" / "scorecard.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "removal_curve.png").stat().st_size > 1000
    again = evaluate(config.model_copy(update={"methods": {}, "lira_shadows": 0, "curve": None, "plots": None, "out": None}))
    assert again["rows"]["retrain"]["cached"] and again["rows"]["finetune"]["cached"]
    assert again["rows"]["retrain"]["UA"] == pytest.approx(rows["retrain"]["UA"])


def test_eval_class_scenario_cli(model_dir, tmp_path):
    from jobs.evaluate import command as eval_command

    result = CliRunner().invoke(eval_command, [
        str(model_dir), "--scenario", "class", "--classes", "3", "--method", "lfoci-newton",
        "--config", str(_write(tmp_path / "e.yaml", {"methods": {"lfoci-newton": {"selection": "all"}},
                                                     "baselines": ["retrain"], "residual_gradient": False})),
        "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "class.json"),
    ])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "class.json").read_text())["rows"]
    assert rows["retrain"]["UA"] == pytest.approx(100.0) and rows["retrain"]["TA_forgotten"] == pytest.approx(0.0)
    assert rows["original"]["UA"] < 50
    assert rows["lfoci-newton"]["UA"] > 90
    bad = CliRunner().invoke(eval_command, [str(model_dir), "--scenario", "class"])
    assert bad.exit_code != 0 and "forget.classes" in bad.output


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_eval_records_a_refused_removal_as_needs_retrain(model_dir, tmp_path):
    """A method that refuses (RemovalNotServed: here CG capped at one iteration short of its
    tolerance) is the method's verdict, not a failure: the evaluation finishes, the baselines are
    scored, and the refusal is reported with its reason."""
    from jobs.evaluate import command as eval_command

    spec = {"methods": {"lfoci-newton": {"selection": "all", "dense_max": 1, "cg_max_iter": 1, "cg_rtol": 1e-12}},
            "baselines": ["retrain"], "residual_gradient": False}
    result = CliRunner().invoke(eval_command, [
        str(model_dir), "--scenario", "random", "--count", "5", "--config", str(_write(tmp_path / "e.yaml", spec)),
        "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "refused.json")])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "refused.json").read_text())
    assert "lfoci-newton" not in saved["rows"] and {"original", "retrain"} <= set(saved["rows"])
    refused = saved["needs_retrain"]["lfoci-newton"]
    assert "cg" in refused["reason"].lower() or "solve" in refused["reason"].lower(), refused
    assert "lfoci-newton: needs retrain" in result.output and saved["method_errors"] == {}


def test_eval_reads_the_forget_set_from_an_ids_file_as_forget_does(model_dir, tmp_path):
    """`forget.ids_file` (relative to the config's folder) and `--ids-file` give the ids scenario the set `--ids`
    gives; a file and ids together, a file under another scenario, a missing file, a bad line or an empty file are
    refused naming the field, and nothing is written."""
    from jobs.evaluate import command as eval_command
    from pipeline.removal import training_set

    ids = [int(i) for i in training_set(read_card(model_dir)).sample_ids[[3, 17, 40, 41, 99]]]
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "f.csv").write_text("sample_id,why\n# a comment\n" + "".join(f"{i},asked\n" for i in ids))
    spec = {"methods": {"lfoci-newton": {"selection": "all"}}, "baselines": ["retrain"], "residual_gradient": False,
            "forget": {"scenario": "ids", "ids_file": "sets/f.csv"}}
    common = [str(model_dir), "--cache-dir", str(tmp_path / "cache")]
    runs = {"config": ["--config", str(_write(tmp_path / "e.yaml", spec))],
            "option": ["--config", str(_write(tmp_path / "o.yaml", {**spec, "forget": {"scenario": "ids"}})),
                       "--ids-file", str(tmp_path / "sets" / "f.csv")],
            "ids": ["--config", str(tmp_path / "o.yaml"), "--ids", ",".join(map(str, ids))]}
    records = {}
    for name, extra in runs.items():
        result = CliRunner().invoke(eval_command, common + extra + ["--out", str(tmp_path / f"{name}.json")])
        assert result.exit_code == 0, result.output
        records[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert records["config"]["sample_ids"] == ids and records["config"]["scenario"]["scenario"] == "ids"
    for name in ("option", "ids"):
        assert records[name]["sample_ids"] == ids
        for metric in ("UA", "RA", "TA", "MIA"):   # the same removal of the same set (its seconds differ)
            assert records[name]["rows"]["lfoci-newton"][metric] == pytest.approx(
                records["config"]["rows"]["lfoci-newton"][metric])
    (tmp_path / "sets" / "bad.csv").write_text(f"{ids[0]}\nseventeen\n")
    (tmp_path / "sets" / "empty.csv").write_text("sample_id\n")
    for forget, said in (({"scenario": "ids", "ids_file": "sets/f.csv", "sample_ids": [1]}, "not both"),
                         ({"scenario": "class", "classes": [3], "ids_file": "sets/f.csv"}, "forget.scenario 'class'"),
                         ({"scenario": "ids", "ids_file": "sets/none.csv"}, "does not exist"),
                         ({"scenario": "ids", "ids_file": "sets/bad.csv"}, "line 2: 'seventeen'"),
                         ({"scenario": "ids", "ids_file": "sets/empty.csv"}, "holds no sample id")):
        bad = CliRunner().invoke(eval_command, common + ["--config", str(_write(tmp_path / "b.yaml", {**spec, "forget": forget})),
                                                         "--out", str(tmp_path / "never.json")])
        assert bad.exit_code == 1 and "forget" in bad.output and said in bad.output, bad.output
        assert not (tmp_path / "never.json").exists()
    both = CliRunner().invoke(eval_command, common + runs["option"] + ["--ids", "3", "--out", str(tmp_path / "never.json")])
    assert both.exit_code == 2 and "--ids or --ids-file" in both.output and not (tmp_path / "never.json").exists()
