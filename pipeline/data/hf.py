"""Between Hugging Face ``datasets`` and ``SampleSet``: stable ids, subsampling, tokenising.

Every source first builds a ``datasets.DatasetDict`` whose splits carry an int64 ``sample_id``
column (the row of the sample in the source's own files - stable across runs, machines and
subsamples), then turns each split into a ``SampleSet`` with ``to_sampleset``. Subsampling
keeps the original ids (never renumbers), so a forget request names the same sample whatever
subset a model was trained on.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from pipeline.data.sampleset import SampleSet

ID_COLUMN = "sample_id"


def offline() -> None:
    """Make sure ``datasets`` / the hub never reach the network from this process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def select_rows(
    labels: np.ndarray, *, classes: Sequence[int] | None = None, per_class: int | None = None,
    fraction: float | None = None, limit: int | None = None, seed: int = 0,
) -> np.ndarray:
    """Row positions to keep, in increasing order.

    ``classes`` keeps only those labels; ``per_class`` keeps at most that many rows of each
    class, ``fraction`` that share of each class (at least one), ``limit`` at most that many rows
    overall; every choice is a seeded uniform draw (numpy PCG64 with ``seed``), then sorted so
    row order - and hence id order - is the source's own.
    """
    labels = np.asarray(labels)
    rows = np.arange(len(labels))
    if classes is not None:
        rows = rows[np.isin(labels, np.asarray(list(classes)))]
    rng = np.random.default_rng(seed)
    if per_class is not None or fraction is not None:
        if per_class is not None and per_class < 1:
            raise ValueError(f"data.options.per_class must be >= 1, got {per_class}")
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"data.options.fraction must be in (0, 1], got {fraction}")
        chosen = []
        for label in np.unique(labels[rows]):
            members = rows[labels[rows] == label]
            k = len(members)
            if fraction is not None:
                k = max(1, int(round(fraction * len(members))))
            if per_class is not None:
                k = min(k, per_class)
            chosen.append(rng.choice(members, size=k, replace=False) if k < len(members) else members)
        rows = np.sort(np.concatenate(chosen)) if chosen else rows[:0]
    if limit is not None and len(rows) > limit:
        rows = np.sort(rng.choice(rows, size=limit, replace=False))
    return rows


def to_sampleset(ds: Any, columns: Mapping[str, str], dtypes: Mapping[str, torch.dtype] | None = None) -> SampleSet:
    """A ``SampleSet`` from a ``datasets.Dataset``: ``columns`` maps SampleSet column -> dataset
    column; ids come from the ``sample_id`` column."""
    if ID_COLUMN not in ds.column_names:
        raise ValueError(f"dataset has no '{ID_COLUMN}' column; every source must provide stable ids")
    table = ds.with_format("numpy")[:]
    dtypes = dict(dtypes or {})
    cols = {}
    for name, source in columns.items():
        array = np.asarray(table[source])
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        cols[name] = tensor.to(dtypes[name]) if name in dtypes else tensor
    ids = torch.from_numpy(np.asarray(table[ID_COLUMN], dtype=np.int64))
    return SampleSet(cols, ids)


def tokenize_dataset(ds: Any, tokenizer_path: str, *, text_column: str = "text", max_length: int = 128) -> Any:
    """Add ``input_ids`` / ``attention_mask`` with the model's own tokenizer (truncation at
    ``max_length``; every row padded to the longest row of the split, at most ``max_length``)."""
    from pipeline.hf_local import load_tokenizer

    tok = load_tokenizer(str(tokenizer_path))
    texts = list(ds[text_column])
    enc = tok(texts, truncation=True, max_length=int(max_length), padding="longest", return_tensors="np")
    ds = ds.add_column("input_ids", list(enc["input_ids"].astype(np.int64)))
    return ds.add_column("attention_mask", list(enc["attention_mask"].astype(np.int64)))
