"""Progress output (issue 12, section 4): `unlearn train`, `unlearn forget` and `unlearn eval` show
tqdm bars with the time left on stderr when UNLEARN_PROGRESS=1, nothing when it is 0 or when
stderr is not a terminal, and stdout (the JSON / table that scripts parse) is the same either way.

The commands run as subprocesses (stderr is a pipe, not a terminal) on the tiny 4x4 digits
softmax model of tests/test_train_eval_jobs.py; UNLEARN_PROGRESS_INTERVAL=0 redraws on every
update so that a bar with a time-left estimate is printed even by runs that take a second."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import progress

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = {
    "model": {"preset": "linear", "options": {"in_features": 16, "num_classes": 10}},
    "data": {"source": "digits", "options": {"image_size": 4, "channels": 1}},
    "recipe": {"optimizer": "sgd", "weight_decay": 0.01, "epochs": 2, "lr": 0.05, "batch_size": 64, "seed": 0},
}
# tqdm's meter: "n/total [elapsed<remaining" with a time-left estimate (not "<?")
ETA = re.compile(r"\d+/\d+ \[\d\d:\d\d<\d\d:\d\d")
TQDM_MARKS = re.compile(r"\d+/\d+ \[|it/s|s/it|\x1b\[A")


def unlearn(args: list[str], flag: str | None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNLEARN_PROGRESS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", UNLEARN_PROGRESS_INTERVAL="0")
    if flag is not None:
        env["UNLEARN_PROGRESS"] = flag
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def lines(stderr: str) -> str:
    """tqdm redraws with carriage returns: one line per redraw."""
    return stderr.replace("\r", "\n")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`unlearn train` with UNLEARN_PROGRESS unset and stderr a pipe: silent, JSON on stdout."""
    root = tmp_path_factory.mktemp("progress")
    (root / "train.yaml").write_text(yaml.safe_dump(TRAIN_CONFIG))
    run = unlearn(["train", str(root / "train.yaml"), "-o", str(root / "model")], flag=None)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert not TQDM_MARKS.search(run.stderr) and "training (SGD)" not in run.stderr
    return root, summary


def test_train_shows_epochs_by_batches_with_time_left_and_loss(trained, tmp_path):
    root, quiet = trained
    run = unlearn(["train", str(root / "train.yaml"), "-o", str(tmp_path / "model")], flag="1")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)  # stdout is only the JSON summary
    assert set(summary) == set(quiet) and summary["sha256"] == quiet["sha256"]  # same result, bit for bit
    err = lines(run.stderr)
    batches = 2 * -(-summary["n"] // 64)
    sgd = [line for line in err.splitlines() if line.startswith("training (SGD)")]
    assert any(ETA.search(line) and f"/{batches} [" in line for line in sgd), err[-2000:]
    assert any("loss=" in line and "epoch=2/2" in line for line in sgd)
    for step in ("train: data (digits)", "train: fit (sgd", "train: accuracy", "train: write"):
        assert step in err
    assert "train: fit (sgd, n=1437) done in" in err
    assert not TQDM_MARKS.search(run.stdout)


def test_train_silent_with_progress_0(trained, tmp_path):
    root, quiet = trained
    run = unlearn(["train", str(root / "train.yaml"), "-o", str(tmp_path / "model")], flag="0")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["sha256"] == quiet["sha256"]
    assert not TQDM_MARKS.search(run.stderr) and "train:" not in run.stderr and "training" not in run.stderr


def _forget_config(tmp_path: Path, model: Path, settings: dict, out: str) -> Path:
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(model), "forget": {"sample_ids": [1, 2, 3]},
        "method": {"name": "lfoci-newton", "settings": settings}, "output": str(tmp_path / out),
    }))
    return path


