"""Forget-set builders: which training samples a removal request names.

Scenarios are reported separately (REFERENCE.md section 6):
  random  a seeded uniform draw of ``count`` ids (or ``fraction`` of the training set, at
          least one) - random-sample forgetting;
  class   every training sample whose label is in ``classes`` - whole-class / whole-identity
          forgetting (a person asking for all their face or re-ID images to be deleted).
Builders return sorted sample ids (never positions).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from pipeline.data.sampleset import SampleIdError, SampleSet


def random_forget_set(train: SampleSet, *, fraction: float | None = None, count: int | None = None,
                      seed: int = 0, **_: Any) -> list[int]:
    if (fraction is None) == (count is None):
        raise ValueError("forget set 'random': give exactly one of fraction or count")
    k = count if count is not None else max(1, int(round(float(fraction) * len(train))))
    if not 0 < k < len(train):
        raise SampleIdError(f"forget set 'random': {k} of {len(train)} samples; choose 1 <= k < n")
    rng = np.random.default_rng(seed)
    ids = train.sample_ids.numpy()[rng.choice(len(train), size=k, replace=False)]
    return sorted(int(i) for i in ids)


def class_forget_set(train: SampleSet, *, classes: Sequence[int] | int, label_column: str = "y",
                     **_: Any) -> list[int]:
    wanted = [classes] if isinstance(classes, int) else list(classes)
    labels = train.columns[label_column].numpy()
    if labels.ndim != 1:
        raise ValueError("forget set 'class' needs single-label targets")
    chosen = np.isin(labels, wanted)
    if not chosen.any():
        raise SampleIdError(f"forget set 'class': no training sample has a label in {wanted}")
    if chosen.all():
        raise SampleIdError("forget set 'class' would remove every training sample")
    return sorted(int(i) for i in train.sample_ids.numpy()[chosen])


FORGET_SETS: dict[str, Callable[..., list[int]]] = {"random": random_forget_set, "class": class_forget_set}


def build_forget_set(scenario: str, train: SampleSet, **options: Any) -> list[int]:
    if scenario not in FORGET_SETS:
        raise ValueError(f"forget scenario '{scenario}' is unknown; choose one of {sorted(FORGET_SETS)}")
    return FORGET_SETS[scenario](train, **options)
