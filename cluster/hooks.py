"""Wiring the Ray pools into a removal: ``ray_removal_hooks`` yields the keyword arguments
(``probe_runner``, ``curvature_factory``) that ``pipeline.removal.remove`` takes, backed by
one pool of workers that each load the model directory once.

Used by ``unlearn forget --workers N [--address ...]``; inside ``ray job submit`` the job's
``RAY_ADDRESS`` is picked up, so the pool lands on the cluster that runs the job.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


@dataclass(frozen=True)
class ClusterOptions:
    """Where the distributed stages run: ``address`` (None: RAY_ADDRESS or a local Ray) and
    ``workers`` (None: one per GPU, else one per CPU of the cluster)."""

    address: str | None = None
    workers: int | None = None
    shards_per_worker: int = 1


@contextlib.contextmanager
def ray_removal_hooks(model_dir: str | Path, options: ClusterOptions) -> Iterator[dict[str, Any]]:
    """Start/connect Ray, build a worker pool on ``model_dir``; yield the removal hooks plus a
    ``describe`` callable for the record. Everything started here is stopped on exit."""
    from cluster.curvature_pool import RayCurvatureFactory
    from cluster.pool import WorkerPool
    from cluster.probe_pool import RayProbeRunner
    from cluster.runtime import ray_runtime

    with ray_runtime(options.address) as rt, WorkerPool(model_dir, workers=options.workers, runtime=rt) as pool:
        probe = RayProbeRunner(pool, shards_per_worker=options.shards_per_worker)
        curvature = RayCurvatureFactory(pool)

        def describe() -> dict[str, Any]:
            return {
                "runtime": "ray", "address": rt.address or "local", "workers": pool.size,
                "devices": sorted({d["device"] for d in pool.describe}), "probe": probe.last,
                "worker_replacements": pool.replacements,
                "curvature_products": sum(op.products for op in curvature.operators),
            }

        try:
            yield {"probe_runner": probe, "curvature_factory": curvature, "describe": describe}
        finally:
            curvature.close()
