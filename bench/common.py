"""Helpers shared by the benchmark scripts: atomic JSON, machine description, timers, memory.

Memory. ``tracemalloc`` does not see torch's allocations, so peak memory is measured as the
process's resident set size (RSS):
  * ``peak_rss_bytes()`` - ``resource.getrusage(RUSAGE_SELF).ru_maxrss``: the peak RSS of this
    process since it started (Linux reports KiB). Meaningful per measurement only in a fresh
    process: ``run_point`` runs a function in a fresh interpreter for that reason.
  * ``RssSampler`` - a thread sampling the current RSS (``/proc/self/statm``) every
    ``interval`` seconds; ``stage(name)`` records the peak seen while a stage runs, so a
    single process can attribute its peak to stages (probe, curvature, solve...). Sampling
    can miss a spike shorter than the interval; the getrusage peak cannot.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# -- JSON --------------------------------------------------------------------------------------
def jsonable(obj: Any) -> Any:
    """Plain JSON types: tensors -> lists, numpy scalars -> numbers, non-finite floats -> None."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):  # tensors, numpy arrays/scalars
        return jsonable(obj.tolist())
    return obj


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON: temporary name in the same folder, fsync, rename (0644)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from pipeline.checkpoint import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(jsonable(obj), indent=2, allow_nan=False).encode())
    return path


# -- the machine ---------------------------------------------------------------------------------
def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU count, load average, memory, versions and GPU (if any) of this run."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg": loadavg(),
        "cuda": torch.cuda.is_available(),
    }
    try:
        with open("/proc/meminfo") as fh:
            mem = dict(line.split(":", 1) for line in fh)
        info["mem_total_gib"] = round(int(mem["MemTotal"].split()[0]) / 2**20, 1)
        info["mem_available_gib"] = round(int(mem["MemAvailable"].split()[0]) / 2**20, 1)
    except (OSError, KeyError, ValueError):
        pass
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    if info["loadavg"] and info["cpus"] and info["loadavg"][0] > info["cpus"]:
        info["note"] = (f"machine loaded: 1-min load average {info['loadavg'][0]} on {info['cpus']} cores "
                        "(shared with other work); wall times are pessimistic and noisy")
    return info


def set_threads(threads: int | None) -> int:
    import torch

    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


# -- time -------------------------------------------------------------------------------------------
class Timer:
    """``with timer("stage"):`` accumulates wall seconds per stage into ``timer.seconds``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


# -- memory -------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """Peak RSS of this process since it started (getrusage; Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def gib(n: float | int | None) -> float | None:
    return None if n is None else round(float(n) / 2**30, 3)


class RssSampler:
    """Background RSS sampling with per-stage peaks (see the module docstring)."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak = current_rss_bytes()
        self._stage_peak: int = 0
        self.stages: dict[str, dict[str, float | None]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        rss = current_rss_bytes()
        with self._lock:
            self.peak = max(self.peak, rss)
            self._stage_peak = max(self._stage_peak, rss)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        before = current_rss_bytes()
        with self._lock:
            self._stage_peak = before
        t = time.perf_counter()
        try:
            yield
        finally:
            self._sample()
            with self._lock:
                peak = self._stage_peak
            self.stages[name] = {"seconds": round(time.perf_counter() - t, 4), "rss_before_gib": gib(before),
                                 "rss_peak_gib": gib(peak), "rss_after_gib": gib(current_rss_bytes())}


def run_point(module: str, payload: dict[str, Any], *, timeout: float | None = None,
              threads: int | None = None) -> dict[str, Any]:
    """Run ``python -m <module> --point '<json>'`` in a fresh interpreter; it must print one JSON
    line prefixed ``POINT `` (its result, including its own getrusage peak). Errors come back as
    ``{"error": ...}``, never raised, so one failing point does not lose the others."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", module, "--point", json.dumps(payload)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "wall_seconds": time.perf_counter() - started}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("POINT "):
            out = json.loads(line[len("POINT "):])
            out["process_wall_seconds"] = round(time.perf_counter() - started, 3)
            return out
    tail = (proc.stderr or proc.stdout)[-1500:]
    return {"error": f"exit code {proc.returncode}: {tail}", "wall_seconds": time.perf_counter() - started}


