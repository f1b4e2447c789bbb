"""Deterministic crash points for durability tests.

``UNLEARN_CRASH_AT=<name>:<count>`` makes the ``count``-th call of ``crash_point(name)`` in
this process kill the process with SIGKILL (a real ``kill -9``: no cleanup, no flush, no
atexit). Unset (the normal case), ``crash_point`` costs one dictionary look-up.
"""
from __future__ import annotations

import os
import signal
from collections import Counter

ENV_VAR = "UNLEARN_CRASH_AT"
_hits: Counter[str] = Counter()


def _target() -> tuple[str, int] | None:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    name, _, count = raw.partition(":")
    return name, int(count or 1)


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``UNLEARN_CRASH_AT`` names this point and hit count."""
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] += 1
    if _hits[name] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
