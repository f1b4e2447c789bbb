"""The field's comparison table: UA, RA, TA, MIA-efficacy per model, and Avg. Gap to Retrain.

  UA  = 100 - acc(D_f)      RA = acc(D_r)      TA = acc(test)
  MIA = MIA-efficacy (``pipeline.evaluate.mia``)
  Avg. Gap = (1/4) sum_{m in {UA, RA, TA, MIA}} |m - m_Retrain|       (Jia et al., NeurIPS 2023)
For whole-class forgetting TA is measured on the test samples of the *remaining* classes
(the forgotten class has no correct answer left) and ``TA_forgotten`` on the forgotten class's
test samples is reported beside it (Retrain: ~0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.evaluate.classification import score_logits
from pipeline.evaluate.mia import mia_efficacy_from_logits
from pipeline.evaluate.predict import logits_of
from pipeline.tasks import Task

GAP_METRICS: tuple[str, ...] = ("UA", "RA", "TA", "MIA")


@dataclass
class EvalSets:
    forget: SampleSet
    retain: SampleSet
    test: SampleSet
    forgotten_test: SampleSet | None = None


def split_for_scenario(train: SampleSet, test: SampleSet, forget_ids: Sequence[int],
                       forgotten_classes: Sequence[int] | None = None) -> EvalSets:
    """D_f, D_r and the test set(s) for a forget set (class scenarios split the test set)."""
    positions = train.positions_of(list(forget_ids))
    forget, retain = train.take(positions), train.without(positions)
    if not forgotten_classes:
        return EvalSets(forget, retain, test)
    in_forgotten = torch.as_tensor(np.isin(test.columns["y"].numpy(), list(forgotten_classes)))
    return EvalSets(forget, retain, test.take(torch.nonzero(~in_forgotten).flatten()),
                    test.take(torch.nonzero(in_forgotten).flatten()))


def predict_sets(model: nn.Module, task: Task, sets: EvalSets, batch_size: int = 256) -> dict[str, Tensor]:
    """Logits on D_f, D_r, test (and the forgotten classes' test samples): one pass each."""
    out = {name: logits_of(model, task, getattr(sets, name), batch_size) for name in ("forget", "retain", "test")}
    if sets.forgotten_test is not None and len(sets.forgotten_test):
        out["forgotten_test"] = logits_of(model, task, sets.forgotten_test, batch_size)
    return out


def score(model: nn.Module, task: Task, sets: EvalSets, *, mia_feature: str = "confidence",
          seed: int = 0, batch_size: int = 256, logits: dict[str, Tensor] | None = None,
          mia_max_shadow: int | None = 5000, mia_repeats: int = 1) -> dict[str, float]:
    """UA, RA, TA, MIA (and TA_forgotten for class scenarios) from one forward pass per set.
    ``mia_max_shadow`` caps the members and non-members the MIA's SVC is fitted on;
    ``mia_repeats``: the MIA is the mean over that many independent draws of them."""
    logits = logits or predict_sets(model, task, sets, batch_size)
    y = {name: getattr(sets, name).columns["y"] for name in logits}
    row = {
        "UA": 100.0 - score_logits(logits["forget"], y["forget"], task),
        "RA": score_logits(logits["retain"], y["retain"], task),
        "TA": score_logits(logits["test"], y["test"], task),
    }
    row["MIA"] = mia_efficacy_from_logits(task, (logits["retain"], y["retain"]), (logits["test"], y["test"]),
                                          (logits["forget"], y["forget"]), feature=mia_feature, seed=seed,
                                          max_shadow=mia_max_shadow, repeats=mia_repeats)
    if "forgotten_test" in logits:
        row["TA_forgotten"] = score_logits(logits["forgotten_test"], y["forgotten_test"], task)
    return row


def avg_gap(row: dict[str, float], reference: dict[str, float], metrics: Sequence[str] = GAP_METRICS) -> float:
    """Mean absolute difference to the reference (Retrain) over ``metrics``."""
    return float(np.mean([abs(row[m] - reference[m]) for m in metrics]))


def format_table(rows: dict[str, dict[str, float]], columns: Sequence[str] = (*GAP_METRICS, "AvgGap", "seconds")) -> str:
    """A fixed-width text table (rows: method -> metrics)."""
    header = f"{'method':<16}" + "".join(f"{c:>10}" for c in columns)
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        cells = "".join(f"{row[c]:>10.2f}" if isinstance(row.get(c), (int, float)) else f"{'-':>10}" for c in columns)
        lines.append(f"{name:<16}{cells}")
    return "\n".join(lines)
