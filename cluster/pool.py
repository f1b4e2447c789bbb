"""A pool of ``ModelWorker`` actors for one model directory, and fault-tolerant dispatch.

Two layers of recovery, so that a shard's result never depends on a crash:
  1. Ray's: actors are created with ``max_restarts`` and ``max_task_retries``; a worker
     process that dies mid-task is restarted (reloading the model directory) and the task is
     run again. Tasks are self-contained (see ``cluster.worker``), so the retry is exact.
  2. The driver's: when an actor is gone for good (restarts exhausted, node lost), ``map``
     replaces it with a fresh actor and resubmits the call, up to ``max_call_attempts``.

``map`` runs a list of calls either *pinned* (call i on worker i mod W, all submitted at once:
the worker keeps state for it, e.g. a data shard) or *dynamic* (each idle worker takes the
next call: load balancing for probe shards). Results come back in call order.
"""
from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from torch import nn

from cluster.errors import PoolError
from cluster.runtime import RayRuntime, worker_resources
from cluster.weights import WeightsSpec, cpu_state, module_fingerprint
from cluster.worker import FaultPlan, ModelWorker

ACTOR_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(frozen=True)
class Call:
    """One remote method call: ``method`` of a worker with ``args`` / ``kwargs``."""

    method: str
    args: tuple = ()
    kwargs: dict | None = None


