"""Benchmark: drift of the streaming fast path on the convex digits model (issue 13, "Drift").

    .venv/bin/python -m bench.stream_drift                # 1,000 single-sample requests, batches of 4
    .venv/bin/python -m bench.stream_drift --requests 200 # shorter

Model: configs/models/linear-digits.yaml (softmax regression on scikit-learn digits, 1,437
training images, weight decay 0.01), trained by the project's trainer in float64 to a gradient
norm of 1e-10 (``model.dtype: float64``: the published weights are then the solver's own, so the
distances below are the method's, not float32 rounding's). The objective is strongly convex, so
its retrained optimum is unique: Retrain is that optimum.

Stream: ``--requests`` distinct single-sample requests (seeded), applied in batches of ``--batch``
through ``pipeline.stream_removal.WarmStreamRemover`` (the service's fast path, exactly: each
version is written as a model directory and the next removal starts from it) with the fast-path
settings of configs/stream/linear-digits.yaml (refresh every 100 batches or once the exact
retained-gradient residual passes drift_threshold = 1e-5, i.e. a distance to the optimum of at
most 1e-5 / lambda = 1e-3), target minimiser (the retrained optimum).

Compared after every batch with:
  optimum      the retrained optimum of D minus everything removed so far: L-BFGS then Newton in
               float64 on mean cross-entropy + (lambda/2)||theta||^2, warm-started, to ||grad|| <=
               1e-10 (an independent oracle: torch autograd Hessian, not the project's closed forms);
  from_scratch the same batches removed by ``pipeline.removal.remove`` (lfoci-newton on the same
               layer, curvature recomputed every step, converged to 1e-10): what the service
               publishes without the fast path;
  no_refresh   the same stream on a ``DecisionLayerStream`` that never refreshes (the control:
               what the refresh prevents).
After the last batch the served state is refreshed once more (as before a version is marked
verified) and compared again (``after_final_refresh``).
Writes bench/results/stream_drift_digits.json (atomically).
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bench.common import RESULTS_DIR, ROOT, write_json

LAYER = ["1.weight", "1.bias"]
MODEL_CONFIG = ROOT / "configs" / "models" / "linear-digits.yaml"
STREAM_CONFIG = ROOT / "configs" / "stream" / "linear-digits.yaml"
# the fast path serves decision-layer-newton (its target: minimiser, the retrained optimum of the layer)
FAST_METHOD: dict[str, Any] = {"parameters": LAYER, "epsilon": math.inf, "target": "minimiser"}
# from scratch: lfoci-newton's converged block Newton on the same layer, to the same target
SCRATCH_METHOD: dict[str, Any] = {"selection": "parameters", "parameters": LAYER, "epsilon": math.inf, "damping": 0.0,
                                  "target": "minimiser", "newton_max_steps": 30, "newton_rtol": 0.0, "newton_atol": 1e-10,
                                  "dense_rtol": 1e-12}
ORACLE_TOL = 1e-10


def train_model(out_dir: Path) -> tuple[Path, float]:
    """configs/models/linear-digits.yaml, trained in float64 to ||grad|| <= 1e-10."""
    from pipeline.config import load_yaml
    from pipeline.trainer import TrainConfig, run_training

    raw = load_yaml(MODEL_CONFIG)
    raw["model"]["dtype"] = "float64"
    raw["data"] = {"source": "digits", "options": {"dtype": "float64"}}
    raw["recipe"].update({"tolerance": 1e-10, "max_steps": 400})
    raw.pop("output", None)
    started = time.perf_counter()
    run_training(TrainConfig.model_validate(raw), out_dir)
    return out_dir, time.perf_counter() - started


def stream_settings(**override: Any) -> Any:
    """The fast-path settings of configs/stream/linear-digits.yaml (``override`` replaces fields)."""
    from pipeline.config import load_yaml
    from pipeline.streaming import StreamSettings

    spec = {k: v for k, v in load_yaml(STREAM_CONFIG)["fast_path"].items() if k != "enabled"}
    return StreamSettings(**{**spec, **override})


def block_of(state: dict[str, Tensor]) -> Tensor:
    return torch.cat([state[LAYER[0]].detach().reshape(-1), state[LAYER[1]].detach()]).to(torch.float64)


def retrained_optimum(x: Tensor, y: Tensor, lam: float, start: Tensor) -> tuple[Tensor, float]:
    """argmin mean CE(x W^T + b, y) + (lam/2)||(W, b)||^2 (float64), and its ||grad||: L-BFGS, then
    Newton steps with the autograd Hessian until ||grad|| <= ORACLE_TOL."""
    d = x.shape[1]
    k = int(start.numel() // (d + 1))

    def objective(w: Tensor) -> Tensor:
        return nn.functional.cross_entropy(x @ w[: k * d].reshape(k, d).T + w[k * d:], y) + 0.5 * lam * w.pow(2).sum()

    w = start.detach().to(torch.float64).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=200, history_size=50, tolerance_grad=1e-9, tolerance_change=0.0,
                            line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        f = objective(w)
        f.backward()
        return f

    opt.step(closure)
    theta = w.detach()
    norm = math.inf
    for _ in range(10):
        grad = torch.func.grad(objective)(theta)
        norm = float(torch.linalg.vector_norm(grad))
        if norm <= ORACLE_TOL:
            break
        hess = torch.func.hessian(objective)(theta)
        theta = theta - torch.linalg.solve(hess, grad)
    if norm > ORACLE_TOL:
        raise RuntimeError(f"the oracle stopped at ||grad|| = {norm:.3g} > {ORACLE_TOL}")
    return theta, norm


def run(requests: int = 1000, batch: int = 4, seed: int = 0, workdir: Path | None = None,
        settings_override: dict[str, Any] | None = None, from_scratch: bool = True) -> dict[str, Any]:
    """The stream, the comparisons after every batch and a summary (see the module docstring)."""
    import tempfile

    from pipeline.models.card import load_model_dir, write_model_dir
    from pipeline.removal import remove, training_set
    from pipeline.stream_removal import WarmStreamRemover
    from pipeline.streaming import DecisionLayerStream

    work = Path(workdir or tempfile.mkdtemp(prefix="stream-drift-"))
    v0, train_seconds = train_model(work / "model-v0")
    model, task, card = load_model_dir(v0)
    data = training_set(card, model)
    lam = card.training.weight_decay
    if requests > len(data) - 1:
        raise ValueError(f"--requests {requests}: the digits training set has {len(data)} samples; ask for fewer")
    ids = random.Random(seed).sample(data.sample_ids.tolist(), requests)
    batches = [ids[i:i + batch] for i in range(0, requests, batch)]
    settings = stream_settings(**(settings_override or {}))
    remover = WarmStreamRemover("decision-layer-newton", FAST_METHOD, settings)
    control, _ = DecisionLayerStream.from_model(model, task, data, LAYER, lam,
                                                settings=stream_settings(refresh_every=10**9,
                                                                         drift_threshold=math.inf))
    x_all, y_all = data.columns["x"].reshape(len(data), -1).to(torch.float64), data.columns["y"]
    keep = torch.ones(len(data), dtype=torch.bool)
    stream_parent = scratch_parent = v0
    theta_opt = block_of(dict(model.named_parameters()))
    steps: list[dict[str, Any]] = []
    for k, group in enumerate(batches):
        run_fast = remover.remove(stream_parent, group, seed=k)
        stream_parent = work / f"stream-{k % 2}"
        write_model_dir(stream_parent, run_fast.new_state, run_fast.card)
        fast = run_fast.record["fast_path"]
        control.remove(group, target=lambda st: torch.zeros(st.p, dtype=torch.float64))
        keep[data.positions_of(group)] = False
        theta_opt, oracle_norm = retrained_optimum(x_all[keep], y_all[keep], lam, theta_opt)
        theta_stream = block_of(run_fast.new_state)
        row = {"batch": k, "n_retained": int(keep.sum()), "path": fast["path"], "reason": fast["reason"],
               "fast_seconds": fast["seconds"], "published_residual": fast["published_residual"],
               "distance_to_target_bound": fast["distance_to_target_bound"],
               "stream_to_optimum": float(torch.linalg.vector_norm(theta_stream - theta_opt)),
               "no_refresh_to_optimum": float(torch.linalg.vector_norm(control.theta - theta_opt)),
               "oracle_gradient_norm": oracle_norm}
        if from_scratch:
            started = time.perf_counter()
            run_slow = remove(scratch_parent, group, method="lfoci-newton", settings=SCRATCH_METHOD, seed=k)
            row["from_scratch_seconds"] = time.perf_counter() - started
            scratch_parent = work / f"scratch-{k % 2}"
            write_model_dir(scratch_parent, run_slow.new_state, run_slow.card)
            theta_scratch = block_of(run_slow.new_state)
            row["from_scratch_to_optimum"] = float(torch.linalg.vector_norm(theta_scratch - theta_opt))
            row["stream_to_from_scratch"] = float(torch.linalg.vector_norm(theta_stream - theta_scratch))
        steps.append(row)
    # a refresh after the last batch (as before a version is marked verified), on the served state
    assert remover.state is not None
    refreshed = remover.state.refresh(reason="final")
    after_refresh = {"stream_to_optimum": float(torch.linalg.vector_norm(remover.state.theta - theta_opt)),
                     "residual_after": refreshed["residual_after"], "converged": refreshed["converged"]}
    if from_scratch:
        after_refresh["stream_to_from_scratch"] = float(torch.linalg.vector_norm(remover.state.theta - theta_scratch))
    theta0 = block_of(dict(model.named_parameters()))
    last = steps[-1]
    threshold_distance = settings.drift_threshold / lam
    worst = max(steps, key=lambda r: r["stream_to_optimum"])
    return {
        "benchmark": "stream_drift", "dataset": "digits", "model_config": str(MODEL_CONFIG.relative_to(ROOT)),
        "model": {"preset": card.preset, "dtype": "float64", "n_train": len(data), "weight_decay": lam,
                  "block_numel": int(theta0.numel()), "train_seconds": train_seconds},
        "requests": requests, "batch": batch, "batches": len(batches), "seed": seed,
        "fast_path_settings": {"stream_config": str(STREAM_CONFIG.relative_to(ROOT)), **asdict(settings)},
        "threshold": {"drift_threshold": settings.drift_threshold, "distance": threshold_distance,
                      "meaning": "after every batch the exact residual ||grad F_R|| <= drift_threshold (else a "
                                 "refresh), so ||theta - theta*_R|| <= drift_threshold / lambda"},
        "removal_moved_the_layer_by": float(torch.linalg.vector_norm(theta_opt - theta0)),
        "paths": {p: sum(r["path"] == p for r in steps) for p in ("fast", "refresh")},
        "refresh_reasons": {why: sum(r["reason"] == why for r in steps) for why in ("every_k", "drift")},
        "max_stream_to_optimum": {"value": worst["stream_to_optimum"], "batch": worst["batch"],
                                  "its_distance_to_target_bound": worst["distance_to_target_bound"],
                                  "within_threshold": worst["stream_to_optimum"] <= threshold_distance},
        "every_batch_within_its_published_bound": all(
            r["stream_to_optimum"] <= r["distance_to_target_bound"] * (1 + 1e-6) + ORACLE_TOL / lam for r in steps),
        "max_no_refresh_to_optimum": max(r["no_refresh_to_optimum"] for r in steps),
        "final": {k: last.get(k) for k in ("stream_to_optimum", "stream_to_from_scratch", "from_scratch_to_optimum",
                                           "no_refresh_to_optimum", "distance_to_target_bound", "n_retained")},
        "after_final_refresh": after_refresh,
        "max_from_scratch_to_optimum": max((r.get("from_scratch_to_optimum", 0.0) for r in steps), default=None),
        "seconds": {"fast_path_p50": statistics.median(r["fast_seconds"] for r in steps),
                    "from_scratch_remove_p50": statistics.median(r["from_scratch_seconds"] for r in steps)
                    if from_scratch else None},
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "stream_drift_digits.json")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.batch < 1:
        parser.error("--requests and --batch must be >= 1")
    torch.set_num_threads(args.threads)
    result = run(args.requests, args.batch, args.seed)
    write_json(args.out, result)
    print({k: result[k] for k in ("paths", "refresh_reasons", "threshold", "max_stream_to_optimum", "final",
                                  "after_final_refresh",
                                  "max_no_refresh_to_optimum", "seconds")})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
