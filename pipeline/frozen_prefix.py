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

import contextvars
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.data.sampleset import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.prepared import content_digest, digest_tensor
from pipeline.tasks import Batch, Task

__all__ = ["PrefixCache", "PrefixMemo", "PrefixRows", "SPLITTERS", "Split", "bytes_of", "cache_frozen_prefix",
           "cached_bytes_per_sample", "deterministic_prefix", "memoized", "prefix_digest", "register_splitter",
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
                "cached_bytes": bytes_of(cached.values())}


@dataclass
class PrefixRows:
    """The frozen prefix's outputs of D's samples, each computed the first time a pass reads it and kept by sample id
    for every later read: a removal that reads a few of D's samples (a probe, a refit's batches, the forget set)
    runs the prefix on those alone, and a later request on the same model or a later version (the prefix's digest
    unchanged: the caller's check) reads them again for nothing. A row is the prefix's output on the sample's
    inputs, which a version changes neither. ``ids``: D's sample ids when prepared, sorted; ``slot``: for each id,
    its row in ``outputs`` (-1: not computed); ``outputs``: for each cached column, the rows computed, in the order
    they were (a store that doubles as it fills, never more than D's rows plus a batch: a request pays for the
    rows it reads, not for a store of all of D); ``computed`` / ``seconds``: the rows the prefix ran on (the
    store's rows filled) and its time, over the object's life."""

    split: Split
    ids: Tensor
    outputs: dict[str, Tensor] = field(default_factory=dict)
    slot: Tensor | None = None
    computed: int = 0
    seconds: float = 0.0

    @classmethod
    def over(cls, split: Split, sample_ids: Tensor) -> "PrefixRows":
        """Rows for the samples ``sample_ids`` (D's), none computed."""
        return cls(split, torch.sort(torch.as_tensor(sample_ids, dtype=torch.long)).values)

    def empty_copy(self) -> "PrefixRows":
        """The same split and samples, nothing computed (what a cold request starts from)."""
        return PrefixRows(self.split, self.ids)

    @property
    def have(self) -> Tensor:
        """For each of ``ids``, whether its row is kept."""
        return torch.zeros(len(self.ids), dtype=torch.bool) if self.slot is None else self.slot >= 0

    @property
    def held(self) -> int:
        """Rows computed and kept."""
        return int(self.have.sum())

    @property
    def nbytes(self) -> int:
        return bytes_of(self.outputs.values())

    def drop_absent(self, present: Tensor) -> int:
        """Forget the rows of the samples not in ``present`` (the sample ids of a version's D: a removal's U and
        those removed before), their outputs zeroed: nothing computed from a removed sample is kept. Returns how
        many rows were dropped."""
        if self.slot is None:
            return 0
        gone = (self.slot >= 0) & ~torch.isin(self.ids, torch.as_tensor(present, dtype=torch.long))
        if bool(gone.any()):
            rows = self.slot[gone]
            for value in self.outputs.values():
                value[rows.to(value.device)] = 0
            self.slot[gone] = -1
        return int(gone.sum())

    def _grown(self, store: Tensor | None, column: Tensor, need: int) -> Tensor:
        """``store`` (its first ``computed`` rows kept) with room for ``need`` rows: doubled, at least ``need``, at most
        D's rows where ``need`` allows; the new rows zero."""
        if store is not None and len(store) >= need:
            return store
        old = 0 if store is None else len(store)
        grown = column.new_zeros((max(need, min(2 * old, len(self.ids))), *column.shape[1:]))
        if store is not None and self.computed:
            grown[:self.computed] = store[:self.computed].to(grown.device)
        return grown

    def ensure(self, model: nn.Module, task: Task, data: SampleSet, batch_size: int) -> Tensor:
        """Compute and keep the rows of ``data`` (samples of D, with the model's inputs) not yet kept, in one pass
        (eval mode); the positions of ``data``'s samples among ``ids``."""
        where, found = _find(self.ids, data.sample_ids)
        if not bool(found.all()):
            raise ValueError(f"sample ids {torch.as_tensor(data.sample_ids)[~found][:5].tolist()} are not samples of "
                             "the data the frozen prefix's rows were prepared for")
        if self.slot is None:
            self.slot = torch.full((len(self.ids),), -1, dtype=torch.long)
        missing = torch.nonzero(self.slot[where] < 0).flatten()
        if len(missing):
            fresh, seconds = _timed_prefix_outputs(self.split, model, task, data.take(missing), batch_size)
            new = torch.arange(self.computed, self.computed + len(missing))
            for key in self.split.cached:
                column = fresh.columns[key]
                store = self._grown(self.outputs.get(key), column, self.computed + len(missing))
                store[new.to(store.device)] = column.to(store.device)
                self.outputs[key] = store
            self.slot[where[missing]] = new
            self.computed += len(missing)
            self.seconds += seconds
        return where

    def inputs(self, model: nn.Module, task: Task, data: SampleSet, batch_size: int) -> SampleSet:
        """``data`` (samples of D, with the model's inputs) with the prefix's outputs in place of the columns it
        consumes (``prefix_outputs``), on the model's device; the rows not yet kept computed first (``ensure``)."""
        where = self.ensure(model, task, data, batch_size)
        if not self.outputs:
            raise ValueError("no frozen-prefix rows to read: the set read is empty and none were computed before")
        assert self.slot is not None
        rows = self.slot[where]
        device = memory.model_device(model)
        columns = {k: v for k, v in data.columns.items() if k not in self.split.consumed}
        columns.update({k: self.outputs[k][rows.to(self.outputs[k].device)].to(device) for k in self.split.cached})
        return SampleSet(columns, data.sample_ids)