class WorkerPool:
    """``workers`` actors, each holding the model of ``model_dir`` once.

    ``resources``: Ray options of one actor (default: one GPU each when the cluster has GPUs,
    else one CPU). ``fault``: test hook passed to every actor (``cluster.worker.FaultPlan``).
    """

    def __init__(
        self, model_dir: str | Path, *, workers: int | None = None, runtime: RayRuntime | None = None,
        resources: dict[str, float] | None = None, max_restarts: int = 2, max_call_attempts: int = 3,
        ready_timeout_s: float = 180.0, fault: FaultPlan | None = None,
    ):
        if not ray.is_initialized():
            raise PoolError("Ray is not initialised: call cluster.runtime.connect() before building a WorkerPool")
        model_dir = Path(model_dir).resolve()
        if not (model_dir / "model.json").exists():
            raise PoolError(f"{model_dir} is not a model directory (model.json missing): pass the directory "
                            "written by `unlearn train` / write_model_dir")
        self.model_dir = str(model_dir)
        cluster = ray.cluster_resources()
        gpus = float(cluster.get("GPU", 0.0))
        self.resources = dict(resources) if resources is not None else worker_resources(gpus)
        if workers is None:
            workers = max(1, int(gpus) if gpus >= 1 else int(cluster.get("CPU", 1)))
        if workers < 1:
            raise PoolError(f"workers must be >= 1, got {workers}")
        need_cpu = workers * float(self.resources.get("num_cpus", 0))
        need_gpu = workers * float(self.resources.get("num_gpus", 0))
        if runtime is not None and runtime.owned and (need_cpu > cluster.get("CPU", 0) or need_gpu > gpus):
            raise PoolError(
                f"{workers} workers need {need_cpu:g} CPUs and {need_gpu:g} GPUs but this local Ray has "
                f"{cluster.get('CPU', 0):g} CPUs and {gpus:g} GPUs: lower --workers to "
                f"{int(cluster.get('CPU', 0) // max(self.resources.get('num_cpus', 1), 1e-9))} or connect to a "
                "cluster with --address")
        self.max_restarts, self.max_call_attempts = max_restarts, max_call_attempts
        self.fault = fault
        self.id = uuid.uuid4().hex[:8]
        self._actor_cls = ray.remote(ModelWorker)
        self.actors: list[Any] = [self._spawn() for _ in range(workers)]
        self.replacements = 0
        self.describe = self._wait_ready(ready_timeout_s)
        # the most workers on one machine: each gets that share of a memory budget
        # (memory.worker_budget), so workers that share a machine's memory stay inside one budget
        nodes = Counter(d.get("node") for d in self.describe)
        self.sharing = max(nodes.values()) if nodes else 1
        self._state_ref: Any = None
        self._state_fingerprint: str | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def _spawn(self) -> Any:
        return self._actor_cls.options(
            max_restarts=self.max_restarts, max_task_retries=self.max_restarts, **self.resources,
        ).remote(self.model_dir, self.fault)

    def _wait_ready(self, timeout: float) -> list[dict]:
        refs = [a.describe.remote() for a in self.actors]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            self.close()
            raise PoolError(
                f"only {len(ready)} of {len(refs)} workers started within {timeout:.0f} s (each needs "
                f"{self.resources}): lower --workers or add nodes/resources to the cluster")
        try:
            return ray.get(refs)
        except (RayTaskError, *ACTOR_LOST) as err:
            self.close()
            raise PoolError(f"a worker could not load the model directory {self.model_dir} (it must exist at "
                            f"that path on every node): {err}") from err

    @property
    def size(self) -> int:
        return len(self.actors)

    def close(self) -> None:
        """Kill the actors (idempotent)."""
        for a in getattr(self, "actors", []):
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        self._state_ref = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- weights ------------------------------------------------------------------------------
    def weights_for(self, model: nn.Module | None) -> WeightsSpec:
        """The spec of ``model``'s weights for tasks; puts its state in the object store once
        when the workers' directory weights differ from it. ``None``: the directory's weights."""
        base = self.describe[0]["fingerprint"]
        if model is None:
            return WeightsSpec(base)
        fp = module_fingerprint(model)
        if fp == base:
            return WeightsSpec(fp)
        if fp != self._state_fingerprint:
            self._state_ref = ray.put(cpu_state(model))
            self._state_fingerprint = fp
        return WeightsSpec(fp, [self._state_ref])

    def check_task(self, task: Any) -> None:
        """The workers built the task from the model card; refuse a driver whose task differs."""
        if repr(task) != self.describe[0]["task"]:
            raise PoolError(
                f"the workers' task ({self.describe[0]['task']}) differs from the driver's ({task!r}): "
                "the pool must be built on the same model directory the removal loaded")

    # -- dispatch -------------------------------------------------------------------------------
    def _submit(self, worker: int, call: Call) -> Any:
        method = getattr(self.actors[worker], call.method)
        return method.remote(*call.args, **(call.kwargs or {}))

    def _replace(self, worker: int) -> None:
        try:
            ray.kill(self.actors[worker], no_restart=True)
        except Exception:
            pass
        self.actors[worker] = self._spawn()
        self.replacements += 1
        # where the new actor runs is not known without waiting for it: from now on every worker
        # takes the smallest share a machine could ask of the budget (all workers on one machine)
        self.sharing = self.size

    def map(self, calls: Sequence[Call], *, pinned: bool = False, timeout_s: float | None = None,
            on_done: Callable[[int], None] | None = None) -> list[Any]:
        """Run ``calls``; results in call order. See the module docstring for pinned/dynamic.
        ``on_done(i)`` is called as call ``i``'s result arrives (progress display)."""
        results: list[Any] = [None] * len(calls)
        attempts = [0] * len(calls)
        queue = list(range(len(calls)))
        inflight: dict[Any, tuple[int, int, Any]] = {}  # ref -> (call index, worker, actor)
        busy: set[int] = set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def launch(i: int, worker: int) -> None:
            attempts[i] += 1
            inflight[self._submit(worker, calls[i])] = (i, worker, self.actors[worker])
            busy.add(worker)

        if pinned:
            for i in queue:
                launch(i, i % self.size)
            queue = []
        while inflight or queue:
            if not pinned:
                for w in range(self.size):
                    if queue and w not in busy:
                        launch(queue.pop(0), w)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=left)
            if not done:
                raise PoolError(f"pool calls did not finish within {timeout_s} s")
            ref = done[0]
            i, worker, actor = inflight.pop(ref)
            if not pinned:
                busy.discard(worker)
            try:
                results[i] = ray.get(ref)
                if on_done is not None:
                    on_done(i)
            except ACTOR_LOST as err:
                if attempts[i] >= self.max_call_attempts:
                    raise PoolError(
                        f"call {i} ({calls[i].method}) failed {attempts[i]} times because its worker died: "
                        f"{err}") from err
                if self.actors[worker] is actor:  # not yet replaced by another failed call
                    self._replace(worker)
                if pinned:
                    launch(i, worker)
                else:
                    queue.insert(0, i)
            except RayTaskError as err:
                raise err.as_instanceof_cause() from None
            except GetTimeoutError as err:  # pragma: no cover - ray.wait said it was ready
                raise PoolError(str(err)) from err
        return results
