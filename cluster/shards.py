"""The one shard planner: contiguous ranges of work aligned to a unit.

Used for the probe (perturbations, aligned to whole passes) and the curvature (samples,
aligned to whole batches), so that a shard computes exactly what the whole run computes there.
"""
from __future__ import annotations


def aligned_ranges(total: int, unit: int, shards: int, what: str = "items") -> list[tuple[int, int]]:
    """Split [0, total) into at most ``shards`` contiguous [start, stop) ranges whose starts
    are multiples of ``unit`` (whole units, spread as evenly as possible)."""
    if total < 1:
        raise ValueError(f"{what} must be >= 1, got {total}")
    if unit < 1:
        raise ValueError(f"the unit of {what} must be >= 1, got {unit}")
    units = -(-total // unit)
    shards = max(1, min(shards, units))
    base, extra = divmod(units, shards)
    ranges, first = [], 0
    for s in range(shards):
        count = base + (1 if s < extra else 0)
        ranges.append((first * unit, min(total, (first + count) * unit)))
        first += count
    return ranges
