"""Frozen-prefix caching: a parameter block that lies in the last part of a model.

A removal moves only the parameters of its block P. When the model divides as f = s o g with
every parameter of P inside the suffix s, the prefix g is constant during the removal, so

    loss(f(x; w), y) = loss(s(g(x); w_P), y)

and every gradient, Hessian-vector product and objective value of the removal is the same
function of the cached prefix outputs g(x), computed once (one no-grad pass over D in eval
mode). The numbers are those of the full model (up to float rounding); the cost of each pass
drops from the whole network to its suffix: for an output layer over an MLP's hidden features,
from the network to one matrix product; for the last transformer layers of a text encoder, from
all its layers to those.

How a model divides is a ``Split`` found by the registered splitters (``SPLITTERS``): an
``nn.Sequential`` on dense inputs here (the suffix is the Sequential from the block's first
module on); Hugging Face encoders in ``pipeline.models.text``. A split's suffix is the model's own
module objects, with the block's parameters under the same qualified names, so a block, a gradient
or a prepared state means the same coordinates on the model and on the suffix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.tasks import Batch, Task

__all__ = ["PrefixCache", "SPLITTERS", "Split", "cache_frozen_prefix", "deterministic_prefix", "register_splitter",
           "split_for", "suffix_start"]


@dataclass(frozen=True)
class Split:
    """How a model divides at a block: ``prefix(model, batch)`` maps a batch of the model's inputs
    to the suffix's input columns (no grad, eval mode: the caller's); ``suffix_of(model)`` gives the
    modules from the split on (the model's own objects, the block under the same names); ``task``
    reads those columns (the model's loss and its options); ``consumed``: the batch columns the
    prefix outputs replace, ``cached``: the columns it writes; ``start`` names the split point (a
    module index or a layer's name)."""

    start: int | str
    prefix: Callable[[nn.Module, Batch], Batch]
    suffix_of: Callable[[nn.Module], nn.Module]
    task: Task
    consumed: tuple[str, ...]
    cached: tuple[str, ...] = ("x",)


Splitter = Callable[[nn.Module, Task, ParamBlock], "Split | None"]
SPLITTERS: list[Splitter] = []


def register_splitter(fn: Splitter) -> Splitter:
    SPLITTERS.append(fn)
    return fn


def split_for(model: nn.Module, task: Task, block: ParamBlock) -> Split | None:
    """The first registered split of ``model`` whose suffix holds the whole block (None: none)."""
    for splitter in SPLITTERS:
        split = splitter(model, task, block)
        if split is not None:
            return split
    return None


def suffix_start(model: nn.Module, block: ParamBlock) -> int | None:
    """Index of the first module of ``model`` (a Sequential) that holds a block parameter, or
    None when the model is not a Sequential or the block starts in its first module."""
    if not isinstance(model, nn.Sequential):
        return None
    keys = list(model._modules)
    first = min(keys.index(part.name.split(".", 1)[0]) for part in block.parts)
    return first if first > 0 else None


@register_splitter
def sequential_split(model: nn.Module, task: Task, block: ParamBlock) -> Split | None:
    """An ``nn.Sequential`` on dense inputs: the suffix starts at the block's first module."""
    if getattr(task, "kind", None) != "dense":
        return None
    start = suffix_start(model, block)
    if start is None:
        return None

    def prefix(m: nn.Module, batch: Batch) -> Batch:
        return {"x": m[:start](batch["x"])}

    return Split(start, prefix, lambda m: m[start:], task, ("x",))


@dataclass
class PrefixCache:
    split: Split
    suffix: nn.Module       # the model's suffix modules (parameters shared with the model)
    train: SampleSet        # D with the prefix's outputs in place of the consumed columns
    seconds: float          # wall time of the caching pass

    @property
    def start(self) -> int | str:
        return self.split.start

    @property
    def task(self) -> Task:
        return self.split.task

    def suffix_of(self, model: nn.Module) -> nn.Module:
        """The same split's suffix of ``model`` (another version of the same architecture)."""
        return self.split.suffix_of(model)

    def describe(self) -> dict[str, Any]:
        cached = {k: self.train.columns[k] for k in self.split.cached}
        return {"suffix_start_module": self.start, "suffix_modules": [type(m).__name__ for m in self.suffix.children()],
                "cached_input_shape": {k: list(v.shape) for k, v in cached.items()},
                "cached_bytes": int(sum(v.numel() * v.element_size() for v in cached.values()))}


_RANDOM_IN_TRAINING = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                       nn.modules.batchnorm._BatchNorm)


def deterministic_prefix(model: nn.Module, task: Task, block: ParamBlock) -> bool:
    """True when ``model`` splits before ``block`` and its prefix computes the same in train mode as
    in eval mode: no dropout with p > 0 and no batch-norm (whose statistics move in training), so its
    outputs can stand for it at every step of training too."""
    split = split_for(model, task, block)
    if split is None:
        return False
    inside = {id(m) for m in split.suffix_of(model).modules()}
    prefix = [m for m in model.modules() if id(m) not in inside]
    for module in prefix:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return False
        if isinstance(module, _RANDOM_IN_TRAINING) and getattr(module, "p", 0.0) > 0:
            return False
    return True


@torch.no_grad()
def prefix_outputs(split: Split, model: nn.Module, task: Task, data: SampleSet, batch_size: int) -> SampleSet:
    """``data`` with the split's prefix outputs in place of the columns it consumes (the other
    columns, labels and ids kept); ``batch_size`` lowered to fit the memory budget."""
    batch_size = memory.forward_batch_size(model, task, data, batch_size)  # the whole model's pass bounds the prefix's
    outputs: dict[str, list[Tensor]] = {}
    for batch in data.batches(batch_size):
        for key, value in split.prefix(model, batch).items():
            outputs.setdefault(key, []).append(value.detach())
    columns = {k: v for k, v in data.columns.items() if k not in split.consumed}
    columns.update({k: torch.cat(v) for k, v in outputs.items()})
    return SampleSet(columns, data.sample_ids)


def cache_frozen_prefix(model: nn.Module, task: Task, train: SampleSet, block: ParamBlock,
                        batch_size: int) -> PrefixCache | None:
    """The suffix and D with cached prefix outputs, or None when no split applies (the block
    starts at the model's first layer, or no splitter knows the architecture). The caller holds
    the model in eval mode; the prefix must hold no parameter of the block (by construction) and is
    never modified. ``batch_size`` is lowered to fit the memory budget."""
    split = split_for(model, task, block)
    if split is None:
        return None
    started = time.perf_counter()
    cached = prefix_outputs(split, model, task, train, batch_size)
    return PrefixCache(split, split.suffix_of(model), cached, time.perf_counter() - started)
