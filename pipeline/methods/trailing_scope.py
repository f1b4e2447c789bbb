"""The trailing part of a network by forward cost: the scope of ``block-gauss-newton`` and ``suffix-retrain``.

Forward cost: multiply-accumulates counted by forward hooks on one batch (a Linear out.numel x in_features, a Conv
out.numel x in_channels / groups x kernel size; other modules count nothing). The scope is the largest trailing
part that a registered splitter (``pipeline.frozen_prefix``: nn.Sequential, ``vggface``, ``reid-resnet50``, the text
presets) divides off and whose cost is at most a given share of the whole forward pass; share 1: the whole model.
The scope's inputs on D (the prefix's outputs, computed once per model version and carried to the next while the
prefix does not move) are what both methods prepare: ``scope_inputs`` and ``carried_inputs``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.frozen_prefix import Split, cache_frozen_prefix, cached_bytes_per_sample, prefix_digest
from pipeline.memory import MemoryBudgetError
from pipeline.methods.prefix_prepared import over_half_budget
from pipeline.param_block import ParamBlock
from pipeline.tasks import Task, output_logits

__all__ = ["Scope", "ScopeInputs", "carried_inputs", "check_prefix_budget", "choose_scope", "forward_costs",
           "scope_inputs"]


def _macs(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> int:
    out = output_logits(output) if not isinstance(output, Tensor) else output
    if not isinstance(out, Tensor):
        return 0
    if isinstance(module, nn.Linear):
        return int(out.numel()) * module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return int(out.numel()) * (module.in_channels // module.groups) * math.prod(module.kernel_size)
    return 0


def forward_costs(model: nn.Module, task: Task, data: SampleSet, samples: int = 2) -> list[tuple[str, nn.Module, int]]:
    """(qualified name, module, multiply-accumulates on ``samples`` samples) of every leaf module, in the
    order of its first call in the forward pass (modules never called are left out)."""
    names = {id(m): n for n, m in model.named_modules()}
    calls: dict[int, tuple[str, nn.Module, int]] = {}

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if id(module) not in calls:
            calls[id(module)] = (names.get(id(module), ""), module, _macs(module, inputs, output))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            batch = next(data.take(torch.arange(min(samples, len(data)))).batches(samples))
            task.forward(model, batch)
    finally:
        for h in handles:
            h.remove()
    return list(calls.values())


@dataclass
class Scope:
    """Where the model divides (``split`` None: the whole model), the block of the suffix's trainable
    parameters (the model's qualified names), and what the choice rested on."""

    split: Split | None
    block: ParamBlock
    details: dict[str, Any]


def choose_scope(model: nn.Module, task: Task, data: SampleSet, share: float) -> Scope:
    """The largest trailing part of ``model`` that a registered splitter divides off and whose forward cost
    is at most ``share`` of the whole (the smallest part that splits, recorded, when none is that cheap)."""
    from pipeline.frozen_prefix import split_for

    costs = forward_costs(model, task, data)
    total = sum(c for _, _, c in costs) or 1
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        raise ValueError("the model has no trainable parameter to move")
    cost_of = {id(m): c for _, m, c in costs}
    owners = [(name, m) for name, m, _ in costs if any(id(p) in trainable for p in m.parameters(recurse=False))]
    param_names = {id(p): n for n, p in model.named_parameters()}

    def details(split: Split | None, suffix: nn.Module, block: ParamBlock, note: str | None = None) -> dict[str, Any]:
        cost = sum(cost_of.get(id(m), 0) for m in suffix.modules())
        return {"split_at": None if split is None else str(split.start), "cost_share": cost / total,
                "forward_macs_per_sample": total / max(1, min(2, len(data))),
                "parameters": [p.name for p in block.parts],
                "numel": block.numel, "scope_cost_share": share, **({"note": note} if note else {})}

    if share >= 1.0:
        block = ParamBlock.all_parameters(model)
        return Scope(None, block, details(None, model, block))
    smallest: tuple[Split, ParamBlock, float] | None = None
    for i in range(len(owners)):
        names = []
        for _, m in owners[i:]:
            names += [param_names[id(p)] for p in m.parameters(recurse=False) if id(p) in trainable]
        split = split_for(model, task, ParamBlock.from_rows(model, {n: None for n in names}))
        if split is None:
            continue
        suffix = split.suffix_of(model)
        block = ParamBlock.from_rows(model, {n: None for n, p in suffix.named_parameters() if p.requires_grad})
        cost = sum(cost_of.get(id(m), 0) for m in suffix.modules()) / total
        if cost <= share:
            return Scope(split, block, details(split, suffix, block))
        smallest = (split, block, cost)
    if smallest is None:
        raise ValueError(
            f"settings.scope_cost_share: no registered splitter divides a {type(model).__name__} before its trailing "
            "layers, so the scope cannot be cut off; set scope_cost_share: 1 to take every parameter of the model "
            "(no prefix run once), or register a splitter (pipeline.frozen_prefix.register_splitter)")
    split, block, cost = smallest
    return Scope(split, block, details(split, split.suffix_of(model), block,
                                       f"the smallest trailing part that splits costs {cost:.3f} of the forward pass, "
                                       f"more than scope_cost_share"))


@dataclass(frozen=True)
class ScopeInputs:
    """What the scope's passes read on D: ``features`` (the prefix's outputs; D itself where the scope is the whole
    model), the suffix's ``task``, the prefix's digest (None without a prefix) and the prefix pass's seconds."""

    features: SampleSet
    task: Task
    prefix: str | None
    seconds: float


def check_prefix_budget(model: nn.Module, task: Task, train: SampleSet, scope: Scope) -> None:
    """Refuse (``MemoryBudgetError``, naming the two settings that change it) prefix outputs on ``train`` that would
    take more than half of the memory budget; nothing is computed."""
    if scope.split is None:
        return
    over = over_half_budget(model, len(train) * cached_bytes_per_sample(scope.split, model, task, train),
                            "the prefix's outputs on D")
    if over is not None:
        raise MemoryBudgetError(f"{over}: raise memory_budget, or move the cut (settings.scope_cost_share) to where "
                                "the prefix's outputs are smaller")


def scope_inputs(model: nn.Module, task: Task, train: SampleSet, scope: Scope, batch_size: int) -> ScopeInputs:
    """The scope's inputs on D: the prefix run once over D (in eval mode). Outputs that would take more than half of
    the memory budget are refused (``MemoryBudgetError``, naming the two settings that change them) before anything
    is computed."""
    if scope.split is None:
        return ScopeInputs(train, task, None, 0.0)
    check_prefix_budget(model, task, train, scope)
    cache = cache_frozen_prefix(model, task, train, scope.block, batch_size)
    assert cache is not None and cache.start == scope.split.start
    return ScopeInputs(cache.train, cache.task, prefix_digest(scope.split, model), cache.seconds)


def carried_inputs(scope: Scope, features: SampleSet, prefix: str | None, model: nn.Module,
                   removed: Tensor) -> SampleSet | None:
    """The scope's inputs on D \\ U for the next version (``model``: its weights), or None where its prefix is not
    the one they were computed with (its digest): a removal that moved only the suffix keeps every other row."""
    if scope.split is not None and prefix_digest(scope.split, model) != prefix:
        return None
    return features.without(removed)
