"""Helpers shared by the benchmark scripts: JSON (``write_json``, the one writer: strict JSON,
atomic), machine description, timers, memory, and ``measure_removal``: a registered method run
with a ``StageRecorder`` as its ``RemovalProblem.stage_hook`` (the real methods, timed per stage
under their own stage names; no re-implementation here).

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


# -- JSON: every bench script writes its results through ``write_json`` (strict JSON, atomic) --
from pipeline.jsonio import jsonable, write_json  # noqa: E402,F401  (the project's one JSON writer)


# -- the machine ---------------------------------------------------------------------------------
def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str | None:
    """The processor's model name (/proc/cpuinfo; None where the system has none): the same seeds train a different
    model on another processor family (its kernels round differently), so a run says which it ran on."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU count, load average, memory, versions and GPU (if any) of this run."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cpu": cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg": loadavg(),
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
    env["UNLEARN_PROGRESS"] = "0"  # its stderr is captured (the error tail): no bars in it
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


# -- the real methods, timed through their stage hook ----------------------------------------------
class StageRecorder:
    """A ``RemovalProblem.stage_hook``: wall seconds and RSS (before / peak / after) of every
    stage the method reports, under the method's own stage names. ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs before each stage ends so GPU work is attributed."""

    def __init__(self, sampler: "RssSampler", sync: Any = None, display: Any = None) -> None:
        self.sampler = sampler
        self.sync = sync or (lambda: None)
        self.display = display  # another StageHook told too (pipeline.progress.StageProgress: bars)
        self.seconds: dict[str, float] = {}
        self._open: dict[str, Any] = {}

    def started(self, stage: str) -> None:
        cm = self.sampler.stage(stage)
        cm.__enter__()
        self._open[stage] = cm
        if self.display is not None:
            self.display.started(stage)

    def finished(self, stage: str, seconds: float) -> None:
        self.sync()
        cm = self._open.pop(stage, None)
        if cm is not None:
            cm.__exit__(None, None, None)
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        if self.display is not None:
            self.display.finished(stage, seconds)


def measure_removal(problem: Any, method: str, settings: Any, *, sampler: "RssSampler | None" = None,
                    sync: Any = None) -> dict[str, Any]:
    """Run the registered ``method`` (``pipeline.methods``) on ``problem`` with its stage hook
    set to a ``StageRecorder``; returns the record, the release and the stage timings. Stages
    are those the method reports through the hook; a method that reports none there is timed
    by its record's ``timings`` (seconds only)."""
    from pipeline.methods.base import get_method, parse_settings
    from pipeline.progress import StageProgress

    impl = get_method(method)
    parsed = parse_settings(method, settings)
    own = sampler is None
    sampler = sampler or RssSampler(interval=0.02)
    if own:
        sampler.__enter__()
    recorder = StageRecorder(sampler, sync, display=StageProgress(method))
    problem.stage_hook = recorder
    try:
        t = time.perf_counter()
        outcome = impl.run(problem, parsed)
        (sync or (lambda: None))()
        seconds = time.perf_counter() - t
    except Exception as err:  # e.g. RemovalNotServed: the stage times up to the refusal go with it
        err.stage_seconds = dict(recorder.seconds)  # type: ignore[attr-defined]
        raise
    finally:
        problem.stage_hook = None
        if own:
            sampler.__exit__(None, None, None)
    record = outcome.record
    if recorder.seconds:
        source, stage_seconds = "stage_hook", dict(recorder.seconds)
    else:
        source, stage_seconds = "record timings", {k: float(v) for k, v in (record.get("timings") or {}).items()}
    stages = {k: sampler.stages.get(k, {"seconds": round(v, 4)}) for k, v in stage_seconds.items()}
    return {"record": record, "release": outcome.release.model_dump(mode="json"), "stages": stages,
            "stage_seconds": stage_seconds, "stage_source": source, "removal_seconds": seconds,
            "new_parameters": outcome.new_parameters}


