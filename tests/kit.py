"""The test kit: builders shared by the test modules (``tests/conftest.py`` exposes the
fixtures). Real data (scikit-learn digits), real training code paths, real engines.

  digits64, softmax_task, trained, retrained, newton_fit, newton_retrained, flat
                          convex oracles in float64 (tight optima by L-BFGS or damped Newton)
  sgd_mlp_head            a 64-16-10 ReLU head after a few epochs of SGD (off any optimum)
  trained_model_dir       a model directory written by the real ``unlearn train`` code path
                          (``pipeline.trainer.run_training``), any preset / source / recipe / dtype
  load_in_dtype           the model of a directory built in a given dtype
  assert_removal_end_to_end, LFOCI_SMALL
                          one small lfoci-newton removal through ``pipeline.removal.remove``
  LoopbackHead            a real Ray head on 127.0.0.1 for job-submission tests
  http_json               one HTTP request to a server on 127.0.0.1, JSON in and out
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cluster.net import free_port
from pipeline.data import SampleSet, load_source
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs, fit_newton


# -- an SGD-trained head (its decision layer is not at an optimum) ------------------------------
def sgd_mlp_head(data: SampleSet, *, seed: int, epochs: int, weight_decay: float = 0.0) -> nn.Module:
    """Flatten, Linear 64-16, ReLU, Linear 16-10 in float64 after ``epochs`` of SGD (lr 0.05,
    momentum 0.9, batches of 64 in order), eval mode."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay)
    x, y = data.columns["x"], data.columns["y"]
    for _ in range(epochs):
        for i in range(0, len(y), 64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[i:i + 64]), y[i:i + 64]).backward()
            opt.step()
    return net.eval()


# -- convex oracles ------------------------------------------------------------------------------
def digits64() -> dict[str, SampleSet]:
    return load_source("digits", {"dtype": "float64"})


def trained(model: nn.Module, task, data: SampleSet, weight_decay: float, tol: float = 1e-10, steps: int = 400) -> nn.Module:
    torch.manual_seed(0)
    model = model.double()
    report = fit_lbfgs(model, task, data, weight_decay, tolerance=tol, max_steps=steps)
    assert report.gradient_norm < 1e-6, report
    return model


def retrained(model: nn.Module, task, data: SampleSet, weight_decay: float, tol: float = 1e-10, steps: int = 400) -> nn.Module:
    """Warm-started tight full-batch retrain on ``data`` (L-BFGS)."""
    twin = copy.deepcopy(model)
    fit_lbfgs(twin, task, data, weight_decay, tolerance=tol, max_steps=steps)
    return twin


def newton_fit(model: nn.Module, task, data: SampleSet, weight_decay: float) -> nn.Module:
    """Tight full-batch optimum (damped Newton, exact Hessian) for small convex models; in place.
    Convex: the optimum does not depend on the initial weights the caller drew."""
    report = fit_newton(model.double(), task, data, weight_decay, tolerance=1e-12)
    assert report.gradient_norm <= 1e-11, report
    return model


def newton_retrained(model: nn.Module, task, data: SampleSet, weight_decay: float) -> nn.Module:
    return newton_fit(copy.deepcopy(model), task, data, weight_decay)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def softmax_task() -> DenseInputTask:
    return DenseInputTask(loss="cross_entropy")


# -- model directories ---------------------------------------------------------------------------
def trained_model_dir(
    directory: Path, preset: str = "linear", options: dict | None = None, source: str = "digits",
    data_options: dict | None = None, recipe: dict | None = None, init: dict | None = None, *,
    dtype: torch.dtype | str = "float32", weight_decay: float = 0.01, steps: int = 20,
) -> Path:
    """Train with the real ``unlearn train`` code path and return the model directory.
    Default recipe: full-batch L-BFGS, ``steps`` steps, weight decay ``weight_decay``, seed 0.
    ``dtype`` float64 trains in float64 (and reads digits in float64)."""
    from pipeline.trainer import TrainConfig, run_training

    dtype_name = str(dtype).removeprefix("torch.")
    data_options = dict(data_options or {})
    if dtype_name == "float64" and source == "digits":
        data_options.setdefault("dtype", "float64")
    recipe = recipe or {"optimizer": "lbfgs", "weight_decay": weight_decay, "max_steps": steps,
                        "tolerance": 1e-9, "seed": 0}
    config = TrainConfig.model_validate({
        "model": {"preset": preset, "options": dict(options or {}), "dtype": dtype_name, **({"init": init} if init else {})},
        "data": {"source": source, "options": data_options},
        "recipe": recipe,
    })
    run_training(config, directory)
    return directory


