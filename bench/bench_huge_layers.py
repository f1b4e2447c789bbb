"""Benchmark: one L-FOCI Newton removal on a VGG-16-size model (138M parameters) on the CPU,
the registered ``lfoci-newton`` method solved matrix-free (CG).

    .venv/bin/python -m bench.bench_huge_layers --threads 1          # VGG-16 (D), 1000 classes, 138.4M params (~1 min)
    .venv/bin/python -m bench.bench_huge_layers --quick --threads 1  # same model, fewer perturbations / CG steps
    .venv/bin/python -m bench.bench_huge_layers --smoke --threads 1  # width/16, fc 256: seconds (tests)

Cost: an fc6-row block makes every product touch the whole 25088x4096 matrix (the block is
inserted with ``index_add`` into a full copy, and the backward forms the full weight's gradient),
and an L-FOCI pick in an early conv layer makes every product a double backward through most of
the network: 4-30 s per CG iteration on the shared 2-core machine (1 vs 2 torch threads, measured
with the earlier 32-sample curvature subsample), hence n = 100. The default and quick profiles
have not been re-measured since the method solves to its tolerance (see ``PROFILES``).

Model: the ``vggface`` preset with ``num_classes: 1000`` (torchvision's VGG-16 layout and
initialisation, random weights: the cost does not depend on the values), 32x32 RGB inputs;
the adaptive average pool to 7x7 keeps fc6 = ``classifier.0`` = Linear(25088, 4096), so an
fc6 row has 25,088 weights + 1 bias = 25,089 parameters. Data: Fashion-MNIST upscaled to
32x32 and repeated to 3 channels (labels 0..9 of the 1000-way head), ``n`` training samples,
``m`` forgotten.

Stages: the method's own (``RemovalProblem.stage_hook``, or its record's ``timings`` where it
reports none there; ``bench.common.measure_removal``), each with the RSS before / peak / after
from a 20 ms sampler, plus the process's getrusage peak. The curvature is H' = (n H_P(S) -
H_P(U)) / (n - m) + damping I with H_P(S) on a seeded subsample of ``curvature_samples``
training samples (``None``: all of them); exact Hessian-vector products, never a dense block
(``dense_max`` 1); CG to ``cg_rtol`` with Levenberg-Marquardt damping added by the method where
the restricted Hessian is indefinite (random weights). The block is what the method chooses:
L-FOCI's slices, the output layer and slices added by forget-gradient norm; ``block.fc6_rows`` /
``block.fc6_parts`` list the rows of fc6 among them (an fc6 row has 25,089 parameters: every
product then touches the whole 25088x4096 matrix).

Writes bench/results/huge_layers.json (quick: huge_layers_quick.json, smoke: huge_layers_smoke.json).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import (RESULTS_DIR, RssSampler, gib, machine_info, peak_rss_bytes, print_table,  # noqa: E402
                          set_threads, write_json)

# lfoci-newton refuses (RemovalNotServed) a Newton system not solved to cg_rtol and a step that
# removes less than half of the retained block gradient. So: CG runs to cg_rtol (cg_max_iter is a
# safety cap, not a truncation); damping 0 lets the method add the Levenberg-Marquardt damping the
# indefinite restricted Hessian of random weights needs (smoke, measured: 0.09-0.44 added, 16-19
# CG iterations per step to 2e-7); the curvature is on every training sample (None): with the
# 8-sample subsample of the old profiles, its Hessian disagreed with the retained gradient's data and
# the smoke step removed only 16-24 % of that gradient (refused).
PROFILES: dict[str, dict[str, Any]] = {
    "default": {"model": {"num_classes": 1000, "width_divisor": 1, "hidden": 4096, "pool_size": 7, "image_size": 32},
                "per_class": 10, "forget": 2, "perturbations": 128, "pass_size": 16, "max_slices": 8,
                "curvature_samples": None, "cg_max_iter": 300, "cg_rtol": 1e-6, "damping": 0.0, "batch_size": 16},
    "quick": {"model": {"num_classes": 1000, "width_divisor": 1, "hidden": 4096, "pool_size": 7, "image_size": 32},
              "per_class": 3, "forget": 2, "perturbations": 64, "pass_size": 16, "max_slices": 4,
              "curvature_samples": None, "cg_max_iter": 300, "cg_rtol": 1e-6, "damping": 0.0, "batch_size": 16},
    "smoke": {"model": {"num_classes": 10, "width_divisor": 16, "hidden": 256, "pool_size": 7, "image_size": 32},
              "per_class": 2, "forget": 2, "perturbations": 16, "pass_size": 16, "max_slices": 2,
              "curvature_samples": None, "cg_max_iter": 300, "cg_rtol": 1e-6, "damping": 0.0, "batch_size": 16},
}
FC6_WEIGHT, FC6_BIAS = "classifier.0.weight", "classifier.0.bias"
WEIGHT_DECAY = 5e-4


def load_data(profile: dict[str, Any]):
    from pipeline.data import load_source

    size = profile["model"]["image_size"]
    return load_source("fashion-mnist", {"per_class": profile["per_class"], "test_per_class": 1, "seed": 0,
                                         "image_size": size, "channels": 3})["train"]


def fc6_rows_in_block(selection: dict[str, Any]) -> list[int]:
    """The fc6 units (rows) in the block, from the method's selection record: L-FOCI's picks plus
    the slices added by forget-gradient norm (each entry names its weight and unit)."""
    picked = [*(selection.get("selected") or []), *(selection.get("added_by_forget_gradient") or [])]
    if not isinstance(selection.get("selected"), list):
        picked = list(selection.get("added_by_forget_gradient") or [])
    return sorted({int(p["unit"]) for p in picked if isinstance(p, dict) and p.get("weight") == FC6_WEIGHT})


def run(profile: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    from bench.common import measure_removal, record_summary
    from pipeline.methods import RemovalProblem
    from pipeline.models import build

    with RssSampler(interval=0.02) as rss:
        with rss.stage("build_model"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model, task = build("vggface", dict(profile["model"]))
            model.eval()
        with rss.stage("load_data"):
            train = load_data(profile)
        params = dict(model.named_parameters())
        forget_pos = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[: profile["forget"]].sort().values
        problem = RemovalProblem(model, task, train, forget_pos, WEIGHT_DECAY, seed=seed, batch_size=profile["batch_size"])
        settings = {"perturbations": profile["perturbations"], "pass_size": profile["pass_size"],
                    "max_slices": profile["max_slices"], "curvature_samples": profile["curvature_samples"],
                    "damping": profile["damping"], "dense_max": 1, "cg_rtol": profile["cg_rtol"],
                    "cg_max_iter": profile["cg_max_iter"]}
        res = measure_removal(problem, "lfoci-newton", settings, sampler=rss)
    record = res.pop("record")
    res.pop("new_parameters")
    summary = record_summary(record)
    fc6_rows = fc6_rows_in_block(record.get("selection") or {})
    fc6_parts = [{"parameter": FC6_WEIGHT, "rows": fc6_rows, "numel": len(fc6_rows) * int(params[FC6_WEIGHT].shape[1])},
                 {"parameter": FC6_BIAS, "rows": fc6_rows, "numel": len(fc6_rows)}] if fc6_rows else []
    res.update({
        "n": len(train), "m": int(forget_pos.numel()), "settings": settings, "method_record": record,
        "block": {"numel": summary["block_numel"], "fc6_rows": fc6_rows, "fc6_parts": fc6_parts},
        "selection": record.get("selection"),
        "solver": {**((record.get("curvature") or {}).get("solver") or {}), "cg_max_iter": profile["cg_max_iter"],
                   "damping": profile["damping"]},
    })
    res["model"] = {
        "preset": "vggface", "options": profile["model"], "parameters": sum(p.numel() for p in params.values()),
        "fc6": {"name": "classifier.0", "weight_shape": list(params[FC6_WEIGHT].shape),
                "row_parameters": int(params[FC6_WEIGHT].shape[1]) + 1},
    }
    out_module = (record.get("selection") or {}).get("output_layer")
    if out_module:  # the method adds the whole output layer to the block (include_output_layer)
        res["model"]["output_layer"] = out_module
        res["model"]["output_layer_numel"] = sum(v.numel() for k, v in params.items() if k.rsplit(".", 1)[0] == out_module)
    res["setup_stages"] = {k: rss.stages[k] for k in ("build_model", "load_data")}
    res["solver"]["note"] = ("every Newton system solved by CG to cg_rtol (the method refuses one that is not); "
                             "cg_max_iter is a safety cap; damping_added = Levenberg-Marquardt damping for indefinite "
                             "curvature")
    res["peak_rss_gib"] = gib(peak_rss_bytes())
    res["sampled_peak_rss_gib"] = gib(rss.peak)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    parser.add_argument("--cg-max-iter", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    mode_name = "smoke" if args.smoke else "quick" if args.quick else "default"
    profile = {**PROFILES[mode_name], "model": dict(PROFILES[mode_name]["model"])}
    if args.cg_max_iter:
        profile["cg_max_iter"] = args.cg_max_iter
    set_threads(args.threads)
    out_path = args.out or RESULTS_DIR / ("huge_layers.json" if mode_name == "default" else f"huge_layers_{mode_name}.json")
    machine_before = machine_info()
    started = time.perf_counter()
    res = run(profile)
    mem_total = machine_before.get("mem_total_gib")
    result = {
        "benchmark": "huge_layers", "mode": mode_name, "profile": profile, **res,
        "within_memory": {"limit_gib": 24, "peak_rss_gib": res["peak_rss_gib"],
                          "ok": res["peak_rss_gib"] is not None and res["peak_rss_gib"] < 24,
                          "machine_mem_total_gib": mem_total},
        "machine": {**machine_before, "loadavg_after": machine_info()["loadavg"]},
        "wall_seconds": time.perf_counter() - started,
    }
    write_json(out_path, result)
    print_table([{"stage": k, **v} for k, v in {**res["setup_stages"], **res["stages"]}.items()],
                ["stage", "seconds", "rss_before_gib", "rss_peak_gib", "rss_after_gib"],
                title=f"\n== VGG-16 removal: {res['model']['parameters'] / 1e6:.1f}M parameters, block "
                      f"{res['block']['numel']:,} entries ({len(res['block']['fc6_parts'])} fc6 parameter parts)")
    s = res["solver"]
    print(f"solver {s.get('solver')}: {s.get('iterations')} iterations (cap {s['cg_max_iter']}, damping {s['damping']}), "
          f"relative residual {s.get('relative_residual')}; peak RSS {res['peak_rss_gib']:.2f} GiB; "
          f"removal {res['removal_seconds']:.1f} s", flush=True)
    print(f"wrote {out_path} in {result['wall_seconds']:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
