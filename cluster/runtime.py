"""The Ray runtime: connect to a cluster when an address is given, else start Ray inside
this process, bound to the loopback interface.

Address resolution, first match wins:
  1. the ``address`` argument (``--address`` on the command line): ``ray://host:10001``,
     ``host:port`` of a GCS, or ``auto``;
  2. the ``RAY_ADDRESS`` environment variable (set by ``ray job submit`` for job drivers);
  3. none: a local instance is started in this process (``num_cpus`` from the machine,
     no dashboard, every listener on 127.0.0.1, temp dir under ``UNLEARN_RAY_TEMP_DIR``,
     ``RAY_TMPDIR`` or /tmp, token auth off - ``RAY_AUTH_MODE=disabled`` unless set - since
     nothing outside this machine can reach it) and shut down by ``RayRuntime.close``.

Loopback: Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported; with it set to
0 the node's address is 127.0.0.1 and no listener is reachable from other machines. This module
sets it (unless the user chose a value) *before* importing Ray, and also passes
``_node_ip_address=127.0.0.1`` when it starts the local instance.

Workers: one GPU each when the cluster has GPUs, one CPU each otherwise (``worker_resources``).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from cluster.errors import RuntimeConfigError  # noqa: E402

LOOPBACK = "127.0.0.1"
DEFAULT_OBJECT_STORE_BYTES = 2 * 2**30


def machine_cpus() -> int:
    """CPUs this process may use (the affinity mask, not the host's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def default_temp_dir() -> Path:
    """Short (Unix socket paths are limited to ~107 bytes) and per user."""
    base = os.environ.get("UNLEARN_RAY_TEMP_DIR") or os.environ.get("RAY_TMPDIR")
    if base:
        return Path(base)
    return Path(tempfile.gettempdir()) / f"unlearn-ray-{os.getuid()}"


def resolve_address(address: str | None) -> str | None:
    """The explicit address, else RAY_ADDRESS, else None (start locally)."""
    chosen = address or os.environ.get("RAY_ADDRESS") or None
    if chosen is not None and not chosen.strip():
        return None
    return chosen


@dataclass
class RayRuntime:
    """A connection to Ray; ``owned`` says whether this process started (and must stop) it."""

    address: str | None
    owned: bool
    cpus: float
    gpus: float
    temp_dir: str | None = None

    def close(self) -> None:
        """Disconnect; a local instance started here is shut down with it."""
        if ray.is_initialized():
            ray.shutdown()

    def worker_resources(self) -> dict[str, float]:
        """Ray resources of one worker actor: a whole GPU when the cluster has any, else a CPU."""
        return worker_resources(self.gpus)

    def default_workers(self) -> int:
        """One worker per GPU, else one per CPU."""
        return max(1, int(self.gpus) if self.gpus >= 1 else int(self.cpus))


def worker_resources(cluster_gpus: float) -> dict[str, float]:
    if cluster_gpus >= 1:
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": 1, "num_gpus": 0}


def _cluster_totals() -> tuple[float, float]:
    res = ray.cluster_resources()
    return float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0))


def connect(
    address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None,
    object_store_memory: int | None = None, temp_dir: str | Path | None = None,
    runtime_env: dict[str, Any] | None = None, namespace: str | None = None,
    log_to_driver: bool = True,
) -> RayRuntime:
    """Connect to Ray (see the module docstring). An already initialised Ray in this process
    is reused as is (``owned=False``): nothing here restarts or stops someone else's Ray."""
    if ray.is_initialized():
        cpus, gpus = _cluster_totals()
        return RayRuntime(address=None, owned=False, cpus=cpus, gpus=gpus)
    resolved = resolve_address(address)
    if resolved is not None:
        if num_cpus is not None or num_gpus is not None or object_store_memory is not None:
            raise RuntimeConfigError(
                f"connecting to the cluster at {resolved!r}: num_cpus / num_gpus / object_store_memory "
                "belong to the cluster's own `ray start`; drop them, or drop the address to start locally")
        ray.init(address=resolved, runtime_env=runtime_env, namespace=namespace,
                 log_to_driver=log_to_driver, configure_logging=False)
        cpus, gpus = _cluster_totals()
        return RayRuntime(address=resolved, owned=False, cpus=cpus, gpus=gpus)
    tmp = Path(temp_dir) if temp_dir is not None else default_temp_dir()
    tmp.mkdir(parents=True, exist_ok=True)
    if len(str(tmp)) > 45:
        raise RuntimeConfigError(
            f"the Ray temp dir {tmp} is too long for Ray's Unix sockets: set UNLEARN_RAY_TEMP_DIR "
            "(or RAY_TMPDIR) to a short path such as /tmp/unlearn-ray")
    cpus = num_cpus if num_cpus is not None else machine_cpus()
    # A loopback-only instance owned by this process: no token file is written to ~/.ray.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=cpus, num_gpus=num_gpus, include_dashboard=False,
        object_store_memory=object_store_memory or DEFAULT_OBJECT_STORE_BYTES,
        _temp_dir=str(tmp), _node_ip_address=LOOPBACK, runtime_env=runtime_env,
        namespace=namespace, log_to_driver=log_to_driver, configure_logging=False,
    )
    total_cpus, gpus = _cluster_totals()
    return RayRuntime(address=None, owned=True, cpus=total_cpus, gpus=gpus, temp_dir=str(tmp))


@contextlib.contextmanager
def ray_runtime(address: str | None = None, **options: Any) -> Iterator[RayRuntime]:
    """``connect`` for the duration of a ``with`` block; stops Ray only if it was started
    (or connected) here, never a Ray the caller had already initialised."""
    was_up = ray.is_initialized()
    rt = connect(address, **options)
    try:
        yield rt
    finally:
        if not was_up:
            rt.close()
