"""Frozen-prefix caching: a parameter block that lies in the trailing modules of a Sequential.

A removal moves only the parameters of its block P. When the model is an ``nn.Sequential``
f = f_K o ... o f_1 on dense inputs and every parameter of P lies in the modules f_k..f_K, the
prefix g = f_{k-1} o ... o f_1 is constant during the removal, so

    loss(f(x; w), y) = loss(s(g(x); w_P), y),        s = f_K o ... o f_k

and every gradient, Hessian-vector product and objective value of the removal is the same
function of the cached inputs g(x), computed once (one no-grad pass over D in eval mode).
The numbers are those of the full model (up to float rounding); the cost of each pass drops
from the whole network to its suffix: for an output layer over an MLP's hidden features,
from the network to one matrix product.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline import memory
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.tasks import Task

__all__ = ["PrefixCache", "suffix_start", "cache_frozen_prefix"]


@dataclass
class PrefixCache:
    start: int              # index of the suffix's first module in the Sequential
    suffix: nn.Sequential   # the same module objects (parameters shared with the model)
    train: SampleSet        # D with "x" replaced by the prefix's outputs
    seconds: float          # wall time of the caching pass

    def describe(self) -> dict[str, Any]:
        x = self.train.columns["x"]
        return {"suffix_start_module": self.start, "suffix_modules": [type(m).__name__ for m in self.suffix],
                "cached_input_shape": list(x.shape), "cached_bytes": int(x.numel() * x.element_size())}


def suffix_start(model: nn.Module, block: ParamBlock) -> int | None:
    """Index of the first module of ``model`` (a Sequential) that holds a block parameter, or
    None when the model is not a Sequential or the block starts in its first module."""
    if not isinstance(model, nn.Sequential):
        return None
    keys = list(model._modules)
    first = min(keys.index(part.name.split(".", 1)[0]) for part in block.parts)
    return first if first > 0 else None


@torch.no_grad()
def cache_frozen_prefix(model: nn.Module, task: Task, train: SampleSet, block: ParamBlock,
                        batch_size: int) -> PrefixCache | None:
    """The suffix and D with cached prefix outputs, or None when the shortcut does not apply
    (not a Sequential on dense inputs, or nothing before the block). The caller holds the
    model in eval mode; the prefix must have no trainable parameter in the block (by
    construction) and is never modified. ``batch_size`` is lowered to fit the memory budget."""
    if getattr(task, "kind", None) != "dense" or "x" not in train.columns:
        return None
    start = suffix_start(model, block)
    if start is None:
        return None
    assert isinstance(model, nn.Sequential)
    prefix, suffix = model[:start], model[start:]
    started = time.perf_counter()
    batch_size = memory.forward_batch_size(model, task, train, batch_size)  # the whole model's pass bounds the prefix's
    outputs = [prefix(batch["x"]) for batch in train.batches(batch_size)]
    cached = SampleSet({**train.columns, "x": torch.cat(outputs)}, train.sample_ids)
    return PrefixCache(start, suffix, cached, time.perf_counter() - started)
