"""How the probe and the curvature stages scale with Ray workers.

    .venv/bin/python -m bench.bench_scaling [--perturbations 1024] [--repeats 3] [--workers 1 2]

Model: the small-cnn preset (two 3x3 conv layers + two Linear, 106k parameters) on the
digits upsampled to 28x28 (1,437 training images), float32, random weights (timing only).
  probe:     P perturbed passes of an 8-sample forget batch, pass_size 32 (256 images a pass),
             sharded over W workers (one shard per worker).
  curvature: Hessian-vector products of the mean training loss restricted to 16 rows of the
             1568-wide Linear layer (25,104 coordinates, the size of one VGG-16 fc6 row slice),
             over 1,437 samples in batches of 256, sharded over the same workers.
Each worker takes one CPU (one torch thread); the in-process baseline runs with one thread too.
``probe_cpu_share_per_worker`` = CPU seconds the workers got / (wall seconds x workers): 1.0 on
an idle machine; on a shared one it shows how much of a core each worker actually had.
Writes bench/results/scaling.json atomically (temporary name, fsync, rename) and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.common import write_json
from pipeline.progress import Steps
from pipeline.tasks import PerturbOptions

RESULTS = Path(__file__).resolve().parent / "results" / "scaling.json"
PRESET, OPTIONS = "small-cnn", {"image_size": 28, "in_channels": 1}
DATA_OPTIONS = {"image_size": 28}
FORGET_SIZE, PASS_SIZE, BATCH = 8, 32, 256
BLOCK_ROWS = {"7.weight": list(range(16)), "7.bias": list(range(16))}


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def summary(times: list[float]) -> dict[str, Any]:
    return {"runs_s": [round(t, 4) for t in times], "median_s": round(statistics.median(times), 4),
            "min_s": round(min(times), 4)}


def write_model_dir(directory: Path) -> Path:
    from pipeline.data import load_source
    from pipeline.models.card import DataRef, ModelCard, TrainingRecord, write_model_dir as write
    from pipeline.models.registry import build

    torch.manual_seed(0)
    model, _ = build(PRESET, OPTIONS)
    n = len(load_source("digits", DATA_OPTIONS)["train"])
    card = ModelCard(preset=PRESET, options=OPTIONS, data=DataRef(source="digits", options=DATA_OPTIONS),
                     training=TrainingRecord(weight_decay=5e-4, n=n, optimizer="none"))
    write(directory, model.state_dict(), card)
    return directory


def in_process(model_dir: Path, perturbations: int, repeats: int) -> dict[str, Any]:
    from pipeline.curvature import BlockHessian
    from pipeline.data import load_source
    from pipeline.models.card import load_model_dir
    from pipeline.param_block import ParamBlock
    from pipeline.probe import run_probe

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, task, _ = load_model_dir(model_dir)
        data = load_source("digits", DATA_OPTIONS)["train"]
        forget = data.take(torch.arange(FORGET_SIZE)).columns
        probe = timed(lambda: run_probe(model, task, forget, seed=0, start=0, stop=perturbations,
                                        pass_size=PASS_SIZE, perturb_options=PerturbOptions(perturb_sigma=0.1)), repeats)
        block = ParamBlock.from_rows(model, BLOCK_ROWS)
        op = BlockHessian(model, task, data, block, 5e-4, reduction="mean", batch_size=BATCH)
        v = torch.randn(block.numel, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        op.matvec(v)  # warm-up
        hvp = timed(lambda: op.matvec(v), repeats)
    finally:
        torch.set_num_threads(threads)
    return {"probe": summary(probe), "hvp": summary(hvp), "block_numel": block.numel}


def on_ray(model_dir: Path, workers: int, perturbations: int, repeats: int, runtime: Any,
           resources: dict[str, float] | None = None) -> dict[str, Any]:
    from cluster.curvature_pool import RayCurvatureFactory
    from cluster.pool import WorkerPool
    from cluster.probe_pool import RayProbeRunner
    from pipeline.data import load_source
    from pipeline.models.card import load_model_dir
    from pipeline.param_block import ParamBlock

    model, task, _ = load_model_dir(model_dir)
    data = load_source("digits", DATA_OPTIONS)["train"]
    forget = data.take(torch.arange(FORGET_SIZE)).columns
    t = time.perf_counter()
    with WorkerPool(model_dir, workers=workers, runtime=runtime, resources=resources) as pool:
        startup = time.perf_counter() - t
        runner = RayProbeRunner(pool)
        run = lambda: runner(model, task, forget, seed=0, perturbations=perturbations,  # noqa: E731
                             pass_size=PASS_SIZE, perturb_options=PerturbOptions(perturb_sigma=0.1))
        run()  # warm-up (first pass in each worker)
        cpu0 = workers_cpu_seconds(pool)
        probe = timed(run, repeats)
        probe_cpu = workers_cpu_seconds(pool) - cpu0
        block = ParamBlock.from_rows(model, BLOCK_ROWS)
        factory = RayCurvatureFactory(pool)
        op = factory(model, task, data, block, 5e-4, reduction="mean", batch_size=BATCH)
        v = torch.randn(block.numel, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        t = time.perf_counter()
        op.matvec(v)  # ships the data shards, builds the per-batch operators, warms up
        first = time.perf_counter() - t
        hvp = timed(lambda: op.matvec(v), repeats)
        factory.close()
    share = probe_cpu / (sum(probe) * workers) if probe_cpu > 0 else None
    return {"workers": workers, "pool_startup_s": round(startup, 3), "probe": summary(probe),
            "probe_worker_cpu_s": round(probe_cpu, 3),
            "probe_cpu_share_per_worker": None if share is None else round(share, 3),
            "hvp": summary(hvp), "hvp_first_call_s": round(first, 3), "devices": sorted({d["device"] for d in pool.describe})}


def workers_cpu_seconds(pool: Any) -> float:
    """User + system CPU seconds used so far by the pool's worker processes (same host)."""
    import psutil

    total = 0.0
    for d in pool.describe:
        try:
            t = psutil.Process(d["pid"]).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares T(N) = a / N + b over the measured worker counts (exact through two
    points): a = parallel work, b = fixed (serial) cost."""
    xs = [1.0 / n for n in points]
    ys = list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return a, my - a * mx


SCALING_MODEL = """\
Scaling model (N GPU workers, one model copy per worker, driver on CPU):
  probe(N)     = ceil(P / (N * ps)) * t_pass + t_fixed + N * t_dispatch
      t_pass: one forward pass of ps perturbations of the forget batch on one worker;
      t_fixed: serial driver work (put the forget batch once, gather P x S float32 rows,
      one ray round trip); t_dispatch: per-shard scheduling (~ms). Shards are whole passes,
      so N beyond P / ps adds nothing; the L-FOCI selection that follows is serial on the
      driver (O(k P log P) per pick) and bounds the stage (Amdahl).
  curvature(N) = k * (ceil(n / (N * bs)) * t_hvp_batch + t_round_trip + t_reduce(N))
      + t_solve,   k = CG iterations (or d / 256 matmat chunks for the dense path),
      t_hvp_batch: one batch's Hessian-vector product on one worker; t_round_trip: one fan-out
      and gather of a d-vector (d*8 bytes each way per worker); t_reduce: the driver adds
      n / bs per-batch vectors (exact order) or N shard sums, O(d) each; t_solve: the block
      solve on the driver CPU (Cholesky O(d^3) for d <= dense_max, else k CG vector updates).
  Fitted here: T(N) = a / N + b from the 1- and 2-worker medians (a = parallel part,
  b = fixed part); speed-up(N) = (a + b) / (a / N + b). On GPUs t_pass and t_hvp_batch
  shrink by the device's throughput ratio while b (driver, network) does not, so the
  serial fraction b / (a + b) measured on the GPU type in use is what limits N.
  Model loading is paid once per worker (pool start-up), not per shard or per product."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="probe / curvature scaling with Ray workers")
    parser.add_argument("--perturbations", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--device", choices=["cpu", "auto"], default="cpu",
                        help="cpu: one CPU per worker even where GPUs exist; auto: one GPU per worker if any")
    args = parser.parse_args(argv)
    resources = {"num_cpus": 1, "num_gpus": 0} if args.device == "cpu" else None

    from cluster.runtime import connect, machine_cpus

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ubs-", dir="/tmp") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model")
        with Steps(1 + len(args.workers), "scaling", unit="setup") as steps:
            with steps.step("in process, 1 thread"):
                baseline = in_process(model_dir, args.perturbations, args.repeats)
            runtime = connect(num_cpus=machine_cpus(), object_store_memory=512 * 2**20,
                              temp_dir=Path(tmp) / "ray", log_to_driver=False)
            try:
                runs = []
                for w in args.workers:
                    with steps.step(f"Ray, {w} worker(s)"):
                        runs.append(on_ray(model_dir, w, args.perturbations, args.repeats, runtime, resources))
            finally:
                runtime.close()
    by_workers = {r["workers"]: r for r in runs}
    result: dict[str, Any] = {
        "benchmark": "bench_scaling",
        "machine": {"cpus": machine_cpus(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()],
                    "note": "a load average above the CPU count means other processes competed for the cores "
                            "(see probe_cpu_share_per_worker)"},
        "setup": {"model": PRESET, "options": OPTIONS, "parameters": 105866, "forget_samples": FORGET_SIZE,
                  "perturbations": args.perturbations, "pass_size": PASS_SIZE, "curvature_samples": 1437,
                  "curvature_batch": BATCH, "block_numel": baseline["block_numel"], "repeats": args.repeats},
        "in_process_1_thread": baseline,
        "ray": runs,
        "scaling_model": SCALING_MODEL,
    }
    if 1 in by_workers and len(by_workers) >= 2:
        fits = {}
        for stage in ("probe", "hvp"):
            medians = {w: r[stage]["median_s"] for w, r in by_workers.items()}
            a, b = fit(medians)
            fits[stage] = {
                "speedup_vs_1_worker": {str(w): round(medians[1] / t, 3) for w, t in medians.items()},
                "parallel_part_s": round(a, 4), "fixed_part_s": round(b, 4),
                "serial_fraction": round(b / (a + b), 4) if a + b > 0 else None,
                "predicted_speedup": {str(n): round((a + b) / (a / n + b), 2) if a > 0 and a / n + b > 0 else None
                                      for n in (4, 8, 16, 32)},
            }
        result["fit"] = fits
        if 2 in by_workers:
            ratio = by_workers[1]["probe"]["median_s"] / by_workers[2]["probe"]["median_s"]
            result["goal_probe_speedup_1_6x_met"] = ratio >= 1.6
    write_json(args.output, result)
    print(json.dumps({k: result[k] for k in ("in_process_1_thread", "ray", "fit") if k in result}, indent=2))
    return result


if __name__ == "__main__":
    main()
