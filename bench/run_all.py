"""Run every benchmark with one command, then write bench/results/summary.md.

    .venv/bin/python -m bench.run_all                 # every benchmark in its default (full) mode
    .venv/bin/python -m bench.run_all --quick         # bounded: quick modes / small sizes (each script capped by
                                                      # --timeout, 900 s by default)
    .venv/bin/python -m bench.run_all --smoke         # the smoke modes of the scripts that have one (seconds to
                                                      # minutes each)
    .venv/bin/python -m bench.run_all --only fmnist,growth
    .venv/bin/python -m bench.run_all --quick --only deep_fmnist-cnn,deep_r8-minilm,deep_identities
    .venv/bin/python -m bench.run_all --summary-only  # rebuild summary.md from the JSON files already there

Each benchmark runs in its own process (``sys.executable -m bench.<script> ...``), one after the
other (they would compete for the cores), with a wall-clock limit; a failing or timed-out
script is reported and the others still run. Quick mode writes ``*_quick.json`` next to the
full results (nothing is overwritten). The summary is a markdown table per JSON file of
bench/results (its headline figures, the mode it ran in and the machine's load average), so
the README can quote it; the run log of this invocation (exit codes, durations) is written to
bench/results/run_all.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import RESULTS_DIR, ROOT, loadavg, write_json
from pipeline.progress import meter_line, note

# name -> {"module": the bench module when it is not bench_<name>, and per mode its arguments (None: no such mode)}
BENCHMARKS: dict[str, dict[str, Any]] = {
    "selection": {
        "default": [],
        "quick": ["--n", "400", "--s", "3000", "--max-picks", "8", "--loop-sample", "50", "--verify-n", "120",
                  "--verify-s", "120", "--out", str(RESULTS_DIR / "selection_quick.json")],
        "smoke": None,
    },
    "scaling": {
        "default": [],
        "quick": ["--perturbations", "256", "--repeats", "1", "--workers", "1", "2",
                  "--output", str(RESULTS_DIR / "scaling_quick.json")],
        "smoke": None,
    },
    "text_r8": {"default": [], "quick": ["--quick"], "smoke": None},
    "fmnist": {"default": [], "quick": ["--quick"], "smoke": ["--smoke"]},
    "growth": {"default": [], "quick": ["--quick"], "smoke": ["--smoke"]},
    "huge_layers": {"default": [], "quick": ["--quick"], "smoke": ["--smoke"]},
    "gpu_reid": {"default": [], "quick": [], "smoke": ["--smoke"]},
    # the forgetting benchmarks (networks trained end to end; small heads over frozen features), the campaign and
    # service figures: scripts with their own module name, one entry per data set. The deep benchmark's default is
    # its full profile (every scenario: many hours on 2 cores; the README's cells were run one scenario at a time)
    **{f"deep_{name}": {"module": "deep_forgetting", "default": ["--dataset", name, "--threads", "1"],
                        "quick": ["--dataset", name, "--quick", "--threads", "1"],
                        "smoke": ["--dataset", name, "--smoke", "--threads", "1"]}
       for name in ("fmnist-cnn", "r8-minilm", "identities")},
    **{f"forgetting_{name}": {"module": "forgetting", "default": ["--dataset", name, "--threads", "1"],
                              "quick": ["--dataset", name, "--quick", "--threads", "1"], "smoke": None}
       for name in ("fmnist", "r8")},
    **{f"campaign_scale_{name}": {"module": "campaign_scale", "default": ["--dataset", name, "--kills", "3"],
                                  "quick": ["--dataset", name, "--quick"], "smoke": None}
       for name in ("fmnist", "r8")},
    "stream_load": {"module": "stream_load", "default": [], "quick": ["--quick"], "smoke": None},
    "stream_drift": {"module": "stream_drift", "default": [], "quick": None, "smoke": None},
    "trajectory_pushes": {"module": "trajectory_pushes", "default": ["--threads", "1"],
                          "quick": ["--quick", "--threads", "1"], "smoke": ["--smoke"]},
    "rewind_curve": {"module": "rewind_curve", "default": ["--dataset", "identities", "--scenario", "random_10pct",
                                                          "--threads", "1", "--epochs", "0,2,4,6,8,10,12,14,16"],
                     "quick": None, "smoke": ["--smoke"]},
}
TIMEOUTS = {"default": 4 * 3600, "quick": 900, "smoke": 300}


def resolve_threads(value: str) -> int | None:
    if value == "default":
        return None
    if value == "auto":
        load, cpus = loadavg(), os.cpu_count() or 1
        return 1 if load and load[0] >= cpus else None
    return int(value)


def run_one(name: str, args: list[str], timeout: float, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", f"bench.{BENCHMARKS[name].get('module') or 'bench_' + name}", *args]
    print(f"\n>>> {' '.join(cmd[1:])}  (limit {timeout:.0f} s, load {loadavg()})", flush=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout)
        rc, status = proc.returncode, "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        rc, status = None, "timed out"
    seconds = time.perf_counter() - started
    print(f"<<< {name}: {status} in {seconds:.0f} s", flush=True)
    return {"name": name, "command": cmd[1:], "status": status, "returncode": rc, "seconds": round(seconds, 1),
            "loadavg_after": loadavg()}


# -- summary --------------------------------------------------------------------------------------
def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 10 ** -digits):
            return f"{v:.2e}"
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return out


def _scorecard(scenarios: dict[str, Any], speed: bool) -> list[str]:
    lines: list[str] = []
    for name, sc in scenarios.items():
        rows = dict(sc.get("rows", {}))
        if sc.get("mixed_linear"):
            rows.update({k: v for k, v in sc["mixed_linear"]["rows"].items()})
        header = ["method", "UA", "RA", "TA", "MIA", "Avg. Gap", "seconds"] + (["Retrain s / removal s"] if speed else [])
        body = []
        retrain = rows.get("retrain", {}).get("seconds")
        for method, row in rows.items():
            cells: list[Any] = [method] + [row.get(k) for k in ("UA", "RA", "TA", "MIA", "AvgGap", "seconds")]
            if speed:
                ratio = None
                if method == "mixed-linear" and sc.get("mixed_linear"):
                    ratio = sc["mixed_linear"].get("ratio_retrain_over_removal")
                elif method not in ("original", "retrain", "ml-original", "ml-retrain") and row.get("seconds") and retrain:
                    ratio = retrain / row["seconds"]
                cells.append(ratio)
            body.append(cells)
        lines += ["", f"*{name}* (n = {_f(sc.get('n'))}, m = {_f(sc.get('m'))})", ""] + _table(header, body)
        errors = sc.get("errors") or sc.get("method_errors") or {}
        for method, err in errors.items():
            lines.append(f"- {method} failed: {str(err)[:200]}")
        for method, why in (sc.get("needs_retrain") or {}).items():  # the method's own refusal (RemovalNotServed)
            lines.append(f"- {method} refused the request (needs retrain): {str(why)[:200]}")
    return lines


def summarise_fmnist(d: dict[str, Any]) -> list[str]:
    setup = d.get("setup", {})
    prof = setup.get("profile", {})
    lines = [f"small-cnn ({_f(d.get('train', {}).get('parameters'))} parameters) on Fashion-MNIST "
             f"{prof.get('image_size')}x{prof.get('image_size')}, trained from a pre-trained point; Retrain = same recipe "
             f"from the same point on D_r. Avg. Gap is to Retrain; mixed-linear rows (ml-*) are the linearised model family, "
             f"whose forgetting is exact against its own retrain (ml-retrain)."]
    lines += _scorecard(d.get("scenarios", {}), speed=True)
    return lines


def summarise_text_r8(d: dict[str, Any]) -> list[str]:
    train = d.get("train", {})
    lines = [f"MiniLM ({_f(train.get('parameters'))} parameters, {_f(train.get('trainable_parameters'))} trainable) "
             f"fine-tuned on Reuters R8, n = {_f(train.get('n'))}."]
    return lines + _scorecard(d.get("scenarios", {}), speed=True)


def summarise_growth(d: dict[str, Any]) -> list[str]:
    header = ["axis", "values", "seconds (first -> last)", "log-log slope of time", "peak RSS GiB (first -> last)",
              "removal extra GiB (first -> last)", "block entries (first -> last)"]
    body = []
    for axis, points in d.get("results", {}).items():
        ok = [p for p in points if "error" not in p]
        if not ok:
            body.append([axis, "all failed", "-", "-", "-", "-", "-"])
            continue
        a, b = ok[0], ok[-1]
        body.append([axis, f"{a['point'][axis]} .. {b['point'][axis]}", f"{_f(a['seconds'])} -> {_f(b['seconds'])}",
                     d.get("loglog_slopes_seconds", {}).get(axis),
                     f"{_f(a.get('peak_rss_gib'))} -> {_f(b.get('peak_rss_gib'))}",
                     f"{_f(a.get('removal_extra_gib'))} -> {_f(b.get('removal_extra_gib'))}",
                     f"{_f(a.get('block_numel'))} -> {_f(b.get('block_numel'))}"])
    lines = [f"One L-FOCI Newton removal, MLP on digits, base point {d.get('base_point')}; one fresh process per point "
             f"(getrusage peak). Plot: `{d.get('plot')}`."] + [""] + _table(header, body)
    per_entry = d.get("curvature_seconds_per_block_entry") or {}
    dense, cg = per_entry.get("cholesky"), per_entry.get("cg")
    if dense and cg:
        lines.append(f"- curvature + solve per block entry (median): dense Cholesky {dense['median'] * 1e3:.2f} ms "
                     f"({dense['points']} points), CG {cg['median'] * 1e3:.2f} ms ({cg['points']} points): the dense "
                     "path costs one Hessian-vector product per entry")
    slices = [p for p in d.get("results", {}).get("slices", []) if "error" not in p]
    if slices:
        worst = max(slices, key=lambda p: p["seconds"])
        lines.append(f"- slices axis: slowest point {worst['point']['slices']} slices = {worst['block_numel']:,} entries, "
                     f"{worst['solver']}, {_f(worst['seconds'])} s")
    by_stage = d.get("loglog_slopes_by_stage") or {}
    if by_stage.get("perturbations"):
        st = by_stage["perturbations"]
        lines.append(f"- vs perturbations: log-log slope probe {_f(st.get('probe'))}, selection {_f(st.get('selection'))}")
    return lines


def summarise_huge(d: dict[str, Any]) -> list[str]:
    s, m = d.get("solver", {}), d.get("model", {})
    selection = d.get("selection") or {}
    selected = selection.get("selected")
    newton = (d.get("method_record") or {}).get("newton") or {}
    rows = [["parameters", m.get("parameters")], ["block entries", d.get("block", {}).get("numel")],
            [f"fc6 rows in the block ({(m.get('fc6') or {}).get('row_parameters', '?')} parameters each)",
             len(d.get("block", {}).get("fc6_rows") or [])],
            ["L-FOCI slices", len(selected) if isinstance(selected, list) else selected],
            ["output layer in the block", f"{m.get('output_layer')} ({m.get('output_layer_numel')} entries)"],
            ["Newton steps", newton.get("steps")],
            ["CG iterations (cap) / damping", f"{s.get('iterations')} ({s.get('cg_max_iter')}) / {s.get('damping')}"],
            ["CG relative residual (tolerance)", f"{s.get('relative_residual')} ({s.get('tolerance')})"],
            ["removal seconds", d.get("removal_seconds")], ["preparation seconds", d.get("preparation_seconds")],
            ["peak RSS (GiB)", d.get("peak_rss_gib")]]
    rows += [[f"stage: {k} (s)", v] for k, v in d.get("stage_seconds", {}).items()]
    return ["VGG-16 (D) removal on the CPU: the L-FOCI block solved matrix-free by CG to its tolerance."] + [""] + \
        _table(["figure", "value"], rows)


def summarise_gpu(d: dict[str, Any]) -> list[str]:
    s, m = d.get("solver", {}), d.get("model", {})
    rows = [["method", d.get("variant") or "lfoci-newton"], ["device", d.get("device")], ["scale", d.get("scale")],
            ["parameters", m.get("parameters")],
            ["input", "x".join(str(v) for v in m.get("input", []))], ["n / m", f"{d.get('n')} / {d.get('m')}"],
            ["perturbations", (d.get("method_record") or {}).get("selection", {}).get("perturbations")],
            ["block entries", d.get("block", {}).get("numel")],
            ["CG iterations (cap)", f"{s.get('iterations')} ({s.get('cg_max_iter')})"],
            ["removal seconds", d.get("removal_seconds")], ["preparation seconds", d.get("preparation_seconds")],
            ["peak RSS (GiB)", d.get("peak_rss_gib")]]
    if d.get("outcome"):
        why = (d.get("needs_retrain") or {}).get("reason")
        rows.append(["outcome", d["outcome"] + (f" ({why})" if why else "")])
    t = d.get("training") or {}
    if t:
        rows.append(["training steps (stopped by)", f"{t.get('steps')} ({t.get('stopped_by')})"])
    rows += [[f"{k} (s)", v] for k, v in d.get("stage_summary", {}).items()]
    if d.get("gpu"):
        rows += [["GPU", d["gpu"].get("name")], ["peak GPU memory allocated (GiB)", d["gpu"].get("peak_allocated_gib")]]
    return ["ResNet-50 re-ID removal (probe on the model's device, CG vectors and solve on the CPU)."] + [""] + \
        _table(["figure", "value"], rows)


def summarise_selection(d: dict[str, Any]) -> list[str]:
    t, sizes = d.get("times_s", {}), d.get("sizes", {})
    rows = [["perturbations x slices", f"{sizes.get('n_perturbations')} x {sizes.get('n_slices')}"],
            ["vectorised L-FOCI (s)", t.get("vectorised")], ["per-candidate loop (s)", t.get("loop")],
            ["loop extrapolated", d.get("loop", {}).get("extrapolated")], ["speed-up", d.get("ratio")],
            ["identical picks", d.get("identical")], ["device", sizes.get("device")]]
    return _table(["figure", "value"], rows)


def summarise_scaling(d: dict[str, Any]) -> list[str]:
    rows = []
    base = d.get("in_process_1_thread", {})
    if base:
        rows.append(["in process, 1 thread", base.get("probe", {}).get("median_s"), base.get("hvp", {}).get("median_s"), "-"])
    for r in d.get("ray", []):
        rows.append([f"Ray, {r.get('workers')} worker(s) on {','.join(r.get('devices', []) or ['?'])}",
                     r.get("probe", {}).get("median_s"), r.get("hvp", {}).get("median_s"), r.get("pool_startup_s")])
    lines = _table(["run", "probe median (s)", "HVP median (s)", "pool start (s)"], rows)
    fit = d.get("fit", {})
    for stage, f in fit.items():
        lines.append(f"- {stage}: speed-up vs 1 worker {f.get('speedup_vs_1_worker')}, serial fraction {_f(f.get('serial_fraction'))}")
    return lines


def summarise_generic(d: dict[str, Any]) -> list[str]:
    rows = [[k, v] for k, v in d.items() if isinstance(v, (int, float, str, bool)) and len(str(v)) < 120]
    return _table(["key", "value"], rows[:30]) if rows else ["(no scalar figures at the top level)"]


def summarise_deep(d: dict[str, Any]) -> list[str]:
    from bench.deep_forgetting import render_summary

    return render_summary(d).splitlines()


def summarise_forgetting(d: dict[str, Any]) -> list[str]:
    from bench.forgetting import render_summary

    return render_summary(d).splitlines()


def kind_of(path: Path, d: dict[str, Any]) -> str:
    name = str(d.get("benchmark", ""))
    if name in ("deep_forgetting", "forgetting"):
        return "deep" if name == "deep_forgetting" else "forgetting"
    for key in ("fmnist", "growth", "huge_layers", "gpu_reid", "text_r8", "scaling"):
        if key in name or path.stem.startswith(key):
            return key
    if "L-FOCI" in name or path.stem.startswith("selection"):
        return "selection"
    return "generic"


SUMMARISERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "fmnist": summarise_fmnist, "text_r8": summarise_text_r8, "growth": summarise_growth, "huge_layers": summarise_huge,
    "gpu_reid": summarise_gpu, "selection": summarise_selection, "scaling": summarise_scaling, "generic": summarise_generic,
    "deep": summarise_deep, "forgetting": summarise_forgetting,
}
ORDER = ["deep", "forgetting", "fmnist", "text_r8", "huge_layers", "gpu_reid", "growth", "selection", "scaling", "generic"]


def _load_note(d: dict[str, Any]) -> str:
    machine = d.get("machine", {}) if isinstance(d.get("machine"), dict) else {}
    load = machine.get("loadavg") or machine.get("load_average_before") or machine.get("loadavg_before")
    cpus = machine.get("cpus") or machine.get("cpu_count")
    parts = []
    if cpus:
        parts.append(f"{cpus} CPUs")
    if machine.get("gpu") or machine.get("cuda_device"):
        parts.append(str(machine.get("gpu") or machine.get("cuda_device")))
    if load:
        parts.append(f"load average at start {[round(float(x), 2) for x in load]}")
    return ", ".join(parts)


def write_summary(results_dir: Path = RESULTS_DIR, out: Path | None = None, *, include_smoke: bool = False) -> Path:
    """bench/results/summary.md: one section per JSON file (headline figures as markdown tables);
    ``*_smoke.json`` (wiring checks, not figures) only with ``include_smoke``."""
    out = out or results_dir / "summary.md"
    entries = []
    for path in sorted(results_dir.glob("*.json")):
        if path.name == "run_all.json" or (path.stem.endswith("_smoke") and not include_smoke):
            continue
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            entries.append(("generic", path, None, f"unreadable: {err}"))
            continue
        entries.append((kind_of(path, d) if isinstance(d, dict) else "generic", path, d, None))
    entries.sort(key=lambda e: (ORDER.index(e[0]), e[1].name))
    lines = ["# Benchmark summary", "",
             f"Generated {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by `python -m bench.run_all` "
             "from the JSON files in bench/results (one section each; `*_quick` / `*_smoke` files come from the bounded "
             "modes and are not the reference figures). Wall times were measured on the machine named in each "
             "section; a load average above its CPU count means the cores were shared with other work.", ""]
    for kind, path, d, error in entries:
        mode = (d or {}).get("mode") or ((d or {}).get("quick") and "quick") or ""
        title = f"## {path.stem}" + (f" ({mode})" if mode and mode != "default" else "")
        lines += [title, "", f"`{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`"
                  + (f" - {_load_note(d)}" if d and _load_note(d) else ""), ""]
        if error:
            lines.append(error)
        else:
            try:
                lines += SUMMARISERS[kind](d)
            except Exception as err:  # a malformed file must not stop the summary
                lines.append(f"(could not summarise: {type(err).__name__}: {err})")
        lines.append("")
    text = "\n".join(lines) + "\n"
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="bounded run time: quick modes and small sizes")
    mode.add_argument("--smoke", action="store_true", help="smoke modes only (scripts without one are skipped)")
    mode.add_argument("--summary-only", action="store_true", help="only rebuild summary.md from existing JSON files")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--skip", default=None, help="comma-separated benchmarks to leave out")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per script (default by mode)")
    parser.add_argument("--threads", default="auto",
                        help="OMP_NUM_THREADS (torch intra-op threads) for the scripts: a number, 'default' (torch's "
                             "choice), or 'auto' (1 when the 1-minute load average is at least the CPU count, else "
                             "torch's choice: on a shared, busy 2-core machine two threads made small runs up to 5x slower)")
    args = parser.parse_args(argv)

    mode_name = "smoke" if args.smoke else "quick" if args.quick else "default"
    if not args.summary_only:
        names = list(BENCHMARKS)
        if args.only:
            wanted = args.only.split(",")
            unknown = sorted(set(wanted) - set(BENCHMARKS))
            if unknown:
                parser.error(f"--only: unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
            names = [n for n in names if n in wanted]
        if args.skip:
            names = [n for n in names if n not in args.skip.split(",")]
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        threads = resolve_threads(args.threads)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        print(f"threads per script: {threads or 'torch default'} (load average {loadavg()}, {os.cpu_count()} CPUs)", flush=True)
        runs = []
        started = time.perf_counter()
        for done, name in enumerate(names):
            # The scripts draw their own bars on this terminal: ours is one line between them.
            note(meter_line(done, len(names), time.perf_counter() - started, f"benchmarks (next: {name})"))
            extra = BENCHMARKS[name].get(mode_name)
            if extra is None:
                runs.append({"name": name, "status": f"skipped (no {mode_name} mode)"})
                continue
            runs.append(run_one(name, extra, args.timeout or TIMEOUTS[mode_name], env))
        note(meter_line(len(names), len(names), time.perf_counter() - started, "benchmarks"))
        write_json(RESULTS_DIR / "run_all.json", {"mode": mode_name, "threads": threads, "runs": runs,
                                                 "wall_seconds": time.perf_counter() - started, "loadavg_end": loadavg()})
        print("\n" + "\n".join(f"{r['name']:<12} {r['status']:<22} {r.get('seconds', '-')}" for r in runs), flush=True)
    path = write_summary(include_smoke=mode_name == "smoke")
    print(f"wrote {path}", flush=True)
    failed = [r for r in (runs if not args.summary_only else []) if r["status"] in ("failed", "timed out")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
