"""Ray fixtures for the cluster tests: one local Ray per test session (loopback only, 2 CPUs,
a small object store, its own short temp dir) and small trained model directories.

Import in a test module with ``from tests.ray_fixtures import ray_local  # noqa``.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import load_into, read_state_dict
from pipeline.data import load_source
from pipeline.models.card import DataRef, ModelCard, TrainingRecord, write_model_dir
from pipeline.models.registry import build
from pipeline.training import fit_lbfgs

OBJECT_STORE_BYTES = 256 * 2**20


@pytest.fixture(scope="session")
def ray_local():
    """A Ray started inside the test process (or the one already running), stopped at the end
    only if started here."""
    from cluster.runtime import connect

    tmp = tempfile.mkdtemp(prefix="urt-", dir="/tmp")
    rt = connect(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, temp_dir=tmp, log_to_driver=False)
    try:
        yield rt
    finally:
        if rt.owned:
            rt.close()
        shutil.rmtree(tmp, ignore_errors=True)


def write_trained_model_dir(
    directory: Path, preset: str, options: dict, *, dtype: torch.dtype = torch.float32,
    weight_decay: float = 0.01, steps: int = 20, data_options: dict | None = None,
) -> Path:
    """Train ``preset`` on digits' train split with full-batch L-BFGS and write a model dir."""
    data_options = dict(data_options or {})
    if dtype == torch.float64:
        data_options["dtype"] = "float64"
    data = load_source("digits", data_options)["train"]
    torch.manual_seed(0)
    model, task = build(preset, options)
    model = model.to(dtype)
    fit_lbfgs(model, task, data, weight_decay, max_steps=steps, tolerance=1e-9)
    card = ModelCard(preset=preset, options=options, data=DataRef(source="digits", options=data_options),
                     training=TrainingRecord(weight_decay=weight_decay, n=len(data), optimizer="lbfgs"))
    write_model_dir(directory, model.state_dict(), card)
    return directory


def load_in_dtype(directory: Path, preset: str, options: dict, dtype: torch.dtype):
    """The model of ``directory`` built in ``dtype`` (whatever precision the directory holds)."""
    model, task = build(preset, options)
    model = model.to(dtype)
    load_into(model, read_state_dict(Path(directory) / "model.safetensors"))
    return model.eval(), task


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
