"""The frozen prefix's outputs on D as a method's prepared state: where a model has layers before its first
trainable parameter (a Hugging Face encoder's frozen lower layers, a frozen trunk before a head), no removal
moves them, so their outputs are computed once per sample and carried to every later version (the prefix's digest
checked unchanged). ``lfoci-newton`` prepares them on all of D at once (its passes read g_D over D) and drops U's
rows from version to version; ``trajectory-refit`` prepares none and computes a sample's the first time a pass reads
it (``pipeline.frozen_prefix.PrefixRows``: its removals read a probe, a brief refit's batches and a sample of U,
a small part of D). ``pipeline.frozen_prefix`` does the caching."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from pipeline import memory
from pipeline.data.sampleset import SampleSet
from pipeline.frozen_prefix import (
    PrefixCache, PrefixRows, Split, bytes_of, cache_frozen_prefix, cached_bytes_per_sample, prefix_digest, split_for,
)
from pipeline.methods.base import TrainedModel
from pipeline.param_block import ParamBlock
from pipeline.prepared import Binding, Prepared
from pipeline.target.emptied_classes import CheckpointViews

__all__ = ["FrozenPrefixPrepared", "SuffixInputs", "over_half_budget", "prepare_frozen_prefix"]


@dataclass(frozen=True)
class SuffixInputs:
    """What a removal's passes run on where the model has a frozen prefix: its suffix (the model's own modules, the
    trainable parameters under the same names), the suffix's task, and ``inputs``, which maps samples of D (with the
    model's inputs) to the suffix's (the prefix's outputs in place of the columns it consumes)."""

    suffix: nn.Module
    task: Any
    start: int | str
    inputs: Callable[[SampleSet], SampleSet]
    ahead: Callable[[SampleSet], Any] | None = None  # computes and keeps the rows of samples about to be read


@dataclass
class FrozenPrefixPrepared(Prepared):
    """The frozen prefix's outputs on D, where the model has layers before its first trainable parameter (the
    split of ``pipeline.frozen_prefix`` whose suffix holds every trainable parameter): ``features``, computed on all
    of D at preparation (U's rows dropped version to version), or ``rows``, each computed the first time a pass
    reads it (``PrefixRows``: carried to every later version, the rows of the samples it lacks dropped). ``split``
    None: nothing to prepare (every layer trains, caching turned off, or the outputs would not fit the memory budget;
    ``details`` says which). ``checkpoint_views``: the emptied-class replay's views of the recorded run on a fixed
    sample of D, keyed by what they were computed from (``pipeline.methods.emptied_rows``): computed by the first
    request that needs them, carried to every later version (they read the recorded run, not the weights; a request
    drops U's rows). ``emptied_classes``: the classes requests on this model and its earlier versions emptied (the
    replay writes again those D still lacks), copied to each later version so that versions branching from one
    (a rollback, then other requests) do not share them."""

    split: Split | None = None
    features: SampleSet | None = None
    prefix: str | None = None
    rows: PrefixRows | None = None   # computed on first read instead of ``features`` (prepare_frozen_prefix(lazy=True))
    checkpoint_views: dict[tuple[int, int, str], CheckpointViews] = field(default_factory=dict)
    emptied_classes: set[int] = field(default_factory=set)

    what = "the frozen prefix's outputs on D (the layers before the first trainable one), where the model has one"

    def cache(self, model: nn.Module) -> PrefixCache | None:
        """The prepared outputs as the prefix cache of ``model`` (None: nothing prepared)."""
        if self.split is None or self.features is None:
            return None
        return PrefixCache(self.split, self.split.suffix_of(model), self.features, 0.0)

    def suffix_inputs(self, model: nn.Module, task: Any, batch_size: int) -> SuffixInputs | None:
        """``model``'s suffix and the map from samples of D to its inputs (``task``: the whole model's): the prepared
        outputs, or the rows computed on first read (``rows``); None where nothing is prepared."""
        if self.split is None or (self.features is None and self.rows is None):
            return None
        split, suffix = self.split, self.split.suffix_of(model)
        if self.rows is not None:
            rows = self.rows
            return SuffixInputs(suffix, split.task, split.start,
                                lambda data: rows.inputs(model, task, data, batch_size),
                                lambda data: rows.ensure(model, task, data, batch_size))
        features = self.features

        def taken(data: SampleSet) -> SampleSet:
            return features.take(features.positions_of(data.sample_ids, field="frozen prefix outputs"))
        return SuffixInputs(suffix, split.task, split.start, taken)

    @property
    def held_bytes(self) -> int:
        """Bytes of the prefix's outputs held now (``rows``: their store, grown as rows are computed)."""
        if self.rows is not None:
            return self.rows.nbytes
        return 0 if self.features is None else bytes_of(self.features.columns.values())

    def fresh_copy(self) -> "FrozenPrefixPrepared":
        return replace(self, checkpoint_views={}, emptied_classes=set(),
                       rows=None if self.rows is None else self.rows.empty_copy())

    def after_removal(self, trained: Any, removed: torch.Tensor, outcome: Any, binding: Binding) -> "Prepared | None":
        if self.split is not None and self.rows is not None:  # the rows stand for their samples in every version
            if prefix_digest(self.split, trained.model) != self.prefix:
                return None
            self.rows.drop_absent(trained.train.sample_ids)  # U's rows go with U (a rolled-back version recomputes)
            return type(self)(binding, 0.0, dict(self.details), split=self.split, prefix=self.prefix, rows=self.rows,
                              checkpoint_views=self.checkpoint_views, emptied_classes=set(self.emptied_classes))
        if self.split is None or self.features is None:
            return type(self)(binding, 0.0, dict(self.details), checkpoint_views=self.checkpoint_views,
                              emptied_classes=set(self.emptied_classes))
        if prefix_digest(self.split, trained.model) != self.prefix:
            return None
        return type(self)(binding, 0.0, {**self.details, "updated_from_removal": "U's rows dropped"},
                          split=self.split, features=self.features.without(removed), prefix=self.prefix,
                          checkpoint_views=self.checkpoint_views, emptied_classes=set(self.emptied_classes))


def over_half_budget(model: nn.Module, held: int, what: str, device: str | torch.device | None = None) -> str | None:
    """Why ``held`` bytes (``what``: prefix outputs, the replay's views) are not kept: more than half of what the memory
    budget leaves on ``device`` (the model's by default); None where they fit."""
    budget = memory.available_in(memory.current_budget(memory.model_device(model) if device is None else device))
    if held <= budget.bytes / 2:
        return None
    return f"{what} (~{memory.format_bytes(held)}) exceed half of {budget.named()}"


def prepare_frozen_prefix(trained: TrainedModel, binding: Binding, cls: type[FrozenPrefixPrepared] = FrozenPrefixPrepared,
                          *, lazy: bool = False) -> FrozenPrefixPrepared:
    """The frozen prefix's outputs on D where the model has frozen layers, else ``cls`` with the reason. ``lazy``:
    none computed yet, each sample's on its first read (``PrefixRows``); the memory budget is checked for all of D
    either way (the rows a lineage of requests reads can reach it)."""
    model, task, train = trained.model, trained.task, trained.train
    trainable = ParamBlock.all_parameters(model)
    split = split_for(model, task, trainable)
    if split is None:
        return cls(binding, details={
            "frozen_prefix": None, "why": "no frozen layers before the first trainable parameter (or no splitter "
                                          "knows the architecture): the modules before a block run per request"})
    over = over_half_budget(model, len(train) * cached_bytes_per_sample(split, model, task, train),
                            "the frozen prefix's outputs on D")
    if over is not None:
        return cls(binding, details={"frozen_prefix": None, "why": f"{over}: the modules before a block run per request"})
    if lazy:
        suffix = split.suffix_of(model)
        return cls(binding, details={"frozen_prefix": {
            "suffix_start_module": split.start, "suffix_modules": [type(m).__name__ for m in suffix.children()],
            "computed": "per sample, the first time a pass reads it; kept for later requests and versions"}},
            split=split, prefix=prefix_digest(split, model), rows=PrefixRows.over(split, train.sample_ids))
    cache = cache_frozen_prefix(model, task, train, trainable, trained.batch_size)
    assert cache is not None
    return cls(binding, details={"frozen_prefix": cache.describe(), "prefix_seconds": cache.seconds},
               split=split, features=cache.train, prefix=prefix_digest(split, model))