def measure_forget(trained: Any, sample_ids: Any, method: str, settings: Any = None, *,
                   sampler: "RssSampler | None" = None, sync: Any = None, seed: int = 0, device: str = "cpu",
                   memory_budget: Any = "auto") -> dict[str, Any]:
    """One removal through ``pipeline.removal.remove``, the entry point ``unlearn forget --method``
    goes through: ``method`` is resolved as that option resolves it (a variant in configs/methods/
    or a registered method; ``settings`` on top of the variant's), ``trained`` is a loaded
    ``TrainedModel`` with its card. The method's per-version state is built first by
    ``pipeline.methods.base.prepare`` (what ``remove`` would build itself; timed apart as the
    ``preparation``) and handed to ``remove``, so preparation and removal seconds are separate,
    a refusal's too. Stages are timed through the stage hook (``StageRecorder``) as
    ``measure_removal`` does. A refusal (``RemovalNotServed``) is raised with ``stage_seconds``,
    ``preparation_seconds`` and ``preparation`` attached."""
    from pipeline import memory
    from pipeline.methods.base import get_method, prepare
    from pipeline.progress import StageProgress
    from pipeline.removal import method_ref, remove

    ref = method_ref(method, settings)
    impl = get_method(ref.method)
    sync = sync or (lambda: None)
    own = sampler is None
    sampler = sampler or RssSampler(interval=0.02)
    if own:
        sampler.__enter__()
    recorder = StageRecorder(sampler, sync, display=StageProgress(ref.name))
    try:
        with memory.use_budget(memory_budget, device), sampler.stage("preparation"):
            t = time.perf_counter()
            state, _ = prepare(impl, trained, ref.settings)
            sync()
            preparation_seconds = time.perf_counter() - t
        preparation = {**state.describe(), "wall_seconds": preparation_seconds}
        t = time.perf_counter()
        try:
            run = remove(trained, sample_ids, method=ref, prepared=state, seed=seed, device=device,
                         stage_hook=recorder, memory_budget=memory_budget)
            sync()
        except Exception as err:  # e.g. RemovalNotServed: what ran before the refusal goes with it
            err.stage_seconds = dict(recorder.seconds)  # type: ignore[attr-defined]
            err.preparation_seconds = preparation_seconds  # type: ignore[attr-defined]
            err.preparation = preparation  # type: ignore[attr-defined]
            err.removal_wall_seconds = time.perf_counter() - t  # type: ignore[attr-defined]
            raise
        seconds = time.perf_counter() - t
    finally:
        if own:
            sampler.__exit__(None, None, None)
    record = run.record
    if recorder.seconds:
        source, stage_seconds = "stage_hook", dict(recorder.seconds)
    else:
        source, stage_seconds = "record timings", {k: float(v) for k, v in (record.get("timings") or {}).items()}
    stages = {k: sampler.stages.get(k, {"seconds": round(v, 4)}) for k, v in stage_seconds.items()}
    return {"record": record, "release": record.get("release"), "stages": stages, "stage_seconds": stage_seconds,
            "stage_source": source, "removal_seconds": seconds, "preparation_seconds": preparation_seconds,
            "preparation": preparation, "preparation_stage": sampler.stages.get("preparation"),
            "method": ref.method, "variant": ref.name, "resolved_settings": ref.settings.model_dump(mode="json"),
            "entry_point": "pipeline.removal.remove (unlearn forget --method)", "new_state": run.new_state}


def record_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The figures the benchmarks report, read from an L-FOCI Newton record (missing keys: None)."""
    solver = (record.get("curvature") or {}).get("solver") or {}
    selection = record.get("selection") or {}
    selected = selection.get("selected")
    norms = record.get("gradient_norms") or {}
    return {"block_numel": (record.get("block") or {}).get("numel"),
            "slices_selected": len(selected) if isinstance(selected, list) else None,
            "slices_probed": selection.get("slices_probed"), "solver": solver.get("solver"),
            "solver_iterations": solver.get("iterations"), "relative_residual": solver.get("relative_residual"),
            "retain_gradient_norm_after": norms.get("retain_mean_block_after")}
