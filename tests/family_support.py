"""Shared builders for the model-family / data / evaluation tests (tiny, CPU-fast)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Small settings for an end-to-end L-FOCI Newton removal on a tiny model: at most 4 L-FOCI
# slices plus the output layer (no forget-gradient additions), CG solved to its tolerance (an
# unsolved system is refused, never published), one Newton step, curvature on 16 samples.
LFOCI_SMALL: dict[str, Any] = {"perturbations": 24, "pass_size": 24, "max_slices": 4, "curvature_samples": 16,
                               "damping": 0.01, "dense_max": 32, "cg_rtol": 1e-6, "forget_gradient_share": 0.0,
                               "newton_max_steps": 1, "min_gradient_reduction": 0.0}


def train_model_dir(directory: Path, preset: str, options: dict, source: str, data_options: dict,
                    recipe: dict, init: dict | None = None) -> Path:
    """Train with the real ``unlearn train`` code path and return the model directory."""
    from jobs.train import TrainConfig, run_training

    config = TrainConfig.model_validate({
        "model": {"preset": preset, "options": options, **({"init": init} if init else {})},
        "data": {"source": source, "options": data_options},
        "recipe": recipe,
    })
    run_training(config, directory)
    return directory


def assert_removal_end_to_end(model_dir: Path, n_forget: int = 2, settings: dict | None = None) -> dict:
    """Remove the first ``n_forget`` training ids with lfoci-newton; check the result is usable."""
    from jobs.removal import remove, training_set
    from pipeline.models.card import load_model_dir, read_card

    card = read_card(model_dir)
    ids = training_set(card).sample_ids[:n_forget].tolist()
    run = remove(model_dir, ids, method="lfoci-newton", settings=settings or LFOCI_SMALL, seed=0, batch_size=64)
    model, _, _ = load_model_dir(model_dir)
    before = model.state_dict()
    assert set(run.new_state) == set(before)
    assert all(bool(torch.isfinite(v).all()) for v in run.new_state.values())
    record = run.record
    solver = record["curvature"]["solver"]
    assert solver["converged"] and solver["relative_residual"] <= solver["tolerance"], solver
    norms = record["gradient_norms"]
    assert norms["retain_mean_block_after"] < norms["retain_mean_block_before"], norms  # the step removed some
    changed = [k for k in before if not torch.equal(before[k], run.new_state[k])]
    assert changed, "the removal changed no parameter"
    assert run.card.training.n == card.training.n - n_forget
    assert run.card.training.removed_ids == sorted(ids)
    model.load_state_dict(run.new_state, strict=True)  # the new state loads into the preset
    return {"record": run.record, "changed": changed}
