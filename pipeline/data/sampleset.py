"""An in-memory set of training samples with stable sample ids.

Every source (digits, Fashion-MNIST, Reuters, user parquet, image folders) ends as a
``SampleSet``: a dict of equally long tensors (``columns``) plus an int64 ``sample_ids``
vector. Removal methods address samples by id; positions are internal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor


class SampleIdError(ValueError):
    """A forget set or subset named sample ids that are unknown, duplicated or empty."""


@dataclass(frozen=True)
class SampleSet:
    columns: dict[str, Tensor]
    sample_ids: Tensor

    def __post_init__(self) -> None:
        n = int(self.sample_ids.shape[0])
        for key, col in self.columns.items():
            if int(col.shape[0]) != n:
                raise ValueError(
                    f"column '{key}' has {int(col.shape[0])} rows but there are {n} sample ids; "
                    "every column must have one row per sample"
                )
        if torch.unique(self.sample_ids).numel() != n:
            raise SampleIdError("sample_ids must be unique within a SampleSet")

    def __len__(self) -> int:
        return int(self.sample_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return next(iter(self.columns.values())).device

    def to(self, device: torch.device | str) -> "SampleSet":
        return SampleSet({k: v.to(device) for k, v in self.columns.items()}, self.sample_ids)

    def astype(self, dtype: torch.dtype) -> "SampleSet":
        """The same samples with every floating column in ``dtype`` (inputs must match the
        model's dtype); integer columns (labels, token ids) are unchanged."""
        if all(not v.is_floating_point() or v.dtype == dtype for v in self.columns.values()):
            return self
        return SampleSet({k: v.to(dtype) if v.is_floating_point() else v for k, v in self.columns.items()},
                         self.sample_ids)

    def take(self, positions: Tensor | Sequence[int]) -> "SampleSet":
        """Rows at the given positions (not ids), in that order."""
        pos = torch.as_tensor(positions, dtype=torch.long)
        return SampleSet(
            {k: v[pos.to(v.device)] for k, v in self.columns.items()}, self.sample_ids[pos]
        )

    def positions_of(self, ids: Sequence[int] | Tensor, *, field: str = "sample_ids") -> Tensor:
        """Positions of the given sample ids; unknown, duplicate or no ids raise SampleIdError."""
        wanted = torch.as_tensor(list(ids) if not isinstance(ids, Tensor) else ids, dtype=torch.long)
        if wanted.numel() == 0:
            raise SampleIdError(f"{field} is empty: name at least one sample id to remove")
        uniq, counts = torch.unique(wanted, return_counts=True)
        if bool((counts > 1).any()):
            dups = uniq[counts > 1][:10].tolist()
            raise SampleIdError(f"{field} has duplicate sample ids {dups}: list each sample once")
        order = torch.argsort(self.sample_ids)
        sorted_ids = self.sample_ids[order]
        where = torch.searchsorted(sorted_ids, wanted).clamp(max=len(self) - 1)
        found = sorted_ids[where] == wanted
        if not bool(found.all()):
            missing = wanted[~found][:10].tolist()
            raise SampleIdError(
                f"{field} has sample ids not in the training set: {missing}; "
                "use ids from the dataset's sample_id column"
            )
        return order[where]

    def without(self, positions: Tensor) -> "SampleSet":
        keep = torch.ones(len(self), dtype=torch.bool)
        keep[positions] = False
        return self.take(torch.nonzero(keep).flatten())

    def batches(self, batch_size: int) -> Iterator[dict[str, Tensor]]:
        """Consecutive batches as dicts of tensors, in order."""
        n = len(self)
        for start in range(0, n, batch_size):
            yield {k: v[start : start + batch_size] for k, v in self.columns.items()}
