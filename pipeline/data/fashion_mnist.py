"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017) from the Debian package ``dataset-fashion-mnist``.

Files: ``/usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``
(60,000 train / 10,000 test 28x28 grey images, 10 classes), read as IDX (big-endian header:
magic, dims, then uint8 data). ``sample_id`` = the row index in the split's file - kept when
classes are chosen or rows subsampled.

Used as the stand-in for face and re-ID data: each class plays an *identity* (``classes``
picks which; labels are renumbered 0..K-1 in the order given, the original label stays in
the ``label_orig`` column), images are resized (``image_size``) and repeated to 3 channels
(``channels: 3``) for the VGG-Face / ResNet presets. Normalisation: mean 0.2860, std 0.3530
(the training set's pixel statistics).
"""
from __future__ import annotations

import functools
import gzip
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.data.hf import ID_COLUMN, offline, select_rows
from pipeline.data.images import prepare
from pipeline.data.sampleset import SampleSet
from pipeline.data.sources import MissingSourceError, register_source

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CLASS_NAMES: tuple[str, ...] = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
MEAN, STD = 0.2860, 0.3530


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzipped): 2 zero bytes, dtype code 0x08 (uint8), ndim, sizes."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims).copy()


def _root(root: str | None) -> Path:
    path = Path(root or os.environ.get("FASHION_MNIST_DIR", DEFAULT_ROOT))
    if not all((path / f).exists() for pair in FILES.values() for f in pair):
        raise MissingSourceError(
            f"Fashion-MNIST files not found in {path}: install the Debian package with "
            "`apt-get install dataset-fashion-mnist`, or set data.options.root to a folder holding "
            f"{sorted(f for pair in FILES.values() for f in pair)}"
        )
    return path


@functools.lru_cache(maxsize=4)
def _raw(root: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    images_file, labels_file = FILES[split]
    images, labels = read_idx(Path(root) / images_file), read_idx(Path(root) / labels_file)
    if len(images) != len(labels):
        raise ValueError(f"{root}: {split} has {len(images)} images but {len(labels)} labels")
    return images, labels.astype(np.int64)


def _select(
    *, root: str | None = None, classes: Sequence[int] | None = None, per_class: int | None = None,
    test_per_class: int | None = None, limit: int | None = None, seed: int = 0, splits: Sequence[str] = ("train", "test"),
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """split -> (sample ids = rows in the file, images uint8 (n, 28, 28), label 0..K-1 in the order
    of ``classes``, label_orig 0..9) of the rows the options keep."""
    path = str(_root(root))
    chosen = list(range(10)) if classes is None else [int(c) for c in classes]
    if any(c not in range(10) for c in chosen) or len(set(chosen)) != len(chosen):
        raise ValueError(f"data.options.classes must be distinct labels in 0..9, got {classes}")
    remap = np.full(10, -1, dtype=np.int64)
    remap[chosen] = np.arange(len(chosen))
    out = {}
    for split in splits:
        if split not in FILES:
            raise ValueError(f"data.options.splits: '{split}' is not one of {sorted(FILES)}")
        images, labels = _raw(path, split)
        rows = select_rows(labels, classes=chosen, per_class=per_class if split == "train" else test_per_class,
                           limit=limit if split == "train" else None, seed=seed)
        out[split] = (rows.astype(np.int64), images[rows], remap[labels[rows]], labels[rows])
    return out


def fashion_mnist_dataset(**options: Any) -> Any:
    """``DatasetDict`` with sample_id (row in file), image (uint8 28x28), label (0..K-1 in the
    order of ``classes``), label_orig (0..9); options as ``_select``."""
    offline()
    import datasets

    selected = _select(**options)
    chosen = list(range(10)) if options.get("classes") is None else [int(c) for c in options["classes"]]
    features = datasets.Features({
        ID_COLUMN: datasets.Value("int64"), "image": datasets.Array2D((28, 28), "uint8"),
        "label": datasets.ClassLabel(names=[CLASS_NAMES[c] for c in chosen]), "label_orig": datasets.Value("int64"),
    })
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict({ID_COLUMN: ids, "image": images, "label": label, "label_orig": orig},
                                          features=features)
        for split, (ids, images, label, orig) in selected.items()})


@register_source("fashion-mnist")
def fashion_mnist(
    *, image_size: int | None = None, channels: int = 1, normalize: bool = True, flatten: bool = False,
    **options: Any,
) -> dict[str, SampleSet]:
    """Splits as SampleSets: x float32 (N, C, H, W) (or flattened), y int64, label_orig int64.
    Options: root, classes, per_class, test_per_class, limit, seed, image_size, channels,
    normalize, flatten.

    The files are read and the images prepared once per process and options (the last few kept:
    a campaign reads its data again for every batch); the SampleSets are immutable, so callers
    share them."""
    key = json.dumps({"root": str(_root(options.get("root"))), "image_size": image_size, "channels": channels,
                      "normalize": normalize, "flatten": flatten, **options}, sort_keys=True, default=str)
    return dict(_prepared(key))


@functools.lru_cache(maxsize=4)
def _prepared(key: str) -> dict[str, SampleSet]:
    options = json.loads(key)
    image_size, channels = options.pop("image_size"), options.pop("channels")
    normalize, flatten = options.pop("normalize"), options.pop("flatten")
    if isinstance(image_size, list):
        image_size = tuple(image_size)
    out = {}
    for split, (ids, images, label, orig) in _select(**options).items():
        x = prepare(images, image_size=image_size, channels=channels, normalize=normalize, mean=(MEAN,), std=(STD,),
                    flatten=flatten)
        out[split] = SampleSet({"x": x, "y": torch.from_numpy(np.asarray(label, dtype=np.int64)),
                                "label_orig": torch.from_numpy(np.asarray(orig, dtype=np.int64))},
                               torch.from_numpy(np.asarray(ids, dtype=np.int64)))
    return out
