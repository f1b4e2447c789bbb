"""What a removal method computes once per model version, and what it is bound to.

A method's ``prepare`` returns a ``Prepared``: curvature, cached inputs, gradients computed from
the trained model and its training set D, independent of the samples a request removes. It holds
only where it was built, so it carries a ``Binding``: a digest of every parameter and buffer (names,
dtypes, shapes and bytes), of the training set's sample ids in order, the weight decay, the loss
and its options (label smoothing), the method and the settings fields the preparation reads. A
removal that is handed a state whose binding differs from the problem's rebuilds it (and says so in
its record); nothing prepared is ever used on other weights, data or settings.

``Prepared.after_removal`` returns the state of the version a removal produced where the maths
allows an update cheaper than a rebuild (e.g. cached frozen-prefix features of the retained set),
else None: the caller then prepares anew.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from torch import nn

if TYPE_CHECKING:
    from pipeline.data.sampleset import SampleSet
    from pipeline.tasks import Task

__all__ = ["Binding", "NothingPrepared", "Prepared", "content_digest", "digest_tensor", "state_digest"]


def content_digest() -> "xxhash.xxh3_128":
    """The hash every in-process binding of this package uses: XXH3-128, about 10 GB/s on one core (a model of 23M
    parameters hashes in about 10 ms, where BLAKE2b took about 0.15 s, several times per request). It tells whether a
    state, a kept row or a kept view was computed from these very weights and samples: every writer of those is this
    process's own code, so what it guards against is a mistake, not an adversary. Nothing published relies on it:
    versions, manifests and receipts are SHA-256."""
    return xxhash.xxh3_128()


def digest_tensor(h: "xxhash.xxh3_128", name: str, t: torch.Tensor) -> None:
    """Feed ``h`` the tensor's name, dtype, shape and bytes (read in place where the tensor is contiguous on the CPU)."""
    t = t.detach()
    h.update(f"{name}:{str(t.dtype)}:{tuple(t.shape)};".encode())
    if t.numel():
        h.update(memoryview(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))


def state_digest(model: nn.Module) -> str:
    """``content_digest`` of every parameter and buffer of ``model`` (names, dtypes, shapes, values)."""
    h = content_digest()
    for name, p in model.named_parameters():
        digest_tensor(h, "p." + name, p)
    for name, b in model.named_buffers():
        digest_tensor(h, "b." + name, b)
    return h.hexdigest()


def ids_digest(sample_ids: torch.Tensor) -> str:
    """``content_digest`` of the sample ids, in order."""
    h = content_digest()
    h.update(memoryview(sample_ids.to("cpu", torch.int64).contiguous().numpy()))
    return h.hexdigest()


@dataclass(frozen=True)
class Binding:
    """Exactly what a prepared state was computed from (see the module docstring)."""

    weights: str
    sample_ids: str
    weight_decay: float
    loss: str
    method: str
    settings: str

    @classmethod
    def of(cls, model: nn.Module, task: "Task", train: "SampleSet", weight_decay: float, method: str,
           settings: dict[str, Any]) -> "Binding":
        loss = {"loss": getattr(task, "loss", None), "options": getattr(task, "loss_options", {}) or {}}
        return cls(state_digest(model), ids_digest(train.sample_ids), float(weight_decay),
                   json.dumps(loss, sort_keys=True, default=str), method,
                   json.dumps(settings, sort_keys=True, default=str))

    def differences(self, other: "Binding") -> list[str]:
        """The fields in which ``other`` differs (what a stale state was built for)."""
        names = {"weights": "weights or buffers", "sample_ids": "training set", "weight_decay": "weight decay",
                 "loss": "loss or its options", "method": "method", "settings": "settings"}
        return [text for key, text in names.items() if getattr(self, key) != getattr(other, key)]


@dataclass
class Prepared:
    """A method's per-model-version state (subclasses add what they hold)."""

    binding: Binding
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    what = "nothing: this method computes everything it needs per request"

    def holds_for(self, binding: Binding) -> bool:
        return self.binding == binding

    def describe(self) -> dict[str, Any]:
        return {"what": self.what, "seconds": self.seconds, **self.details}

    def fresh_copy(self) -> "Prepared":
        """The state as ``prepare`` built it, without what removals computed into it on first use (a measurement of
        a cold request must not read another request's work); the state itself where nothing is computed so."""
        return self

    def after_removal(self, trained: Any, removed: torch.Tensor, outcome: Any, binding: Binding) -> "Prepared | None":
        """The state of the version a removal made (``trained``: that version, its model holding the
        new weights and its training set D \\ U; ``removed``: the positions of U in the old D;
        ``binding``: the new version's), where it can be updated more cheaply than rebuilt; None:
        prepare anew."""
        return None


class NothingPrepared(Prepared):
    """The preparation of a method that keeps nothing between requests."""

    def after_removal(self, trained: Any, removed: torch.Tensor, outcome: Any, binding: Binding) -> "Prepared | None":
        return NothingPrepared(binding, 0.0)
