"""Progress bars (tqdm, with the estimated time left) for long loops, on stderr only.

Quiet unless stderr is a terminal; ``UNLEARN_PROGRESS=0`` turns every bar off and
``UNLEARN_PROGRESS=1`` forces them on (e.g. in a log you tail). Nothing here changes results.
``StageProgress`` is a ``pipeline.methods.base.StageHook`` that shows each removal stage
(probe, selection, curvature, solve, ...) as it starts and its seconds when it ends.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")
ENV = "UNLEARN_PROGRESS"


def enabled() -> bool:
    """Bars are shown when stderr is a TTY, unless UNLEARN_PROGRESS says otherwise."""
    flag = os.environ.get(ENV, "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(total: int | None = None, desc: str = "", unit: str = "it", leave: bool = False, **kwargs: Any):
    """A tqdm bar on stderr (a disabled one when progress is off): ``with bar(n) as b: b.update()``."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, disable=not enabled(),
                dynamic_ncols=True, mininterval=0.5, **kwargs)


def track(iterable: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it",
          leave: bool = False) -> Iterator[T]:
    """Iterate with a bar (elapsed, rate and time left); a plain iteration when off."""
    if not enabled():
        yield from iterable
        return
    with bar(total if total is not None else _len(iterable), desc, unit, leave) as b:
        for item in iterable:
            yield item
            b.update(1)


def _len(iterable: Iterable[Any]) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def note(message: str) -> None:
    """One line on stderr, shown when progress is on (does not break an open bar)."""
    if enabled():
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)


class StageProgress:
    """StageHook: a status line per removal stage, with its duration when it finishes."""

    def __init__(self, label: str = "removal") -> None:
        self.label = label
        self._bar = None

    def started(self, stage: str) -> None:
        if not enabled():
            return
        self._bar = bar(None, f"{self.label}: {stage}", unit="stage")
        self._bar.refresh()

    def finished(self, stage: str, seconds: float) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        note(f"{self.label}: {stage} done in {seconds:.1f} s")
