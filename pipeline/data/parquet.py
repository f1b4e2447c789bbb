"""User data in Parquet files, described by a column spec.

Options (``data.options`` in a config):
  path            one Parquet file, or ``{split: file}`` (e.g. ``{train: a.parquet, test: b.parquet}``)
  id_column       column of stable int64 sample ids (default ``sample_id``); when the file has
                  no such column, ids are the row numbers (``ids_from_rows: true`` must then be
                  set explicitly: row numbers stay stable only while the file is never edited)
  features        numeric columns to concatenate into ``x`` (scalars or fixed-length lists)
  text_column     a text column to tokenise instead (with ``tokenizer``, ``max_length``)
  label_column    target column -> ``y`` (default ``label``)
  label_type      ``class`` (int64), ``multilabel`` (list of label indices -> multi-hot float32
                  of width ``num_labels``) or ``regression`` (float32)
Every split becomes an HF ``Dataset`` with a ``sample_id`` column (``parquet_dataset``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.data.hf import ID_COLUMN, offline, to_sampleset, tokenize_dataset
from pipeline.data.sampleset import SampleSet
from pipeline.data.sources import register_source


class ParquetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | dict[str, str]
    id_column: str = ID_COLUMN
    ids_from_rows: bool = False
    features: list[str] = Field(default_factory=list)
    text_column: str | None = None
    tokenizer: str | None = None
    max_length: int = Field(128, gt=0)
    label_column: str = "label"
    label_type: Literal["class", "multilabel", "regression"] = "class"
    num_labels: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _inputs(self) -> "ParquetSpec":
        if bool(self.features) == bool(self.text_column):
            raise ValueError("data.options: give exactly one of 'features' (numeric columns) or 'text_column'")
        if self.text_column and not self.tokenizer:
            raise ValueError("data.options.tokenizer is required with text_column (a local model directory or alias)")
        if self.label_type == "multilabel" and not self.num_labels:
            raise ValueError("data.options.num_labels is required when label_type is 'multilabel'")
        return self


def parquet_dataset(**options: Any) -> Any:
    """``DatasetDict`` of the files, each with a ``sample_id`` column."""
    offline()
    import datasets
    import pyarrow.parquet as pq

    spec = ParquetSpec.model_validate(options)
    files = spec.path if isinstance(spec.path, dict) else {"train": spec.path}
    out = {}
    for split, file in files.items():
        path = Path(file).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data.options.path: {path} (split '{split}') does not exist")
        table = pq.read_table(path)
        ds = datasets.Dataset(table)
        if spec.id_column not in ds.column_names:
            if not spec.ids_from_rows:
                raise ValueError(
                    f"{path} has no id column '{spec.id_column}'; add one (stable int64 ids), name it "
                    "with data.options.id_column, or set data.options.ids_from_rows: true"
                )
            ds = ds.add_column(spec.id_column, np.arange(len(ds), dtype=np.int64))
        if spec.id_column != ID_COLUMN:
            if ID_COLUMN in ds.column_names:
                ds = ds.remove_columns(ID_COLUMN)
            ds = ds.rename_column(spec.id_column, ID_COLUMN)
        missing = [c for c in [*spec.features, spec.label_column, *([spec.text_column] if spec.text_column else [])]
                   if c not in ds.column_names]
        if missing:
            raise ValueError(f"{path} lacks the columns {missing} named in data.options (has {ds.column_names})")
        out[split] = ds
    return datasets.DatasetDict(out)


def _stack_features(table: dict[str, Any], columns: Sequence[str]) -> torch.Tensor:
    parts = []
    for name in columns:
        col = np.asarray([np.asarray(v, dtype=np.float32).reshape(-1) for v in table[name]], dtype=np.float32)
        parts.append(col.reshape(len(col), -1))
    return torch.from_numpy(np.concatenate(parts, axis=1))


def _labels(values: Any, spec: ParquetSpec) -> torch.Tensor:
    if spec.label_type == "class":
        return torch.as_tensor(np.asarray(values, dtype=np.int64))
    if spec.label_type == "regression":
        return torch.as_tensor(np.asarray(values, dtype=np.float32))
    assert spec.num_labels is not None
    hot = torch.zeros(len(values), spec.num_labels, dtype=torch.float32)
    for row, labels in enumerate(values):
        idx = [int(i) for i in np.asarray(labels).reshape(-1)]
        if any(i < 0 or i >= spec.num_labels for i in idx):
            raise ValueError(f"row {row}: label indices {idx} outside 0..{spec.num_labels - 1} (data.options.num_labels)")
        hot[row, idx] = 1.0
    return hot


@register_source("parquet")
def parquet(**options: Any) -> dict[str, SampleSet]:
    """User Parquet data as SampleSets (see the module docstring for the column spec)."""
    spec = ParquetSpec.model_validate(options)
    out = {}
    for split, ds in parquet_dataset(**options).items():
        if spec.text_column:
            assert spec.tokenizer is not None
            tokenized = tokenize_dataset(ds, spec.tokenizer, text_column=spec.text_column, max_length=spec.max_length)
            base = to_sampleset(tokenized, {"input_ids": "input_ids", "attention_mask": "attention_mask"},
                                {"input_ids": torch.long, "attention_mask": torch.long})
            columns = dict(base.columns)
        else:
            table = ds.with_format("numpy")[:]
            columns = {"x": _stack_features(table, spec.features)}
        label_values = ds[spec.label_column]
        columns["y"] = _labels(label_values, spec)
        ids = torch.as_tensor(np.asarray(ds[ID_COLUMN], dtype=np.int64))
        out[split] = SampleSet(columns, ids)
    return out
