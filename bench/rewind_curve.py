"""How early an SGD recipe fits a forget set, and how much of that fit the recipe's own later epochs on the retained
data undo: what a removal that starts from the trained weights (or from any recorded checkpoint) is up against.

    python -m bench.rewind_curve --dataset identities --scenario random_10pct --threads 1
    python -m bench.rewind_curve --dataset identities --scenario random_10pct --epochs 2,4,8,14
    python -m bench.rewind_curve --smoke          # tiny (tests)

On the deep forgetting benchmark's seed-0 original and its recorded run (``bench.deep_forgetting.setup``), for the
scenario's first declared tuning set U (drawn as the benchmark draws it: never a reported set):
  * timeline: accuracy on U, on a seeded sample of D \\ U and on the test set at every recorded checkpoint;
  * rewind curve: from the checkpoint after epoch k, the recipe's epochs k..E-1 on D \\ U alone
    (``pipeline.recipe.fit`` with ``start_epoch=k``: Retrain's orders and rates for those epochs, the momentum restarted
    at zero: a checkpoint does not keep it, so for k > 0 these are not exactly Retrain's later epochs), scored as the benchmark scores a row against Retrain of the same recipe
    (UA, RA, TA, MIA, Avg. Gap; retrain-reseed beside it), with its seconds and their share of Retrain's. Epoch 0 is
    Retrain itself (its Avg. Gap 0 is a check of the harness), epoch E the original.
This is a measurement of the recipe, not a removal method: a rewind costs (E - k) / E of Retrain.
Writes bench/results/rewind_curve_<dataset>_<scenario>[_smoke].json.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS_DIR, write_json
from bench.deep_forgetting import (
    DATASETS, RESEED, _accuracy, add_gaps, draw_forget_sets, environment, score, set_eval, setup, strip_logits,
)
from pipeline.recipe import fit
from pipeline.trajectory import checkpoint_epochs as recorded_after
from pipeline.trajectory import checkpoint_every, load_checkpoint

RETAIN_PROBE = 1024  # the timeline's seeded sample of D \ U
PROBE_SEED = 4343


def checkpoint_epochs(epochs: int, checkpoints: int, recorded: int | None = None) -> list[int]:
    """The epoch each recorded checkpoint follows (``pipeline.trajectory.checkpoint_epochs``), checked against the
    ``recorded`` count where one is given."""
    at = recorded_after(epochs, checkpoints)
    if recorded is not None and recorded != len(at):
        raise ValueError(f"{recorded} recorded checkpoints for {epochs} epochs; the recorder keeps {len(at)} "
                         f"(every {checkpoint_every(epochs, checkpoints)} epochs and the last)")
    return at


def run(dataset: str, scenario: str, profile: str = "full", epochs: list[int] | None = None) -> dict[str, Any]:
    ctx = setup(dataset, profile)
    if scenario not in DATASETS[dataset].scenarios:
        raise ValueError(f"--scenario: {dataset} has {DATASETS[dataset].scenarios}, not '{scenario}'")
    recipe = ctx.recipe(0)
    if recipe.optimizer != "sgd" or recipe.trajectory_checkpoints < 1:
        raise ValueError(f"{dataset}: its recipe records no trajectory (an SGD recipe with trajectory_checkpoints >= 1)")
    at = checkpoint_epochs(recipe.epochs, recipe.trajectory_checkpoints)
    asked = sorted(set(at if epochs is None else epochs))
    unknown = [k for k in asked if k not in at]
    if unknown:  # before anything is trained
        raise ValueError(f"--epochs: {unknown} are not recorded checkpoints (recorded after epochs {at})")
    started = time.perf_counter()
    original = ctx.original(0)
    trajectory = ctx.trajectories[0]
    checkpoint_epochs(recipe.epochs, recipe.trajectory_checkpoints, len(trajectory.checkpoints))  # as recorded
    _, tuning = draw_forget_sets(scenario, ctx.train, ctx.num_classes, int(ctx.profile["sets"]), 1)
    fs = tuning[0]
    ev = set_eval(ctx, fs)
    dtype = next(original.parameters()).dtype
    retain = ev.retain.astype(dtype)
    probe = retain.take(torch.randperm(len(retain), generator=torch.Generator().manual_seed(PROBE_SEED))
                        [:RETAIN_PROBE].sort().values)

    timeline = []
    model = copy.deepcopy(original)
    for index, (epoch, checkpoint) in enumerate(zip(at, trajectory.checkpoints)):
        load_checkpoint(model, checkpoint)
        model.eval()
        timeline.append({"checkpoint": index, "epoch": epoch, "forget_accuracy": _accuracy(ctx, model, ev.forget),
                         "retained_accuracy": _accuracy(ctx, model, probe),
                         "test_accuracy": _accuracy(ctx, model, ev.test)})

    retrain, retrain_seconds = ctx.fit(retain, 0)
    reseed, _ = ctx.fit(retain, RESEED)
    rows = {"original": score(ctx, original, ev, 0), "retrain": score(ctx, retrain, ev, 0),
            "retrain-reseed": score(ctx, reseed, ev, 0)}
    seconds: dict[str, float] = {}
    for epoch in asked:
        model = copy.deepcopy(original)
        load_checkpoint(model, trajectory.checkpoints[at.index(epoch)])
        tick = time.perf_counter()
        fit(model, ctx.task, retain, recipe, start_epoch=epoch)
        seconds[f"rewind {epoch}"] = time.perf_counter() - tick
        model.eval()
        rows[f"rewind {epoch}"] = score(ctx, model, ev, 0)
    add_gaps(rows)
    strip_logits(rows)
    keys = ("UA", "RA", "TA", "MIA", "AvgGap", "KL_forget", "KL_test")
    rewinds = [{"epoch": epoch, "seconds": seconds[f"rewind {epoch}"],
                "retrain_share": seconds[f"rewind {epoch}"] / retrain_seconds,
                **{k: rows[f"rewind {epoch}"].get(k) for k in keys}} for epoch in asked]
    return {"benchmark": "rewind_curve", "dataset": dataset, "scenario": scenario, "profile": profile,
            "forget_set": fs.describe(), "m": len(fs.ids), "n": len(ctx.train), "epochs": recipe.epochs,
            "references": {name: {k: rows[name].get(k) for k in keys} for name in ("original", "retrain",
                                                                                   "retrain-reseed")},
            "retrain_seconds": retrain_seconds, "timeline": timeline, "rewind": rewinds,
            "wall_seconds": time.perf_counter() - started, "environment": environment()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="identities")
    parser.add_argument("--scenario", default="random_10pct")
    parser.add_argument("--epochs", default=None,
                        help="comma-separated recorded epochs to rewind to (default: every recorded checkpoint)")
    parser.add_argument("--smoke", action="store_true", help="the benchmark's smoke profile (tests)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    args = parser.parse_args(argv)
    try:
        epochs = None if args.epochs is None else [int(v) for v in args.epochs.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--epochs: whole numbers separated by commas, got '{args.epochs}'")
    if args.threads:
        torch.set_num_threads(args.threads)
    profile = "smoke" if args.smoke else "full"
    try:
        result = run(args.dataset, args.scenario, profile, epochs)
    except ValueError as err:
        parser.error(str(err))
    result["command"] = ["python", "-m", "bench.rewind_curve", *(sys.argv[1:] if argv is None else argv)]
    stem = f"rewind_curve_{args.dataset}_{args.scenario}" + ("_smoke" if args.smoke else "")
    write_json(args.out or RESULTS_DIR / f"{stem}.json", result)
    for row in result["rewind"]:
        print(f"rewind to epoch {row['epoch']:>3}: Avg. Gap {row['AvgGap']:.1f}, UA {row['UA']:.1f}, "
              f"{row['retrain_share']:.2f} of Retrain's seconds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
