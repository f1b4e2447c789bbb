"""Mixed-Linear across 2 DeepSpeed ranks (torchrun, gloo on loopback, ZeRO-3 user weights)
equals the single-process solve in float64."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from cluster.deepspeed_mixed_linear import FLAT_KEY
from pipeline.data import load_source
from pipeline.linearized import LinearizedModel
from pipeline.methods.mixed_linear import forget_user_data, train_user_weights, user_block
from tests.ray_fixtures import load_in_dtype, write_trained_model_dir

REPO = Path(__file__).resolve().parents[1]
LAMBDA = 1e-2
OPTIONS = {"hidden": [16], "activation": "tanh"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def test_two_ranks_equal_the_single_process_solve(tmp_path):
    model_dir = write_trained_model_dir(tmp_path / "core", "mlp", OPTIONS, dtype=torch.float64, steps=1,
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