def _find(sorted_ids: Tensor, wanted: Tensor) -> tuple[Tensor, Tensor]:
    """Positions in ``sorted_ids`` (ascending) of the ids ``wanted`` and whether each is there."""
    wanted = torch.as_tensor(wanted, dtype=torch.long)
    if len(sorted_ids) == 0:
        return torch.zeros(len(wanted), dtype=torch.long), torch.zeros(len(wanted), dtype=torch.bool)
    where = torch.searchsorted(sorted_ids, wanted).clamp(max=len(sorted_ids) - 1)
    return where, sorted_ids[where] == wanted


def _timed_prefix_outputs(split: Split, model: nn.Module, task: Task, data: SampleSet, batch_size: int,
                          ) -> tuple[SampleSet, float]:
    """``prefix_outputs`` in eval mode (the model's mode restored after) and its wall seconds."""
    started = time.perf_counter()
    was = model.training
    model.eval()
    try:
        out = prefix_outputs(split, model, task, data, batch_size)
    finally:
        model.train(was)
    return out, time.perf_counter() - started


def bytes_of(tensors: Iterable[Tensor]) -> int:
    """Bytes the tensors hold."""
    return int(sum(t.numel() * t.element_size() for t in tensors))


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


def cached_bytes_per_sample(split: Split, model: nn.Module, task: Task, data: SampleSet) -> int:
    """Bytes the prefix's outputs of one sample of ``data`` hold (its first sample run through the prefix;
    samples share their shape)."""
    one = prefix_outputs(split, model, task, data.take(torch.arange(1)), 1)
    return int(sum(one.columns[k][0].numel() * one.columns[k].element_size() for k in split.cached))


def cache_frozen_prefix(model: nn.Module, task: Task, train: SampleSet, block: ParamBlock,
                        batch_size: int) -> PrefixCache | None:
    """The suffix and D with cached prefix outputs, or None when no split applies (the block
    starts at the model's first layer, or no splitter knows the architecture). The caller holds
    the model in eval mode; the prefix must hold no parameter of the block (by construction) and is
    never modified. ``batch_size`` is lowered to fit the memory budget. Inside ``memoized(memo)``
    the outputs come from (and go to) ``memo``."""
    split = split_for(model, task, block)
    if split is None:
        return None
    started = time.perf_counter()
    memo = _MEMO.get()
    if memo is not None:
        cached = memo.outputs(split, model, task, train, batch_size)
    else:
        cached = prefix_outputs(split, model, task, train, batch_size)
    return PrefixCache(split, split.suffix_of(model), cached, time.perf_counter() - started)


