"""The worker process behind every pool: one Ray actor holding one model version.

A ``ModelWorker`` loads the model directory once (``load_model_dir``) onto its device (the GPU
Ray assigned it, else the CPU), then serves shards of work on it:
  - ``probe``: rows [start, stop) of the perturbation probe (``pipeline.probe.run_probe``),
    returned as numpy arrays;
  - ``hessian_matvec`` / ``hessian_matmat``: Hessian-vector products of the block objective
    on its data shard (``pipeline.curvature.BlockHessian`` per batch), returned as numpy.

Every task is self-contained: it carries a ``WeightsSpec`` and, for products, object refs of
its data shard and block; the worker caches what it has been sent (keyed by the operator id)
and rebuilds it when needed. So a worker that Ray restarts after a crash (``max_restarts``)
can take the retried task (``max_task_retries``) and return exactly the same numbers.

``FaultPlan`` is a test hook: the worker exits hard (``os._exit(1)``) on the first attempt of
one probe shard or product call, recorded by creating a marker file, so that the retry runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from cluster.weights import StaleWeightsError, WeightsSpec, module_fingerprint
from pipeline import memory


@dataclass(frozen=True)
class FaultPlan:
    """Exit on the first attempt of probe shard ``probe_shard`` (or of the ``product_call``-th
    product call on this worker, counted from 0), remembered through ``marker`` (a file path
    created exclusively: the crash happens only while it does not exist yet)."""

    marker: str
    probe_shard: int | None = None
    product_call: int | None = None

    def trip(self) -> None:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        os._exit(1)


def _columns_to_torch(columns: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    # Arrays from the object store are read-only views: copy once into owned tensors.
    return {k: torch.from_numpy(np.array(v, copy=True)).to(device) for k, v in columns.items()}


class ModelWorker:
    """See the module docstring. Constructed by ``cluster.pool.WorkerPool`` as a Ray actor."""

    def __init__(self, model_dir: str, fault: FaultPlan | None = None):
        from pipeline.models.card import load_model_dir

        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        self.device = torch.device("cuda") if gpu_ids and torch.cuda.is_available() else torch.device("cpu")
        model, task, _card = load_model_dir(model_dir)
        self.model = model.to(self.device).eval()
        self.task = task
        self.model_dir = model_dir
        self.fault = fault
        self._fingerprint = module_fingerprint(self.model)
        self._slice_map = None
        self._operators: dict[str, list[Any]] = {}
        self._product_calls = 0

    # -- identity and weights -------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(), "device": str(self.device), "threads": torch.get_num_threads(),
            "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local",
            "fingerprint": self._fingerprint, "task": repr(self.task),
            "dtype": str(next(self.model.parameters()).dtype),
        }

    def _ensure_weights(self, spec: WeightsSpec) -> None:
        if spec.fingerprint == self._fingerprint:
            return
        if not spec.state_ref:
            raise StaleWeightsError(
                f"worker pid {os.getpid()} holds weights {self._fingerprint[:12]} (from {self.model_dir}) "
                f"but the task asks for {spec.fingerprint[:12]} and sent no state to load")
        state = ray.get(spec.state_ref[0])
        self.model.load_state_dict(state, strict=True, assign=True)
        self.model = self.model.to(self.device).eval()
        self._fingerprint = module_fingerprint(self.model)
        self._slice_map = None
        self._operators.clear()  # operators captured the old parameters
        if self._fingerprint != spec.fingerprint:
            raise StaleWeightsError("the state sent by the driver does not have the fingerprint it announced")

    # -- probe ------------------------------------------------------------------------------
    def probe(
        self, shard: int, weights: WeightsSpec, forget: dict[str, np.ndarray], *, seed: int, start: int,
        stop: int, pass_size: int, perturb_options: dict[str, Any], memory_budget: int | None = None,
        budget_sharing: int = 1,
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """Rows [start, stop) of the probe: (start, activations float32, losses float64), its
        passes sized from ``memory_budget`` bytes (None: this machine's ``auto`` budget), split
        with the ``budget_sharing`` workers that share this machine (``memory.worker_budget``)."""
        from pipeline.probe import SliceMap, run_probe

        self._ensure_weights(weights)
        if self.fault is not None and self.fault.probe_shard == shard:
            self.fault.trip()
        if self._slice_map is None:
            self._slice_map = SliceMap(self.model)
        batch = _columns_to_torch(forget, self.device)
        with memory.use_budget(memory.worker_budget(memory_budget, budget_sharing, self.device)):
            result = run_probe(self.model, self.task, batch, seed=seed, start=start, stop=stop,
                               pass_size=pass_size, perturb_options=perturb_options, slice_map=self._slice_map)
        return start, result.activations.numpy(), result.losses.numpy()

    # -- Hessian-vector products on a data shard ----------------------------------------------
    def _operators_for(self, key: str, weights: WeightsSpec, spec: list[Any]) -> list[Any]:
        """Per-batch BlockHessian operators (sum reduction, no ridge) of this shard, their chunks
        sized from the budget in ``spec`` (bytes, or None: this machine's ``auto`` budget, split
        with the workers that share this machine: ``memory.worker_budget``)."""
        from pipeline.curvature import BlockHessian
        from pipeline.data.sampleset import SampleSet

        self._ensure_weights(weights)
        if key not in self._operators:
            data_ref, block_ref, batch_size, columns_per_pass, memory_budget, sharing = spec
            budget = memory.worker_budget(memory_budget, sharing, self.device)
            columns, ids = ray.get(data_ref)
            block = ray.get(block_ref)
            shard = SampleSet(_columns_to_torch(columns, self.device), torch.from_numpy(np.array(ids, copy=True)))
            ops = []
            with memory.use_budget(budget):  # each operator sizes its passes from it, when built
                for start in range(0, len(shard), batch_size):
                    part = shard.take(torch.arange(start, min(len(shard), start + batch_size)))
                    ops.append(BlockHessian(self.model, self.task, part, block, 0.0, reduction="sum",
                                            batch_size=batch_size, columns_per_pass=columns_per_pass))
            self._operators[key] = ops
        return self._operators[key]

    def _maybe_fail_product(self) -> None:
        call = self._product_calls
        self._product_calls += 1
        if self.fault is not None and self.fault.product_call == call:
            self.fault.trip()

    def hessian_matvec(self, key: str, weights: WeightsSpec, spec: list[Any], v: np.ndarray,
                       per_batch: bool) -> np.ndarray:
        """sum_{z in shard} H_P(z) v (no ridge); per batch (rows) when ``per_batch``."""
        ops = self._operators_for(key, weights, spec)
        self._maybe_fail_product()
        vt = torch.from_numpy(np.array(v, copy=True))
        parts = [op.matvec(vt) for op in ops]
        return _reduce(parts, per_batch)

    def hessian_matmat(self, key: str, weights: WeightsSpec, spec: list[Any], columns: np.ndarray,
                       per_batch: bool) -> np.ndarray:
        """sum_{z in shard} H_P(z) C for a (dim x k) matrix C; per batch when ``per_batch``."""
        ops = self._operators_for(key, weights, spec)
        self._maybe_fail_product()
        ct = torch.from_numpy(np.array(columns, copy=True))
        parts = [op.matmat(ct) for op in ops]
        return _reduce(parts, per_batch)

    def release(self, key: str) -> None:
        self._operators.pop(key, None)


def _reduce(parts: list[torch.Tensor], per_batch: bool) -> np.ndarray:
    if per_batch:
        return torch.stack(parts).numpy()
    total = torch.zeros_like(parts[0])
    for p in parts:
        total += p
    return total.numpy()
