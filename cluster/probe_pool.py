"""The probe sharded over a ``WorkerPool``: contiguous blocks of perturbations, aligned to
``pass_size``, run on the workers and gathered in order on the driver.

Because ``pipeline.probe.run_probe`` draws perturbation p from its own generator and cuts
passes at absolute multiples of ``pass_size``, a shard [start, stop) with ``start`` a multiple
of ``pass_size`` yields exactly the rows the whole run yields there: the gathered matrix is
bit-identical whatever the number of workers (and to the in-process run on the same device
and thread count). A worker that dies mid-shard is restarted or replaced and the shard rerun.
Each shard sizes its passes from the removal's memory budget when one is set
(``memory.forwarded``), else from the worker's own ``auto`` budget; workers that share a machine
split it (``WorkerPool.sharing``, ``memory.worker_budget``).

``RayProbeRunner`` satisfies ``pipeline.methods.base.ProbeRunner`` (``RemovalProblem.probe_runner``).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from cluster.pool import Call, WorkerPool
from cluster.shards import aligned_ranges
from pipeline import memory
from pipeline.probe import ProbeResult, gather
from pipeline.progress import tick
from pipeline.tasks import PerturbOptions


def forget_to_numpy(forget: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu").numpy() for k, v in forget.items()}


class RayProbeRunner:
    """``probe_runner`` for ``RemovalProblem``: (model, task, forget, *, seed, perturbations,
    pass_size, perturb_options) -> ProbeResult, computed by ``pool``'s workers.

    ``shards_per_worker`` > 1 balances load when workers run at different speeds; each shard
    is still a whole number of passes. ``last`` keeps the timing and layout of the last call.
    """

    def __init__(self, pool: WorkerPool, *, shards_per_worker: int = 1):
        if shards_per_worker < 1:
            raise ValueError(f"shards_per_worker must be >= 1, got {shards_per_worker}")
        self.pool = pool
        self.shards_per_worker = shards_per_worker
        self.last: dict[str, Any] = {}

    def __call__(
        self, model: nn.Module | None, task: Any, forget: dict[str, torch.Tensor], *, seed: int,
        perturbations: int, pass_size: int, perturb_options: PerturbOptions | None = None,
    ) -> ProbeResult:
        t0 = time.perf_counter()
        if task is not None:
            self.pool.check_task(task)
        weights = self.pool.weights_for(model)
        ranges = aligned_ranges(perturbations, pass_size, self.pool.size * self.shards_per_worker, "perturbations")
        forget_ref = ray.put(forget_to_numpy(forget))
        calls = [
            Call("probe", (k, weights, forget_ref),
                 {"seed": seed, "start": a, "stop": b, "pass_size": pass_size,
                  "perturb_options": dict(perturb_options or PerturbOptions()),
                  "memory_budget": memory.forwarded(), "budget_sharing": self.pool.sharing})
            for k, (a, b) in enumerate(ranges)
        ]
        outputs = self.pool.map(calls, pinned=False, on_done=lambda i: tick(
            ranges[i][1] - ranges[i][0], total=perturbations, phase="perturbation passes on Ray", unit="perturbation"))
        results = [
            ProbeResult(torch.from_numpy(np.array(acts, copy=True)), torch.from_numpy(np.array(losses, copy=True)), start)
            for start, acts, losses in outputs
        ]
        merged = gather(results)
        if merged.losses.shape[0] != perturbations:
            raise RuntimeError(f"the shards returned {merged.losses.shape[0]} rows, expected {perturbations}")
        self.last = {"shards": ranges, "workers": self.pool.size, "seconds": time.perf_counter() - t0,
                     "replacements": self.pool.replacements}
        return merged