def print_table(rows: list[dict[str, Any]], columns: list[str], title: str | None = None) -> str:
    """A fixed-width text table; numbers to 3 significant decimals."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return "-" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ([title] if title else []) + ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
                                          "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


# -- running the pipeline's maths on a machine with only torch ------------------------------------
def _bare_package(name: str) -> None:
    """Register package ``name`` (a folder of the repo) without executing its ``__init__``."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(ROOT / name.replace(".", "/"))]
    sys.modules[name] = module


def light_pipeline_imports() -> list[str]:
    """Make ``pipeline``'s maths modules importable where only torch is installed (a bare GPU
    machine). ``pipeline.data`` and ``pipeline.models`` register every source / preset in their
    ``__init__``, which pulls pydantic (configs) and datasets; when pydantic is missing they are
    registered as bare packages so that e.g. ``pipeline.data.sampleset`` and
    ``pipeline.models.reid_resnet50`` import alone. When safetensors is missing a stub stands in
    (checkpoint reading is then unavailable; nothing here reads checkpoints). Returns notes on
    what was bypassed (empty in the project's own environment)."""
    import types

    notes: list[str] = []
    try:
        import pydantic  # noqa: F401
    except ImportError:
        for pkg in ("pipeline.data", "pipeline.models"):
            if pkg not in sys.modules:
                _bare_package(pkg)
                notes.append(f"{pkg}: imported without its __init__ (pydantic is not installed)")
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        def _missing(*_: Any, **__: Any) -> Any:
            raise ImportError("safetensors is not installed")

        top, sub = types.ModuleType("safetensors"), types.ModuleType("safetensors.torch")
        sub.load_file = sub.save_file = _missing  # type: ignore[attr-defined]
        top.torch = sub  # type: ignore[attr-defined]
        sys.modules.setdefault("safetensors", top)
        sys.modules.setdefault("safetensors.torch", sub)
        notes.append("safetensors: stubbed (not installed; checkpoints are not read here)")
    return notes