def test_forget_shows_each_stage_and_its_inner_loops(trained, tmp_path):
    root, _ = trained
    # L-FOCI selection (a probe) and a block above dense_max (CG): every stage and inner loop runs.
    # target minimiser: the Newton solve's inner loops are what this shows (on this SGD card the retrain
    # target's small block is set by the recipe replay, with no CG)
    settings = {"target": "minimiser", "selection": "lfoci", "perturbations": 64, "pass_size": 8, "max_slices": 4, "dense_max": 8,
                "cg_max_iter": 200}
    run = unlearn(["forget", "--config", str(_forget_config(tmp_path, root / "model", settings, "on"))], flag="1")
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["n_after"] == record["n_before"] - 3
    err = lines(run.stderr)
    label = "forget lfoci-newton: "
    for stage in ("probe", "selection", "gradients", "curvature_and_solve", "verify"):
        assert f"{label}{stage} done in" in err, (stage, err[-3000:])
    probe = [line for line in err.splitlines() if line.startswith(f"{label}probe [perturbation passes]")]
    assert any(ETA.search(line) and "/64 [" in line for line in probe), err[-3000:]
    cg = [line for line in err.splitlines() if line.startswith(f"{label}curvature_and_solve [CG iterations]")]
    assert any(ETA.search(line) and "rel_residual=" in line for line in cg), err[-3000:]
    assert f"{label}selection [L-FOCI picks]" in err
    assert not TQDM_MARKS.search(run.stdout)

    quiet = unlearn(["forget", "--config", str(_forget_config(tmp_path, root / "model", settings, "off"))], flag="0")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip() == "" or not (TQDM_MARKS.search(quiet.stderr) or label in quiet.stderr)
    again = json.loads(quiet.stdout)
    assert set(again) == set(record) and again["n_after"] == record["n_after"]
    on = json.loads((tmp_path / "on" / "removal.json").read_text())
    off = json.loads((tmp_path / "off" / "removal.json").read_text())
    assert on["selection"]["selected"] == off["selection"]["selected"]  # bars change nothing
    assert on["newton"]["history"] == off["newton"]["history"]


def test_eval_shows_the_protocol_steps_and_removal_stages(trained, tmp_path):
    root, _ = trained
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"methods": {"lfoci-newton": {"selection": "all", "target": "minimiser"}}, "baselines": ["retrain"],
                                      "residual_gradient": False}))
    args = ["eval", str(root / "model"), "--config", str(config), "--count", "5", "--cache-dir", str(tmp_path / "cache")]
    run = unlearn(args, flag="1")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].split()[:2] == ["method", "UA"]
    assert {"original", "retrain", "lfoci-newton"} <= {line.split()[0] for line in run.stdout.splitlines()[2:] if line.strip()}
    err = lines(run.stderr)
    for step in ("load", "original", "retrain", "lfoci-newton", "compare"):
        assert f"eval: {step} done in" in err, (step, err[-3000:])
    assert any(line.startswith("eval: ") and ETA.search(line) and "/5 [" in line for line in err.splitlines())
    assert any(line.startswith("training (SGD)") and ETA.search(line) for line in err.splitlines())  # Retrain
    for stage in ("gradients", "curvature_and_solve", "verify"):
        assert f"lfoci-newton: {stage} done in" in err
    assert "lfoci-newton: curvature_and_solve [Hessian columns]" in err
    quiet = unlearn(args, flag="0")
    assert quiet.returncode == 0 and not TQDM_MARKS.search(quiet.stderr) and "eval:" not in quiet.stderr
    assert [line.split()[0] for line in quiet.stdout.splitlines()] == [line.split()[0] for line in run.stdout.splitlines()]


# -- the pieces, in process ----------------------------------------------------------------------------
def test_tick_without_a_stage_is_a_no_op_and_stage_phases_restart_the_bar(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV, "1")
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")
    progress.tick(5, total=10, phase="nothing open")  # no stage: nothing happens
    hook = progress.StageProgress("demo")
    hook.started("solve")
    for _ in range(3):
        progress.tick(total=4, phase="CG iterations", rel_residual=0.5)
    assert hook._bar.n == 3 and hook._bar.total == 4
    progress.tick(2, total=8, phase="Hessian columns", unit="col")
    assert hook._bar.n == 2 and hook._bar.total == 8 and hook._bar.unit == "col"
    hook.finished("solve", 1.25)
    progress.tick(total=1, phase="after")  # closed: a no-op again
    captured = capsys.readouterr()
    assert captured.out == ""
    err = lines(captured.err)
    assert "demo: solve [CG iterations]" in err and "rel_residual=5.00e-01" in err
    assert "demo: solve done in 1.2 s" in err or "demo: solve done in 1.3 s" in err


def test_forced_and_silent(monkeypatch, capsys):
    monkeypatch.delenv(progress.ENV, raising=False)
    with progress.forced(False):
        assert not progress.enabled()
        hook = progress.StageProgress("x")
        hook.started("probe")
        progress.tick(total=3, phase="p")
        hook.finished("probe", 0.1)
        with progress.Steps(["a"], "job") as steps, steps.step("a"):
            pass
    with progress.forced(True):
        assert progress.enabled()
    assert progress.ENV not in os.environ
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
