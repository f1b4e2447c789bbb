"""Which weights a worker holds: a content fingerprint of a module's state, and the spec a
driver sends with every task so that a (re)started worker can tell whether it must reload.

Workers load a model version once from its directory. When the driver's in-memory model
differs (another dtype, or weights changed in memory), the driver puts its state into the
object store once and every task carries a ``WeightsSpec`` naming the expected fingerprint
and that object: a worker whose fingerprint differs - including one Ray just restarted after
a crash, which reloaded the directory - fetches the state and loads it before computing.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


def state_fingerprint(state: dict[str, Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def module_fingerprint(module: nn.Module) -> str:
    return state_fingerprint(module.state_dict())


def cpu_state(module: nn.Module) -> dict[str, Tensor]:
    """A detached CPU copy of the module's state dict (dtypes preserved)."""
    return {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}


@dataclass(frozen=True)
class WeightsSpec:
    """The weights a task must run on: ``fingerprint``, and where to fetch them when a worker
    holds others (``state_ref`` is a one-element list holding a Ray ObjectRef, so that Ray does
    not resolve it eagerly; empty when the model directory's own weights are meant)."""

    fingerprint: str
    state_ref: list[Any] = field(default_factory=list)


class StaleWeightsError(RuntimeError):
    """A worker holds other weights than a task asked for and no state was sent to fix it."""
