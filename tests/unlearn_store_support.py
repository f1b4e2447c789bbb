"""Shared builders for the ledger / version-store / campaign / stream tests: a linear softmax
model trained on the real digits with L-BFGS, imported as version 0 of a version store."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from tests.kit import http_json  # noqa: F401  (the one HTTP helper, re-used by the store tests)

REPO = Path(__file__).resolve().parents[1]
WEIGHT_DECAY = 0.01
# lfoci-newton as deployed (L-FOCI picks the slices from a small probe), with a finite epsilon
# and a strong-convexity constant that keeps the calibrated noise small on this model.
METHOD = {"name": "lfoci-newton", "settings": {"selection": "lfoci", "perturbations": 40, "max_slices": 1,
                                               "epsilon": 2.0, "delta": 1e-5, "strong_convexity": 1.0}}
# The same method on a fixed 10-parameter block (the output bias): for tests of the plumbing
# around a removal, where the selection does not matter and time does.
METHOD_FAST = {"name": "lfoci-newton", "settings": {"selection": "parameters", "parameters": ["1.bias"],
                                                    "epsilon": 2.0, "delta": 1e-5, "strong_convexity": 1.0}}


def train_model_dir(out: Path) -> Path:
    """softmax regression on digits (float32), weight decay 0.01, fit_lbfgs; written as a model dir."""
    from pipeline.data import load_source
    from pipeline.models.card import DataRef, ModelCard, TrainingRecord, write_model_dir
    from pipeline.models.registry import build
    from pipeline.training import fit_lbfgs

    torch.manual_seed(0)
    train = load_source("digits")["train"]
    model, task = build("linear", {})
    fit_lbfgs(model, task, train, WEIGHT_DECAY, tolerance=1e-5, max_steps=2)
    card = ModelCard(preset="linear", options={}, data=DataRef(source="digits"),
                     training=TrainingRecord(weight_decay=WEIGHT_DECAY, n=len(train), optimizer="lbfgs"))
    write_model_dir(out, {k: v.detach() for k, v in model.state_dict().items()}, card)
    return out


def cached_model_dir(tmp_path_factory) -> Path:
    """The trained model directory, trained once per test session (shared by the test modules)."""
    out = tmp_path_factory.getbasetemp() / "unlearn-digits-linear"
    if not (out / "model.json").is_file():
        train_model_dir(out)
    return out


def make_store(root: Path, model_dir: Path, name: str = "digits") -> Path:
    """A version store at ``root`` with ``model_dir`` imported as version 0 of ``name``."""
    from pipeline.store.versions import VersionStore

    store = VersionStore(root, create=True)
    with store.lock(name, create=True):
        store.import_model_dir(name, model_dir)
    return root


def train_ids(count: int, start: int = 0) -> list[int]:
    """The first ``count`` training sample ids of digits (ids divisible by 5 are test samples)."""
    ids = [i for i in range(start, 5000) if i % 5 != 0]
    return ids[:count]


def write_requests_csv(path: Path, groups: list[list[int]], prefix: str = "r") -> Path:
    lines = ["request_id,subject,sample_ids"]
    lines += [f"{prefix}{k},subject-{k},{';'.join(map(str, g))}" for k, g in enumerate(groups)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def unlearn_argv(*args: str) -> list[str]:
    """``python -m jobs.cli ARGS`` - or ``python -m jobs.<group> REST`` while the CLI cannot yet
    import every sub-command module (other modules are being written in parallel)."""
    import ast
    import importlib.util

    tree = ast.parse((REPO / "jobs" / "cli.py").read_text())
    modules = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                   if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "COMMAND_MODULES")
    if all(importlib.util.find_spec(m) is not None for m in modules):
        return [sys.executable, "-m", "jobs.cli", *args]
    return [sys.executable, "-m", f"jobs.{args[0]}", *args[1:]]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(unlearn_argv(*args), cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def state_of(store_root: Path, model: str, version: int | None = None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from pipeline.store.versions import VersionStore

    info = VersionStore(store_root).open_verified(model, version)
    return load_file(str(info.path / "model.safetensors"))


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
