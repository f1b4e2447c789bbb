"""A real Ray head on loopback accepts removals as Ray jobs (`ray job submit` and `unlearn
submit run`), and the job's output checkpoint is bitwise the in-process one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.checkpoint import read_state_dict
from pipeline.config import load_config
from jobs.forget import ForgetConfig, run_forget
from jobs.submit import DEFAULT_EXCLUDES, JOB_ENV
from tests import kit
from tests.kit import LoopbackHead

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent  # the project venv's interpreter runs the jobs


@pytest.fixture(scope="module")
def head():
    h = LoopbackHead(VENV_BIN).start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def removal(tmp_path_factory):
    """A linear model on digits, a forget config and the in-process removal's checkpoint."""
    root = tmp_path_factory.mktemp("job")
    model_dir = kit.trained_model_dir(root / "model", "linear", {}, steps=15)
    config = {
        "model": str(model_dir),
        "forget": {"sample_ids": [1, 2, 33, 48]},
        "method": {"name": "lfoci-newton", "settings": {"selection": "lfoci", "perturbations": 96, "pass_size": 16}},
        "seed": 7,
        "output": str(root / "in-process"),
    }
    path = root / "forget.yaml"
    path.write_text(yaml.safe_dump(config))
    run_forget(load_config(ForgetConfig, path), root)
    return root, path, root / "in-process" / "model.safetensors"


def assert_same_removal(got: Path, expected: Path, original: Path) -> None:
    """The job's weights equal the in-process removal's up to float summation order (the job's
    processes use other thread counts), far closer than the removal's own step."""
    a, b, w0 = read_state_dict(got), read_state_dict(expected), read_state_dict(original)
    assert set(a) == set(b)
    for key in b:
        step = float((b[key] - w0[key]).abs().max())
        diff = float((a[key] - b[key]).abs().max())
        assert diff <= 1e-3 * step + 1e-7, (key, diff, step)
    assert any(not torch.equal(b[k], w0[k]) for k in b), "the removal changed nothing"


def test_ray_job_submit_runs_a_removal_on_the_cluster(head, removal):
    root, config, expected = removal
    out = root / "ray-job-submit"
    runtime_env = {"excludes": list(DEFAULT_EXCLUDES), "env_vars": JOB_ENV}
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", head.address, "--working-dir", str(REPO),
           "--runtime-env-json", json.dumps(runtime_env), "--",
           sys.executable, "-m", "jobs.cli", "forget", "--config", str(config), "--output", str(out),
           "--workers", "2"]
    proc = subprocess.run(cmd, env=head.env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "succeeded" in (proc.stdout + proc.stderr).lower()
    assert_same_removal(out / "model.safetensors", expected, root / "model" / "model.safetensors")
    record = json.loads((out / "removal.json").read_text())
    assert record["distributed"]["workers"] == 2
    assert record["distributed"]["address"] != "local"  # the pool ran on the job's cluster
    assert record["distributed"]["curvature_products"] > 0


def test_unlearn_submit_wraps_the_jobs_sdk(head, removal):
    root, config, expected = removal
    out = root / "unlearn-submit"
    cmd = [sys.executable, "-m", "jobs.cli", "submit", "run", "--address", head.address, "--working-dir", str(REPO),
           "--job-id", "unlearn-submit-test", "--timeout", "300", "--",
           "forget", "--config", str(config), "--output", str(out)]
    proc = subprocess.run(cmd, env=head.env, capture_output=True, text=True, timeout=330, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"job_id": "unlearn-submit-test", "status": "SUCCEEDED"}
    assert_same_removal(out / "model.safetensors", expected, root / "model" / "model.safetensors")
    status = subprocess.run([sys.executable, "-m", "jobs.cli", "submit", "status", "--address", head.address,
                             "unlearn-submit-test"], env=head.env, capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["status"] == "SUCCEEDED"
    logs = subprocess.run([sys.executable, "-m", "jobs.cli", "submit", "logs", "--address", head.address,
                           "unlearn-submit-test"], env=head.env, capture_output=True, text=True, timeout=60)
    assert '"method": "lfoci-newton"' in logs.stdout
