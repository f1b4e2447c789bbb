"""Removal curves: accuracy on the removed and the retained samples as removals accumulate.

Given an order of forget ids and a step size s, after k steps the first k*s ids are removed
(each step is one removal request applied to the previous step's model). At every step we
record acc(removed so far), acc(retained so far), acc(test) and the step's wall time. The
removal itself is a callback (``step_fn(model_state, ids) -> new model``) so the maths here
knows nothing of model directories, ledgers or clusters.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import nn

from pipeline.data.sampleset import SampleSet
from pipeline.evaluate.classification import task_accuracy
from pipeline.progress import track
from pipeline.tasks import Task

StepFn = Callable[[Sequence[int]], nn.Module]


@dataclass
class RemovalCurve:
    removed: list[int] = field(default_factory=list)
    forget_accuracy: list[float] = field(default_factory=list)
    retain_accuracy: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    label: str = ""

    def as_dict(self) -> dict:
        return {"label": self.label, "removed": self.removed, "forget_accuracy": self.forget_accuracy,
                "retain_accuracy": self.retain_accuracy, "test_accuracy": self.test_accuracy, "seconds": self.seconds}


def removal_curve(
    model: nn.Module, task: Task, train: SampleSet, test: SampleSet, order: Sequence[int], step: int,
    step_fn: StepFn, *, label: str = "", batch_size: int = 256,
) -> RemovalCurve:
    """Apply ``step_fn`` to successive chunks of ``order`` (``step`` ids each) and measure."""
    if step < 1:
        raise ValueError(f"curve step must be >= 1, got {step}")
    curve = RemovalCurve(label=label)
    removed: list[int] = []

    def measure(current: nn.Module, seconds: float) -> None:
        if removed:
            pos = train.positions_of(removed)
            forget, retain = train.take(pos), train.without(pos)
            curve.forget_accuracy.append(task_accuracy(current, task, forget, batch_size))
        else:
            retain = train
            curve.forget_accuracy.append(float("nan"))
        curve.retain_accuracy.append(task_accuracy(current, task, retain, batch_size))
        curve.test_accuracy.append(task_accuracy(current, task, test, batch_size))
        curve.removed.append(len(removed))
        curve.seconds.append(seconds)

    measure(model, 0.0)
    for start in track(range(0, len(order), step), desc=f"removal curve ({label})", unit="removal"):
        chunk = [int(i) for i in order[start:start + step]]
        started = time.perf_counter()
        model = step_fn(chunk)
        removed.extend(chunk)
        measure(model, time.perf_counter() - started)
    return curve
