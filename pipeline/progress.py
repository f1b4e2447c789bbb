"""Progress bars (tqdm, with the estimated time left) for long loops, on stderr only.

Quiet unless stderr is a terminal; ``UNLEARN_PROGRESS=0`` turns every bar off and
``UNLEARN_PROGRESS=1`` forces them on (e.g. in a log you tail). ``UNLEARN_PROGRESS_INTERVAL``
sets the seconds between redraws (default 0.5). Nothing here changes results: bars only read
counters, never tensors, and nothing is ever written to stdout (it carries the JSON results).

Pieces:
  ``bar`` / ``track``   a tqdm bar (a disabled one when progress is off);
  ``Steps``             a bar over the named steps of a job (``with steps.step("retrain"): ...``);
  ``StageProgress``     a ``pipeline.methods.base.StageHook``: a bar per removal stage (probe,
                        selection, gradients, curvature and solve, verify ...), then its seconds;
  ``tick``              called from long inner loops (probe passes, Hessian columns, CG
                        iterations): advances the bar of the stage running in this thread, if
                        any, and costs one context-variable lookup otherwise.
"""
from __future__ import annotations

import contextvars
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")
ENV = "UNLEARN_PROGRESS"
INTERVAL_ENV = "UNLEARN_PROGRESS_INTERVAL"


def enabled() -> bool:
    """Bars are shown when stderr is a TTY, unless UNLEARN_PROGRESS says otherwise."""
    flag = os.environ.get(ENV, "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


@contextmanager
def forced(on: bool | None) -> Iterator[None]:
    """Within the block, bars are on (True) or off (False) whatever stderr is; None: unchanged.
    (A command's --progress/--no-progress; sets UNLEARN_PROGRESS for the block and restores it.)"""
    if on is None:
        yield
        return
    before = os.environ.get(ENV)
    os.environ[ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, "0.5")))
    except ValueError:
        return 0.5


def bar(total: int | None = None, desc: str = "", unit: str = "it", leave: bool = False, **kwargs: Any):
    """A tqdm bar on stderr (a disabled one when progress is off): ``with bar(n) as b: b.update()``."""
    from tqdm.auto import tqdm

    kwargs.setdefault("mininterval", _interval())
    return tqdm(total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, disable=not enabled(),
                dynamic_ncols=True, **kwargs)


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


def meter_line(n: int, total: int | None, elapsed: float, desc: str = "", unit: str = "it") -> str:
    """tqdm's bar as one line of text (count, elapsed<time left, rate), for a loop whose body
    writes to the terminal itself (e.g. subprocesses with their own bars): print it with ``note``."""
    from tqdm import tqdm

    return tqdm.format_meter(n, total, elapsed, ncols=100, prefix=desc, unit=unit)


class Steps:
    """A bar over the named steps of one job, with the time left; each finished step is noted
    with its seconds. ``with Steps(["retrain", "lfoci-newton"], "eval") as s:
    with s.step("retrain"): ...``. Off: the steps just run."""

    def __init__(self, names: Sequence[str] | int, desc: str, unit: str = "step") -> None:
        self.desc = desc
        total = names if isinstance(names, int) else len(names)
        self._bar = bar(total, desc, unit=unit, leave=True)

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._bar.set_description_str(self.desc, refresh=False)
        self._bar.close()

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        self._bar.set_description_str(f"{self.desc}: {name}", refresh=True)
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            note(f"{self.desc}: {name} failed after {time.perf_counter() - started:.1f} s")
            raise
        self._bar.update(1)
        note(f"{self.desc}: {name} done in {time.perf_counter() - started:.1f} s")


_ACTIVE: contextvars.ContextVar["StageProgress | None"] = contextvars.ContextVar("unlearn_stage", default=None)


def tick(n: int = 1, *, total: int | None = None, phase: str | None = None, unit: str = "it",
         **postfix: Any) -> None:
    """Advance the bar of the removal stage running in this thread by ``n`` (no-op without one).

    ``phase`` names the inner loop (e.g. "CG iterations"); a new phase restarts the bar with its
    own ``total`` and ``unit`` so that the time left is the loop's. ``postfix``: values shown beside it
    (floats as ``.2e``), formatted only when a bar is shown."""
    active = _ACTIVE.get()
    if active is not None:
        active.advance(n, total=total, phase=phase, unit=unit, postfix=postfix)


STAGE_FORMAT = "{desc}: {elapsed}{postfix}"


class StageProgress:
    """StageHook: a bar per removal stage (elapsed; inner loops that ``tick`` give it a count
    and the time left), and a line with the stage's duration when it finishes."""

    def __init__(self, label: str = "removal") -> None:
        self.label = label
        self._bar = None
        self._stage = ""
        self._phase: str | None = None
        self._token: contextvars.Token | None = None

    def started(self, stage: str) -> None:
        if not enabled():
            return
        self._stage, self._phase = stage, None
        # Until an inner loop ticks: the stage and its elapsed time (no count to show).
        self._bar = bar(None, f"{self.label}: {stage}", bar_format=STAGE_FORMAT)
        self._bar.refresh()
        self._token = _ACTIVE.set(self)

    def advance(self, n: int, *, total: int | None, phase: str | None, unit: str, postfix: dict[str, Any]) -> None:
        b = self._bar
        if b is None:
            return
        if phase != self._phase or b.bar_format is not None:
            self._phase = phase
            b.bar_format, b.unit = None, unit
            b.reset(total=total)
            b.set_description_str(f"{self.label}: {self._stage}" + (f" [{phase}]" if phase else ""), refresh=False)
        elif total is not None and b.total != total:
            b.total = total
        if postfix:
            b.set_postfix({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in postfix.items()}, refresh=False)
        b.update(n)

    def finished(self, stage: str, seconds: float) -> None:
        if self._token is not None:
            try:
                _ACTIVE.reset(self._token)
            except ValueError:  # finished in another context than started: just clear it
                _ACTIVE.set(None)
            self._token = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        note(f"{self.label}: {stage} done in {seconds:.1f} s")
