"""Mixed-Linear across 2 DeepSpeed ranks (torchrun, gloo on loopback, ZeRO-3 user weights)
equals the single-process solve in float64."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.methods.mixed_linear import FLAT_KEY
from pipeline.data import load_source
from pipeline.linearized import LinearizedModel
from pipeline.methods.mixed_linear import forget_user_data, train_user_weights, user_block
from tests import kit
from tests.kit import load_in_dtype

REPO = Path(__file__).resolve().parents[1]
LAMBDA = 1e-2
OPTIONS = {"hidden": [16], "activation": "tanh"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def test_two_ranks_equal_the_single_process_solve(tmp_path):
    model_dir = kit.trained_model_dir(tmp_path / "core", "mlp", OPTIONS, dtype=torch.float64, steps=1,
                                        weight_decay=1e-3)
    data = load_source("digits", {"dtype": "float64"})["train"]
    user_ids = data.sample_ids[300:701].tolist()  # 401 samples: the shards differ in size
    forget_ids = user_ids[::7]
    config = {
        "model": str(model_dir),
        "user_data": {"source": "digits", "options": {"dtype": "float64"}, "split": "train", "sample_ids": user_ids},
        "forget": {"sample_ids": forget_ids},
        "settings": {"user_last_modules": 1, "cg_rtol": 1e-11},
        "weight_decay": LAMBDA, "zero_stage": 3, "batch_size": 512, "output": str(tmp_path / "out"),
    }
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions"), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "mixed-linear-dist", "--config", str(path), "--nproc", "2"],
                          env=env, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    record = json.loads((tmp_path / "out" / "mixed_linear.json").read_text())
    assert record["world_size"] == 2 and record["backend"] == "gloo" and record["zero_stage"] == 3
    assert record["train"]["samples"] == 401 and record["forget"]["samples_retained"] == 401 - len(forget_ids)
    distributed = load_file(str(tmp_path / "out" / "user_weights.safetensors"))[FLAT_KEY]

    model, task = load_in_dtype(model_dir, "mlp", OPTIONS, torch.float64)
    block = user_block(model, last_modules=1)
    lin = LinearizedModel(model, task, block)
    user = data.take(data.positions_of(user_ids))
    trained = train_user_weights(lin, user, LAMBDA, rtol=1e-11, batch_size=512).user_weights
    retain = user.without(user.positions_of(forget_ids))
    single = forget_user_data(lin, trained, retain, LAMBDA, rtol=1e-11, batch_size=512).user_weights
    assert distributed.dtype == torch.float64 and distributed.shape == single.shape == (block.numel,)
    assert rel(distributed, single) <= 1e-6, rel(distributed, single)
    assert rel(trained, single) > 1e-3  # the forgetting step mattered


def test_data_follows_the_configured_dtype(tmp_path):
    """The reported failure: a float32 model directory on digits (float32 data), a minimal
    config with the default ``dtype: float64`` died with "mat1 and mat2 must have the same
    dtype". The job casts the user data to the model's dtype; the result matches the
    single-process float64 solve. (One rank in this process: the maths of every rank.)"""
    from pipeline.methods.mixed_linear import DataParallelJob, read_user_weights, run_data_parallel

    model_dir = kit.trained_model_dir(tmp_path / "core", "linear", {}, steps=5)
    job = DataParallelJob.model_validate({"model": str(model_dir), "forget": {"sample_ids": [1, 2, 3]},
                                          "output": str(tmp_path / "out")})
    assert job.dtype == "float64"
    record = run_data_parallel(job)
    assert record["dtype"] == "float64" and record["forget"]["samples_retained"] == record["user_samples"] - 3
    model, task = load_in_dtype(model_dir, "linear", {}, torch.float64)
    lin = LinearizedModel(model, task, user_block(model, last_modules=1))
    data = load_source("digits", {"dtype": "float64"})["train"]
    retain = data.without(data.positions_of([1, 2, 3]))
    single = train_user_weights(lin, retain, 0.01, rtol=1e-10, batch_size=256).user_weights
    written = read_user_weights(tmp_path / "out" / "user_weights.safetensors")
    assert rel(written.weights[FLAT_KEY], single) <= 1e-6
    assert written.weight_decay == 0.01 and sorted(written.sample_ids) == sorted(retain.sample_ids.tolist())


def test_init_user_weights_of_another_lambda_are_refused(tmp_path):
    from pipeline.methods.mixed_linear import DataParallelJob, UserWeightsBindingError, run_data_parallel

    model_dir = kit.trained_model_dir(tmp_path / "core", "linear", {}, steps=2)
    first = DataParallelJob.model_validate({"model": str(model_dir), "output": str(tmp_path / "a"), "weight_decay": 0.05})
    run_data_parallel(first)
    again = DataParallelJob.model_validate({"model": str(model_dir), "output": str(tmp_path / "b"),
                                            "init_user_weights": str(tmp_path / "a" / "user_weights.safetensors"),
                                            "forget": {"sample_ids": [1]}})
    with pytest.raises(UserWeightsBindingError, match="weight decay 0.05"):
        run_data_parallel(again)
    assert not (tmp_path / "b").exists()
