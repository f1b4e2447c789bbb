"""The project's GPU checks, in one prepared run sized for a short lease of one GPU.

    python bench/gpu_checks.py --out DIR [--budget 420] [--train-seconds 150]
    python bench/gpu_checks.py --out /tmp/gc --device cpu --tiny     (the same steps, tiny, any machine)
    python bench/gpu_checks.py --out DIR --steps reid --method block-gauss-newton   (the re-ID step alone,
                                                                     removal by another method)

Steps, in order, each in its own subprocess under a timeout, so that one that fails or hangs
still leaves the others' results (``DIR/gpu_checks.json`` is rewritten after every step):

1. ``probe``: torch version, the device's name and memory, a float32 and a float64 matmul
   checked against the same product on the CPU.
2. ``selection_parity`` (issue 25 item 5): ``bench/selection_parity_check.py --device DEV
   --dtype float64``: L-FOCI with the torch kernel on the device against the numba kernel on
   the CPU (and the bench's per-candidate loop on the device) on the bench's 300 x 300 check and
   two tie cases; plus the per-candidate loop on the CPU on the 300 x 300 case (the CPU reference
   the issue names), and ``bench.bench_selection --device DEV --kernel torch --quick`` (the
   command the issue ran: its 120 x 40 verify check, vectorised against the loop on the device).
3. ``reid`` (issue 26 item 6): ``bench.bench_gpu_reid --device DEV`` at full scale (ResNet-50,
   751 identities, 256 x 128, forget identity 0), trained until the loss plateaus, the step cap
   or ``--train-seconds``, then one removal by ``--method`` (default ``lfoci-newton``; named as
   ``unlearn forget --method`` names it, run through the same ``pipeline.removal.remove``;
   ``--method-settings`` a JSON object on top): served, or refused and recorded as
   ``needs_retrain`` with its reason. Its JSON is ``DIR/gpu_reid.json`` (written once after
   training, then again at the end); the step gets what is left of ``--budget``.

``--steps`` names the steps to run (comma-separated; default all three, in the order above).

Every step's output goes to ``DIR/gpu_checks.log``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEPS = ("probe", "selection_parity", "reid")

PROBE = r"""
import json, sys, time, torch
dev = torch.device(sys.argv[1])
out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
       "device": str(dev)}
