"""Benchmark: how one L-FOCI Newton removal grows in time and peak memory.

    .venv/bin/python -m bench.bench_growth --threads 1          # default (~7 min on 2 shared cores)
    .venv/bin/python -m bench.bench_growth --quick --threads 1  # fewer points
    .venv/bin/python -m bench.bench_growth --smoke --threads 1  # one tiny point per axis (tests)
    .venv/bin/python -m bench.bench_growth --replot bench/results/growth.json  # redo plot + derived figures

One removal (``lfoci-newton`` through the method registry: probe -> L-FOCI -> restricted exact
Hessian, dense Cholesky up to ``dense_max`` entries, CG above -> Newton update) on an MLP
(``mlp`` preset, tanh, two hidden layers) trained by SGD on scikit-learn's digits (1,437
training images, 64 features). Four axes, one varied at a time around a base point:
  slices         L-FOCI's cap ``max_slices`` = k (L-FOCI stops earlier when no slice adds
                 information: ``slices_selected`` reports what it took); solver as the method's
                 default: dense Cholesky up to 4,096 entries, CG above
  perturbations  m_p, the probe's perturbed passes
  removed        m, the number of forgotten samples
  width          hidden width of both layers (model size)
On the last three axes the solve is always CG (``dense_max`` 1, to ``cg_rtol`` 1e-6, damping 0.01):
the dense path costs one Hessian-vector product per block entry, so with it the time would
follow the number of entries L-FOCI happens to pick rather than the axis (the slices axis shows
that cost).
Timing: each point first runs a tiny warm-up removal (the first torch.func call of a process
costs seconds), then the timed one. Memory: every point runs in a *fresh* Python process (``bench.common.run_point``) that loads
the (pre-trained, cached) model and data, records its RSS, runs the removal, and reports the
process's getrusage peak RSS (``peak_rss_gib``; the warm-up is a tiny dense removal, below the
timed one) and the peak RSS sampled every 20 ms during the removal minus the RSS just before
it (``removal_extra_gib``): tracemalloc cannot see torch's allocations. Stage times are the
method's own: what it reports through ``RemovalProblem.stage_hook`` (``bench.common.measure_removal``),
or its record's ``timings`` where it reports none there; the stage names are the method's.

Writes bench/results/growth.json and growth.png (quick: growth_quick.*, smoke: growth_smoke.*).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (RESULTS_DIR, ROOT, current_rss_bytes, gib, machine_info, peak_rss_bytes, print_table,
                          run_point, write_json)

BASE = {"width": 256, "slices": 16, "perturbations": 256, "removed": 8}
AXES: dict[str, dict[str, list[int]]] = {
    "default": {"slices": [1, 2, 4, 8, 16, 32, 64, 128], "perturbations": [64, 128, 256, 512, 1024, 2048],
                "removed": [1, 4, 16, 64, 256], "width": [32, 64, 128, 256, 512, 1024]},
    "quick": {"slices": [1, 4, 16, 64], "perturbations": [64, 256, 1024], "removed": [1, 16, 128],
              "width": [64, 256, 1024]},
    "smoke": {"slices": [1], "perturbations": [16], "removed": [1], "width": [8]},
}
SMOKE_BASE = {"width": 8, "slices": 1, "perturbations": 16, "removed": 1}
TRAIN = {"epochs": 30, "lr": 0.1, "batch_size": 64, "weight_decay": 1e-3, "seed": 0}
TRAIN_SMOKE = {**TRAIN, "epochs": 2}
def stages_of(points: list[dict[str, Any]]) -> list[str]:
    """The stage names the method reported, in first-seen order."""
    names: dict[str, None] = {}
    for p in points:
        for name in p.get("stages") or {}:
            names.setdefault(name)
    return list(names)


def settings_for(point: dict[str, Any]) -> dict[str, Any]:
    """The registry method's settings on the perturbations / removed / width axes: CG always
    (dense_max 1), so that the block size L-FOCI happens to pick does not switch the solver."""
    # selection "lfoci": the axes measure L-FOCI's cost; the default "auto" would take the whole
    # model instead at the small widths (it fits the dense solver). The method refuses a system
    # not solved to cg_rtol (RemovalNotServed), so the CG cap is a safety net well above what
    # these damped systems need, not a truncation of the solve.
    return {"selection": "lfoci", "perturbations": point["perturbations"], "pass_size": 64,
            "max_slices": point["slices"], "dense_max": 1, "damping": 0.01, "cg_rtol": 1e-6, "cg_max_iter": 1000}


# the warm-up removal (not measured; it pays torch.func's first-call cost): one L-FOCI slice,
# no additions, one dense Newton step; it may remove little of the gradient of its one-sample
# request, which is not what it is for (min_gradient_reduction 0)
WARMUP = {"selection": "lfoci", "perturbations": 16, "pass_size": 16, "max_slices": 1, "include_output_layer": False,
          "forget_gradient_share": 0.0, "newton_max_steps": 1, "min_gradient_reduction": 0.0, "damping": 0.01}


def model_path(workdir: Path, width: int, recipe: dict[str, Any]) -> Path:
    return workdir / f"mlp-w{width}-e{recipe['epochs']}.safetensors"


def ensure_model(workdir: Path, width: int, recipe: dict[str, Any] = TRAIN) -> Path:
    """Train the MLP of this width once (SGD, seeded) and cache its weights."""
    import torch

    from pipeline.checkpoint import save_safetensors
    from pipeline.data import load_source
    from pipeline.recipe import Recipe, fit, initial_model

    path = model_path(workdir, width, recipe)
    stamp = path.with_suffix(".json")
    if path.exists() and stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    train = load_source("digits")["train"]
    model, task, _ = initial_model("mlp", {"in_features": 64, "hidden": [width, width]}, seed=0)
    fit(model, task, train, Recipe(optimizer="sgd", **recipe))
    save_safetensors({k: v.detach() for k, v in model.state_dict().items()}, path)
    write_json(stamp, recipe)
    return path


def measure_point(payload: dict[str, Any]) -> dict[str, Any]:
    """Inside the fresh process: load, remove once, report time and memory."""
    import torch

    from bench.common import RssSampler, measure_removal, record_summary
    from pipeline.checkpoint import read_state_dict
    from pipeline.data import load_source
    from pipeline.methods import RemovalProblem, get_method
    from pipeline.models import build

    if payload.get("threads"):
        torch.set_num_threads(int(payload["threads"]))
    point = payload["point"]
    train = load_source("digits")["train"]
    model, task = build("mlp", {"in_features": 64, "hidden": [point["width"], point["width"]]})
    model.load_state_dict(read_state_dict(payload["model"]))
    model.eval()
    g = torch.Generator().manual_seed(1234)
    positions = torch.randperm(len(train), generator=g)[: point["removed"]]
    method = get_method("lfoci-newton")
    settings = method.Settings(**settings_for(point))
    problem = RemovalProblem(model, task, train, positions, TRAIN["weight_decay"], seed=0, batch_size=512)
    # warm-up: the first torch.func call of a process costs seconds (tracing / dispatch set-up); a
    # tiny removal on the same model pays it, so the timed removal is the steady-state cost
    warm = RemovalProblem(model, task, train, positions[:1], TRAIN["weight_decay"], seed=1, batch_size=512)
    t = time.perf_counter()
    method.run(warm, method.Settings(**WARMUP))
    warmup_seconds = time.perf_counter() - t
    model.load_state_dict(read_state_dict(payload["model"]))
    model.eval()
    rss_before = current_rss_bytes()
    # every axis runs the registered method; on the slices axis max_slices caps L-FOCI, which
    # stops earlier when no slice adds information (``slices_selected`` says how many it took)
    with RssSampler(interval=0.02) as sampler:
        res = measure_removal(problem, "lfoci-newton", settings, sampler=sampler)
    seconds = res["removal_seconds"]
    summary = {"stages": res["stage_seconds"], "stage_rss": res["stages"], "stage_source": res["stage_source"],
               **record_summary(res["record"]), "path": "pipeline.methods lfoci-newton (registry, stage hook)"}
    peak = peak_rss_bytes()
    return {
        "point": point, "seconds": seconds, "warmup_seconds": warmup_seconds,
        "in_process": bool(payload.get("in_process")), **summary,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rss_before_gib": gib(rss_before), "peak_rss_gib": gib(max(peak, sampler.peak)),
        "sampled_peak_gib": gib(sampler.peak), "removal_extra_gib": gib(sampler.peak - rss_before),
    }


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"slices": "max_slices (L-FOCI cap)", "perturbations": "perturbations m_p",
              "removed": "removed samples m", "width": "hidden width (2 layers)"}
    fig, axes = plt.subplots(2, len(results), figsize=(4.2 * len(results), 7), squeeze=False)
    for col, (axis, points) in enumerate(results.items()):
        ok = [p for p in points if "error" not in p]
        xs = [p["point"][axis] for p in ok]
        ax = axes[0][col]
        ax.plot(xs, [p["seconds"] for p in ok], "k-o", label="total")
        for stage in stages_of(ok):
            ax.plot(xs, [p["stages"].get(stage, 0.0) for p in ok], "--", marker=".", label=stage)
        for p, x in zip(ok, xs):
            if axis == "slices" and p["solver"] == "cg":
                ax.annotate("CG", (x, p["seconds"]), fontsize=7, textcoords="offset points", xytext=(2, 4))
        ax.set_xscale("log", base=2)
        if any(p["seconds"] > 0 for p in ok):  # every point failed: nothing to put on a log axis
            ax.set_yscale("log")
        ax.set_title(f"time vs {axis}")
        ax.set_xlabel(labels[axis])
        ax.set_ylabel("seconds")
        if col == 0:
            ax.legend(fontsize=7)
        ax = axes[1][col]
        ax.plot(xs, [p["peak_rss_gib"] for p in ok], "b-o", label="peak RSS (getrusage)")
        ax.plot(xs, [p["removal_extra_gib"] for p in ok], "r-s", label="sampled peak during the removal - RSS before")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(labels[axis])
        ax.set_ylabel("GiB")
        ax.set_title(f"memory vs {axis}")
        if axis == "slices":
            twin = ax.twinx()
            twin.plot(xs, [p["block_numel"] for p in ok], "g:^", label="block numel")
            if any(p["block_numel"] for p in ok):
                twin.set_yscale("log")
            twin.set_ylabel("block entries", color="g")
        if axis == "width":
            for p, x in zip(ok, xs):
                ax.annotate(f"{p['parameters'] / 1e3:.0f}k", (x, p["peak_rss_gib"]), fontsize=7,
                            textcoords="offset points", xytext=(2, 4))
        if col == 0:
            ax.legend(fontsize=7)
    fig.suptitle("One L-FOCI Newton removal (MLP on digits, one fresh process per point)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def slope(points: list[dict[str, Any]], axis: str, key: str = "seconds") -> float | None:
    """Log-log slope of ``key`` (a point's field, or ``stage:<name>``) against the axis between
    the first and the last point."""
    import math

    def value(p: dict[str, Any]) -> float | None:
        if key.startswith("stage:"):
            return (p.get("stages") or {}).get(key[6:])
        return p.get(key)

    ok = [p for p in points if "error" not in p and value(p)]
    if len(ok) < 2:
        return None
    a, b = ok[0], ok[-1]
    va, vb = value(a), value(b)
    if a["point"][axis] == b["point"][axis] or va <= 0 or vb <= 0:
        return None
    return math.log(vb / va) / math.log(b["point"][axis] / a["point"][axis])


def derived(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Slopes of the total, of each stage and of the memory; the dense/CG cost per block entry."""
    out: dict[str, Any] = {
        "loglog_slopes_seconds": {axis: slope(points, axis) for axis, points in results.items()},
        "loglog_slopes_by_stage": {axis: {stage: slope(points, axis, f"stage:{stage}") for stage in stages_of(points)}
                                   for axis, points in results.items()},
        "loglog_slopes_removal_memory": {axis: slope(points, axis, "removal_extra_gib") for axis, points in results.items()},
    }
    per_entry: dict[str, list[float]] = {"cholesky": [], "cg": []}
    for points in results.values():
        for p in points:
            if "error" not in p and p.get("block_numel") and p.get("solver") in per_entry:
                per_entry[p["solver"]].append(p["stages"]["curvature_and_solve"] / p["block_numel"])
    out["curvature_seconds_per_block_entry"] = {
        k: {"median": sorted(v)[len(v) // 2], "points": len(v)} if v else None for k, v in per_entry.items()}
    out["note"] = ("the dense path (block <= dense_max entries) materialises the block with one Hessian-vector "
                   "product per entry; CG needs one per iteration: compare curvature_and_solve across the slices axis")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)  # internal: one point, in a fresh process
    parser.add_argument("--axes", default=None, help="comma-separated subset of slices,perturbations,removed,width")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each point (default: torch's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per point")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every point in this process (no fresh process: peak RSS is then the process's "
                             "running peak, not the point's); --smoke does this for all points but the first")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench" / "growth")
    parser.add_argument("--replot", type=Path, default=None,
                        help="recompute the derived figures and the plot of an existing growth JSON (no measuring)")
    args = parser.parse_args(argv)

    if args.replot is not None:
        old = json.loads(args.replot.read_text())
        png = args.replot.with_suffix(".png")
        plot(old["results"], png)
        old.update(derived(old["results"]))
        write_json(args.replot, old)
        print(f"rewrote {args.replot} and {png}", flush=True)
        return old

    if args.point is not None:
        print("POINT " + json.dumps(measure_point(json.loads(args.point))), flush=True)
        return {}

    mode_name = "smoke" if args.smoke else "quick" if args.quick else "default"
    axes = AXES[mode_name]
    if args.axes:
        axes = {k: v for k, v in axes.items() if k in args.axes.split(",")}
    base = SMOKE_BASE if mode_name == "smoke" else BASE
    recipe = TRAIN_SMOKE if mode_name == "smoke" else TRAIN
    out_path = args.out or RESULTS_DIR / ("growth.json" if mode_name == "default" else f"growth_{mode_name}.json")
    started = time.perf_counter()
    machine_before = machine_info()
    args.workdir.mkdir(parents=True, exist_ok=True)

    from pipeline.progress import bar

    results: dict[str, list[dict[str, Any]]] = {}
    points_bar = bar(sum(len(v) for v in axes.values()), "growth points", unit="point", leave=True)
    for axis, values in axes.items():
        results[axis] = []
        for value in values:
            points_bar.set_postfix_str(f"{axis}={value}", refresh=True)
            point = {**base, axis: value}
            path = ensure_model(args.workdir, point["width"], recipe)
            payload = {"point": point, "axis": axis, "model": str(path), "threads": args.threads}
            first = not any(results.values()) and not results[axis]
            if args.in_process or (mode_name == "smoke" and not first):
                try:
                    res = measure_point({**payload, "in_process": True})
                except Exception as err:  # recorded like a failed subprocess point
                    res = {"error": f"{type(err).__name__}: {err}"}
            else:
                res = run_point("bench.bench_growth", payload, timeout=args.timeout)
            res.setdefault("point", point)
            res["loadavg"] = machine_info()["loadavg"]
            results[axis].append(res)
            points_bar.update(1)
            if "error" in res:
                print(f"  {axis}={value}: FAILED {res['error'][-300:]}", file=sys.stderr, flush=True)
        print_table([{axis: r["point"][axis], **{k: r.get(k) for k in ("seconds", "slices_selected", "block_numel",
                      "solver", "solver_iterations", "peak_rss_gib", "removal_extra_gib")},
                      **{s: (r.get("stages") or {}).get(s) for s in stages_of(results[axis])}} for r in results[axis]],
                    [axis, "seconds", *stages_of(results[axis]), "slices_selected", "block_numel", "solver", "solver_iterations",
                     "peak_rss_gib", "removal_extra_gib"], title=f"\n== growth vs {axis}")

    points_bar.close()
    png = out_path.with_suffix(".png")
    plot(results, png)
    result = {
        "benchmark": "growth", "mode": mode_name, "base_point": base, "axes": axes,
        "threads_per_point": args.threads or "torch default",
        "in_process": bool(args.in_process) or (mode_name == "smoke" and "all points but the first"),
        "setup": {"model": "mlp preset, tanh, hidden [width, width], digits (64 features, 10 classes)",
                  "training": recipe, "n": 1437, "settings": settings_for(base),
                  "memory": "getrusage peak RSS of a fresh process per point; removal_extra = peak - RSS before the removal"},
        "results": results,
        **derived(results),
        "plot": str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png),
        "machine": {**machine_before, "loadavg_after": machine_info()["loadavg"]},
        "wall_seconds": time.perf_counter() - started,
    }
    write_json(out_path, result)
    print(f"\nwrote {out_path} and {png} in {result['wall_seconds']:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