def prefix_digest(split: Split, model: nn.Module) -> str:
    """``pipeline.prepared.content_digest`` of the split point and of every parameter and buffer outside the
    split's suffix (names, dtypes, shapes, values): two models with equal digests compute the same prefix. A tensor's own
    digest is kept while it is the same live tensor at the same version (``Tensor._version`` counts in-place
    writes: optimiser steps, ``load_state_dict``), so asking again about an unchanged model hashes nothing."""
    inside = {id(t) for t in split.suffix_of(model).parameters()} | {id(t) for t in split.suffix_of(model).buffers()}
    h = content_digest()
    h.update(f"split:{split.start};".encode())
    for kind, named in (("p.", model.named_parameters()), ("b.", model.named_buffers())):
        for name, t in named:
            if id(t) not in inside:
                h.update((kind + name + ":").encode())
                h.update(_tensor_digest_cached(t))
    return h.hexdigest()


_DIGESTS: dict[int, tuple[Any, int, bytes]] = {}


def _tensor_digest_cached(t: Tensor) -> bytes:
    import weakref

    held = _DIGESTS.get(id(t))
    if held is not None and held[0]() is t and held[1] == t._version:
        return held[2]
    h = content_digest()
    digest_tensor(h, "", t)
    value = h.digest()
    if len(_DIGESTS) > 100_000:
        _DIGESTS.clear()
    _DIGESTS[id(t)] = (weakref.ref(t), t._version, value)
    return value


@dataclass
class _Bank:
    ids: Tensor                 # sample ids, sorted
    order: Tensor               # positions in the rows below of the sorted ids
    inputs: dict[str, Tensor]   # the consumed input columns (checked equal on every lookup)
    outputs: dict[str, Tensor]  # the prefix's output columns


@dataclass
class PrefixMemo:
    """Outputs of frozen prefixes kept per sample, so that repeated trainings (Retrain, shadow models) and
    evaluations of models that share one frozen prefix run it once per sample (benchmarks, campaigns of
    retrainings). Keyed by ``prefix_digest`` (the prefix's weights and the split point); each key holds banks of
    rows (sample ids, the consumed input columns, the outputs). A lookup takes its rows from a bank that holds
    every asked sample id with identical input columns, else runs the prefix on the asked data and keeps the
    result as a new bank: the outputs are always the prefix's own on those inputs. ``computed`` lists each run of
    the prefix: (rows, seconds)."""

    banks: dict[str, list[_Bank]] = field(default_factory=dict)
    computed: list[tuple[int, float]] = field(default_factory=list)

    def seconds_per_sample(self) -> float | None:
        rows = sum(r for r, _ in self.computed)
        return None if rows == 0 else sum(s for _, s in self.computed) / rows

    def _lookup(self, bank: _Bank, split: Split, data: SampleSet) -> SampleSet | None:
        where, found = _find(bank.ids, data.sample_ids)
        if not bool(found.all()):
            return None
        rows = bank.order[where]
        for key in split.consumed:
            if key in data.columns and not torch.equal(bank.inputs[key][rows], data.columns[key].to(bank.inputs[key].device)):
                return None
        columns = {k: v for k, v in data.columns.items() if k not in split.consumed}
        columns.update({k: v[rows] for k, v in bank.outputs.items()})
        return SampleSet(columns, data.sample_ids)

    def outputs(self, split: Split, model: nn.Module, task: Task, data: SampleSet, batch_size: int) -> SampleSet:
        """``data`` with the prefix's outputs in place of the columns it consumes (``prefix_outputs``)."""
        key = prefix_digest(split, model)
        for bank in self.banks.get(key, []):
            found = self._lookup(bank, split, data)
            if found is not None:
                return found
        out, seconds = _timed_prefix_outputs(split, model, task, data, batch_size)
        self.computed.append((len(data), seconds))
        ids, order = torch.sort(data.sample_ids.to(torch.long))
        self.banks.setdefault(key, []).append(_Bank(
            ids, order, {k: data.columns[k] for k in split.consumed if k in data.columns},
            {k: out.columns[k] for k in split.cached}))
        return out


_MEMO: contextvars.ContextVar[PrefixMemo | None] = contextvars.ContextVar("unlearn_prefix_memo", default=None)


@contextmanager
def memoized(memo: PrefixMemo | None) -> Iterator[PrefixMemo | None]:
    """Within the block, ``cache_frozen_prefix`` (training's frozen layers, run once per fit) takes its
    outputs from ``memo`` and adds what it computes to it (None: unchanged)."""
    if memo is None:
        yield None
        return
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)
