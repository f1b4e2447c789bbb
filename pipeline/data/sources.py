"""Data sources, looked up by name: each returns its splits as ``SampleSet``s with stable ids.

A source is a function ``(**options) -> dict[split name, SampleSet]``. Sample ids are stable
across runs and machines (they come from the source's own order, never from a shuffle).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from pipeline.data.sampleset import SampleSet
from pipeline.registry import Registry

SourceFn = Callable[..., dict[str, SampleSet]]
SOURCES: Registry[SourceFn] = Registry("data source", builtins="pipeline.data")


class MissingSourceError(RuntimeError):
    """A data source's files are not installed; the message names what to install."""


def register_source(name: str) -> Callable[[SourceFn], SourceFn]:
    return SOURCES.register(name)


def load_source(name: str, options: dict[str, Any] | None = None) -> dict[str, SampleSet]:
    return SOURCES.get_known(name)(**(options or {}))


@register_source("digits")
def digits(
    *, test_fraction: float = 0.2, flatten: bool = True, dtype: str = "float32",
    image_size: int | None = None, channels: int | None = None,
) -> dict[str, SampleSet]:
    """scikit-learn's bundled 8x8 digits (1,797 images), pixels / 16. Sample id = row in the
    bundled file; the test split is every row whose id % round(1/test_fraction) == 0.

    ``image_size`` (bilinear resize) and ``channels`` (3: grey repeated) give (N, C, H, W)
    images for the CNN presets; either one implies ``flatten: false``."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=getattr(torch, dtype))
    if image_size is not None or channels is not None:
        from pipeline.data.images import prepare

        x = prepare(x.reshape(-1, 8, 8).numpy(), image_size=image_size, channels=channels,
                    normalize=False, scale=1.0).to(getattr(torch, dtype))
    elif not flatten:
        x = x.reshape(-1, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.long)
    ids = torch.arange(len(y), dtype=torch.long)
    every = max(2, int(round(1.0 / test_fraction))) if test_fraction > 0 else 0
    is_test = (ids % every == 0) if every else torch.zeros_like(ids, dtype=torch.bool)
    split = {
        "train": np.flatnonzero(~is_test.numpy()),
        "test": np.flatnonzero(is_test.numpy()),
    }
    return {
        name: SampleSet({"x": x[idx], "y": y[idx]}, ids[idx]) for name, idx in split.items()
    }


def digits_dataset(*, test_fraction: float = 0.2) -> Any:
    """The digits as an HF ``DatasetDict`` (sample_id = row in the bundled file, image 8x8 in
    0..16, label), split as ``digits``."""
    import datasets
    from sklearn.datasets import load_digits

    bunch = load_digits()
    ids = np.arange(len(bunch.target), dtype=np.int64)
    every = max(2, int(round(1.0 / test_fraction))) if test_fraction > 0 else 0
    is_test = (ids % every == 0) if every else np.zeros(len(ids), dtype=bool)
    features = datasets.Features({
        "sample_id": datasets.Value("int64"), "image": datasets.Array2D((8, 8), "float32"),
        "label": datasets.ClassLabel(names=[str(d) for d in range(10)]),
    })
    images = bunch.images.astype(np.float32)
    return datasets.DatasetDict({
        name: datasets.Dataset.from_dict(
            {"sample_id": ids[rows], "image": images[rows], "label": bunch.target[rows]}, features=features)
        for name, rows in (("train", np.flatnonzero(~is_test)), ("test", np.flatnonzero(is_test)))
    })