def load_in_dtype(directory: Path, preset: str, options: dict, dtype: torch.dtype):
    """The model of ``directory`` built in ``dtype`` (whatever precision the directory holds)."""
    from pipeline.checkpoint import load_into, read_state_dict
    from pipeline.models.registry import build

    model, task = build(preset, options)
    model = model.to(dtype)
    load_into(model, read_state_dict(Path(directory) / "model.safetensors"))
    return model.eval(), task


# -- one removal, end to end -----------------------------------------------------------------------
# Small settings for an end-to-end L-FOCI Newton removal on a tiny model: at most 4 L-FOCI
# slices plus the output layer (no forget-gradient additions), CG solved to its tolerance (an
# unsolved system is refused, never published), one Newton step, curvature on 16 samples.
# The Newton step is what these check: target minimiser (on an SGD card the retrain target of a small block
# is set by the recipe replay, with no Newton system: tests/test_target_retrain.py).
LFOCI_SMALL: dict[str, Any] = {"target": "minimiser", "perturbations": 24, "pass_size": 24, "max_slices": 4, "curvature_samples": 16,
                               "damping": 0.01, "dense_max": 32, "cg_rtol": 1e-6, "forget_gradient_share": 0.0,
                               "newton_max_steps": 1, "min_gradient_reduction": 0.0}


def assert_removal_end_to_end(model_dir: Path, n_forget: int = 2, settings: dict | None = None) -> dict:
    """Remove the first ``n_forget`` training ids with lfoci-newton; check the result is usable."""
    from pipeline.models.card import load_model_dir, read_card
    from pipeline.removal import remove, training_set

    card = read_card(model_dir)
    ids = training_set(card).sample_ids[:n_forget].tolist()
    run = remove(model_dir, ids, method="lfoci-newton", settings=settings or LFOCI_SMALL, seed=0, batch_size=64)
    model, _, _ = load_model_dir(model_dir)
    before = model.state_dict()
    assert set(run.new_state) == set(before)
    assert all(bool(torch.isfinite(v).all()) for v in run.new_state.values())
    record = run.record
    norms = record["gradient_norms"]
    if record["curvature"]["how"] == "gauss-newton":  # a block inside a network trained end to end by SGD
        assert record["trust_region"]["accepted"], record["trust_region"]
        assert norms["residual_after"] < norms["residual_before"], norms  # the step removed some
    else:
        solver = record["curvature"]["solver"]
        assert solver["converged"] and solver["relative_residual"] <= solver["tolerance"], solver
        assert norms["retain_mean_block_after"] < norms["retain_mean_block_before"], norms  # the step removed some
    changed = [k for k in before if not torch.equal(before[k], run.new_state[k])]
    assert changed, "the removal changed no parameter"
    assert run.card.training.n == card.training.n - n_forget
    assert run.card.training.removed_ids == sorted(ids)
    model.load_state_dict(run.new_state, strict=True)  # the new state loads into the preset
    return {"record": run.record, "changed": changed}


# -- engines ---------------------------------------------------------------------------------------
class LoopbackHead:
    """A real Ray head (``ray start --head --block``) on 127.0.0.1 with its own ports and temp
    dir, for job-submission tests. ``stop`` ends only the processes it started: the blocking
    ``ray start`` (which takes its node down with it), then any process still naming this
    head's private temp dir on its command line. (``ray stop`` is never used: it stops every
    Ray process of the machine, other people's included.)"""

    def __init__(self, venv_bin: Path, num_cpus: int = 2, object_store_bytes: int = 300_000_000):
        import os

        self.temp_dir = tempfile.mkdtemp(prefix="urh-", dir="/tmp")
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}
        self.env.pop("RAY_ADDRESS", None)
        self.command = [
            str(venv_bin / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
            f"--port={self.port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--ray-client-server-port={free_port()}", f"--num-cpus={num_cpus}",
            f"--object-store-memory={object_store_bytes}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]
        self.proc = None

    def start(self, timeout_s: float = 120.0) -> "LoopbackHead":
        import subprocess
        import time
        import urllib.request

        self.log = open(Path(self.temp_dir) / "ray-start.log", "wb")
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}: "
                                   f"{(Path(self.temp_dir) / 'ray-start.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.address}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the Ray head's dashboard did not answer at {self.address} within {timeout_s} s")

    def _own_pids(self) -> list[int]:
        import psutil

        pids = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(self.temp_dir in arg for arg in (p.info["cmdline"] or [])):
                    pids.append(int(p.info["pid"]))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return pids

    def stop(self, grace_s: float = 20.0) -> None:
        import os
        import signal
        import time

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except Exception:
                self.proc.kill()
        deadline = time.monotonic() + grace_s
        while self._own_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in self._own_pids():  # left-overs of this head only (their command line names its dir)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if getattr(self, "log", None):
            self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def http_json(port: int, method: str, path: str, body: bytes | dict | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """One HTTP request to 127.0.0.1:port; (status, decoded JSON body) for successes and errors alike."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