if dev.type == "cuda":
    p = torch.cuda.get_device_properties(dev)
    free, total = torch.cuda.mem_get_info(dev)
    out.update({"device_name": p.name, "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                "memory_total_gib": total / 2**30, "memory_free_gib": free / 2**30,
                "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32})
g = torch.Generator().manual_seed(0)
for dtype, n in ((torch.float32, 2048), (torch.float64, 1024)):
    a, b = torch.randn(n, n, generator=g, dtype=dtype), torch.randn(n, n, generator=g, dtype=dtype)
    ref = a @ b
    t = time.perf_counter()
    got = (a.to(dev) @ b.to(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    out[f"matmul_{str(dtype)[6:]}_{n}"] = {
        "max_rel_err_vs_cpu": float((got.cpu() - ref).abs().max() / ref.abs().max()),
        "seconds_first": time.perf_counter() - t}
print(json.dumps(out))
"""


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


class Runner:
    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.t0 = out, budget, time.perf_counter()
        self.log = open(out / "gpu_checks.log", "a", buffering=1)
        self.results: dict = {"checks": "bench/gpu_checks.py", "started_unix": time.time(), "budget_s": budget,
                              "steps": {}}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.results["elapsed_s"] = time.perf_counter() - self.t0
        tmp = self.out / "gpu_checks.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.out / "gpu_checks.json")

    def call(self, name: str, cmd: list[str], timeout: float) -> dict:
        """Run ``cmd`` from the repository root; stdout and stderr to the log (and kept for
        parsing); never raises."""
        timeout = max(5.0, min(timeout, self.left()))
        self.log.write(f"\n===== {name}: {' '.join(cmd)} (timeout {timeout:.0f} s, {self.left():.0f} s left)\n")
        t = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            chunks: list[str] = []

            def pump() -> None:
                for line in proc.stdout:
                    chunks.append(line)
                    self.log.write(line)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                rc, timed_out = proc.wait(timeout=timeout), False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc, timed_out = proc.wait(), True
            reader.join(timeout=5)
            text = "".join(chunks)
            self.log.write(f"===== {name}: rc {rc}{' (timed out)' if timed_out else ''} in {time.perf_counter() - t:.1f} s\n")
            return {"rc": None if timed_out else rc, "timed_out": timed_out, "seconds": time.perf_counter() - t,
                    "tail": text[-1500:], "text": text}
        except Exception as err:  # recorded, never raised
            return {"rc": None, "timed_out": False, "seconds": time.perf_counter() - t,
                    "error": f"{type(err).__name__}: {err}", "text": ""}

    def step(self, name: str, fn) -> None:
        t = time.perf_counter()
        try:
            self.results["steps"][name] = fn()
        except Exception as err:
            import traceback

            self.results["steps"][name] = {"error": f"{type(err).__name__}: {err}",
                                           "traceback": traceback.format_exc()[-2000:]}
        self.results["steps"][name]["step_seconds"] = time.perf_counter() - t
        self.save()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_checks")))
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all the steps together")
    p.add_argument("--train-seconds", type=float, default=150.0)
    p.add_argument("--train-steps", type=int, default=5000)
    p.add_argument("--plateau-window", type=int, default=100)
    p.add_argument("--tiny", action="store_true", help="the re-ID step at smoke scale (a CPU rehearsal)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the subprocesses (0: default)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated steps to run, of {', '.join(STEPS)}")
    p.add_argument("--method", default="lfoci-newton", help="the re-ID step's removal method (unlearn forget --method)")
    p.add_argument("--method-settings", default=None, help="JSON object: the method's settings on top of its variant's")
    args = p.parse_args(argv)
    steps = [x.strip() for x in args.steps.split(",") if x.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        p.error(f"--steps: unknown {unknown}; choose from {', '.join(STEPS)}")
    if args.method_settings is not None:
        json.loads(args.method_settings)  # fail here, not in the subprocess
    args.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    r = Runner(args.out, args.budget)
    r.results.update({"device_requested": args.device, "python": sys.version.split()[0], "argv": sys.argv[1:]})
    threads = ["--threads", str(args.threads)] if args.threads else []

    def probe() -> dict:
        res = r.call("probe", [py, "-c", PROBE, args.device], 60)
        return {"command": "torch probe (bench/gpu_checks.py PROBE)", "result": last_json_line(res.pop("text")), **res}

    def parity() -> dict:
        out: dict = {}
        res = r.call("selection_parity_check",
                     [py, "bench/selection_parity_check.py", "--device", args.device, "--dtype", "float64", *threads], 150)
        out["parity_check"] = {"command": f"python bench/selection_parity_check.py --device {args.device} --dtype float64",
                               "result": last_json_line(res.pop("text")), **res}
        loop = r.call("loop_cpu", [py, "-c", LOOP_CPU], 90)
        out["loop_cpu_300x300"] = {"result": last_json_line(loop.pop("text")), **loop}
        bs = r.call("bench_selection_torch",
                    [py, "-m", "bench.bench_selection", "--device", args.device, "--kernel", "torch", "--quick",
                     "--out", str(args.out / "selection_torch_quick.json"), *threads], 120)
        bs.pop("text")
        path = args.out / "selection_torch_quick.json"
        small = json.loads(path.read_text()).get("identical_picks_small_problem") if path.exists() else None
        out["bench_selection_torch_quick"] = {
            "command": f"python -m bench.bench_selection --device {args.device} --kernel torch --quick",
            "identical_picks_small_problem": small, **bs}
        pc = out["parity_check"]["result"] or {}
        cases = {c["case"]: c for c in pc.get("cases", [])}
        b = cases.get("bench_300x300", {})
        dev = args.device.split(":")[0]
        lc = out["loop_cpu_300x300"]["result"] or {}
        out["summary"] = {
            "match_all_cases": pc.get("match"),
            "picks_numba_cpu": b.get("picks_numba_cpu"), "scores_numba_cpu": b.get("scores_numba_cpu"),
            f"picks_torch_{dev}": b.get(f"picks_torch_{dev}"), f"scores_torch_{dev}": b.get(f"scores_torch_{dev}"),
            f"picks_loop_{dev}": b.get(f"picks_loop_{dev}"),
            "picks_loop_cpu": lc.get("picks"), "scores_loop_cpu": lc.get("scores"),
            "max_abs_score_diff": b.get("max_abs_score_diff"), "bit_identical": b.get("bit_identical"),
            "loop_cpu_agrees": (lc.get("picks") == b.get(f"picks_torch_{dev}")
                                and all(abs(x - y) <= 1e-12 for x, y in zip(lc.get("scores") or [], b.get(f"scores_torch_{dev}") or [])))
            if lc and b else None,
            "per_case_match": {k: c.get("match") for k, c in cases.items()},
        }
        return out

    def reid() -> dict:
        json_path = args.out / "gpu_reid.json"
        cmd = [py, "-m", "bench.bench_gpu_reid", "--device", args.device, "--out", str(json_path), *threads]
        if args.tiny:
            cmd += ["--smoke"]
        cmd += ["--train-steps", str(args.train_steps), "--train-seconds", str(args.train_seconds),
                "--plateau-window", str(args.plateau_window), "--method", args.method]
        if args.method_settings is not None:
            cmd += ["--method-settings", args.method_settings]
        res = r.call("reid", cmd, r.left() - 5)
        res.pop("text")
        d = json.loads(json_path.read_text()) if json_path.exists() else {}
        t = d.get("training") or {}
        return {"command": "python -m " + " ".join(cmd[2:]).replace(str(args.out), "$OUT"), **res,
                "summary": {"finished": "partial" not in d and bool(d), "method": d.get("variant") or args.method,
                            "outcome": d.get("outcome"), "removal_seconds": d.get("removal_seconds"),
                            "preparation_seconds": d.get("preparation_seconds"), "serve_seconds": d.get("serve_seconds"),
                            "wall_seconds": d.get("wall_seconds"),
                            "needs_retrain": d.get("needs_retrain"), "stage_summary": d.get("stage_summary"),
                            "training_steps": t.get("steps"), "training_epochs": t.get("epochs"),
                            "training_seconds": t.get("train_seconds"), "stopped_by": t.get("stopped_by"),
                            "loss_curve": t.get("loss_curve"),
                            "losses_before": (d.get("verify_losses") or {}).get("before") or d.get("losses_before"),
                            "losses_after": (d.get("verify_losses") or {}).get("after"),
                            "block_numel": (d.get("block") or {}).get("numel"), "gpu": d.get("gpu"),
                            "method_summary": d.get("method_summary"), "embedding": d.get("embedding")}}

    r.results["steps_requested"] = steps
    for name, fn in (("probe", probe), ("selection_parity", parity), ("reid", reid)):
        if name in steps:
            r.step(name, fn)
    r.results["finished_unix"] = time.time()
    r.save()
    print(json.dumps({k: v.get("summary", v.get("result")) for k, v in r.results["steps"].items()}, default=str)[:6000])
    return 0


# the bench's per-candidate loop on the CPU, on the 300 x 300 case as the parity check builds it
LOOP_CPU = r"""
import json, sys
sys.path.insert(0, ".")
from bench.selection_parity_check import bench_case
from bench.bench_selection import loop_foci
from pipeline.selection.foci import standardize_columns
import torch
y, z = bench_case(0, torch.float64)
picks, scores = loop_foci(y, standardize_columns(z), None)
print(json.dumps({"case": "bench_300x300", "device": "cpu", "picks": picks, "scores": scores}))
"""


if __name__ == "__main__":
    sys.exit(main())