def staged_lfoci_newton(
    model: Any, task: Any, train: Any, forget_positions: Any, *, weight_decay: float, perturbations: int,
    pass_size: int, max_slices: int | None, sigma: float = 0.1, curvature_samples: int | None = None,
    damping: float = 0.0, dense_max: int = 0, cg_rtol: float = 1e-8, cg_max_iter: int | None = None,
    batch_size: int = 256, seed: int = 0, select_device: str = "cpu", extra_rows: Any = None,
    pad_to: int | None = None, sampler: "RssSampler | None" = None, sync: Any = None,
) -> dict[str, Any]:
    """One L-FOCI Newton removal, the computation of ``pipeline.methods.lfoci_newton`` (without
    the noise, epsilon = inf) with every stage timed and its memory sampled:
    probe -> select -> block (+ ``extra_rows(probe, slice_map) -> {param: rows}``) -> gradients
    -> curvature_and_solve (dense Cholesky when the block has <= ``dense_max`` entries, else CG)
    -> update -> verify (retain gradient on the block after the update).
    ``pad_to``: when L-FOCI stops (best T <= 0) before ``pad_to`` slices, the block is filled up
    to ``pad_to`` slices with the remaining slices of highest marginal L-CODEC score T(Y, Z_j)
    (a block of a chosen size, for growth measurements; recorded as ``padded``).
    Products run where the model lives; probe columns, vectors and solves are on the CPU."""
    import torch

    from pipeline.curvature import BlockHessian, Combination, block_gradient, conjugate_gradient, solve_dense
    from pipeline.param_block import ParamBlock
    from pipeline.probe import SliceMap, run_probe
    from pipeline.selection import lfoci

    own = sampler is None
    sampler = sampler or RssSampler(interval=0.02)
    if own:
        sampler.__enter__()
    sync = sync or (lambda: None)

    def stage(name: str):
        @contextlib.contextmanager
        def run() -> Iterator[None]:
            with sampler.stage(name):
                yield
                sync()
        return run()

    model.eval()
    n = len(train)
    pos = torch.as_tensor(forget_positions, dtype=torch.long)
    m = int(pos.numel())
    forget, retain = train.take(pos), train.without(pos)
    try:
        with stage("probe"):
            slice_map = SliceMap(model)
            probe = run_probe(model, task, forget.columns, seed=seed, start=0, stop=perturbations, pass_size=pass_size,
                              perturb_options={"sigma": sigma}, slice_map=slice_map)
        with stage("select"):
            gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + 1)
            y, z = probe.losses, probe.activations.double()
            if select_device != "cpu":
                y, z = y.to(select_device), z.to(select_device)
            result = lfoci(y, z, max_picks=max_slices, generator=gen)
            picks = [int(i) for i in result.picks]
            padded: list[int] = []
            if pad_to is not None and len(picks) < pad_to:
                from pipeline.selection import codec_scores

                marginal = codec_scores(y, z, generator=torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + 5))
                taken = set(picks)
                for j in torch.argsort(marginal.cpu(), descending=True).tolist():
                    if len(picks) + len(padded) >= pad_to:
                        break
                    if j not in taken:
                        padded.append(int(j))
        with stage("block"):
            rows = {k: list(v) for k, v in slice_map.rows_for(picks + padded).items()}
            forced: dict[str, list[int]] = extra_rows(probe, slice_map) if extra_rows else {}
            for name, extra in forced.items():
                rows[name] = sorted(set(rows.get(name, [])) | set(int(i) for i in extra))
            block = ParamBlock.from_rows(model, rows)
        with stage("gradients"):
            g_forget = block_gradient(model, task, forget, block, weight_decay, reduction="sum", batch_size=batch_size)
            g_retain_before = block_gradient(model, task, retain, block, weight_decay, reduction="mean", batch_size=batch_size)
        with stage("curvature_and_solve"):
            curv = train
            if curvature_samples is not None and curvature_samples < n:
                pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + 2))
                curv = train.take(pick[:curvature_samples].sort().values)
            h_train = BlockHessian(model, task, curv, block, weight_decay, reduction="mean", batch_size=batch_size)
            h_forget = BlockHessian(model, task, forget, block, weight_decay, reduction="sum", batch_size=batch_size)
            h_new = Combination([(n / (n - m), h_train), (-1.0 / (n - m), h_forget)], damping=damping)
            t = time.perf_counter()
            if block.numel <= dense_max:
                direction, info = solve_dense(h_new.to_dense(), g_forget)
            else:
                direction, info = conjugate_gradient(h_new, g_forget, rtol=cg_rtol, max_iter=cg_max_iter)
            solve_seconds = time.perf_counter() - t
        with stage("update"):
            step = direction / (n - m)
            block.add_to_model(model, step)
        with stage("verify"):
            g_retain_after = block_gradient(model, task, retain, block, weight_decay, reduction="mean", batch_size=batch_size)
    finally:
        if own:
            sampler.__exit__(None, None, None)
    norm = lambda t: float(torch.linalg.vector_norm(t))  # noqa: E731
    timed = ("probe", "select", "block", "gradients", "curvature_and_solve", "update", "verify")
    return {
        "n": n, "m": m, "curvature_samples": len(curv),
        "selection": {"slices_probed": slice_map.size, "perturbations": int(probe.losses.shape[0]),
                      "select_device": select_device,
                      "lfoci_selected": [{**slice_map.describe(i), "T": float(s)} for i, s in zip(picks, result.scores)],
                      "forced_rows": forced, "padded": padded, "slices_in_block": len(picks) + len(padded)},
        "block": {"numel": block.numel, "parts": block.describe() if block.numel < 200_000 else len(block.parts),
                  "dense_would_be_gib": block.numel ** 2 * 8 / 2**30},
        "solver": {**info.__dict__, "cg_max_iter": cg_max_iter, "cg_rtol": cg_rtol, "damping": damping,
                   "dense_max": dense_max, "solve_seconds": solve_seconds,
                   "seconds_per_iteration": solve_seconds / info.iterations if info.iterations else None,
                   "hessian_vector_products": {"train": h_train.products, "forget": h_forget.products}},
        "gradient_norms": {"forget_sum_block": norm(g_forget), "retain_mean_block_before": norm(g_retain_before),
                           "retain_mean_block_after": norm(g_retain_after)},
        "step_norm": norm(step),
        "stages": {k: sampler.stages[k] for k in timed},
        "stage_seconds": {k: sampler.stages[k]["seconds"] for k in timed},
        "removal_seconds": sum(sampler.stages[k]["seconds"] for k in timed),
    }
