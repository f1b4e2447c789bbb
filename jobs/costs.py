"""What each batch of a campaign (or a stream micro-batch) cost, measured where it happens.

``ExactlyOnce`` times every stage of a batch with a ``BatchCosts`` and records it in the ledger
(event ``batch_costs``, keyed by the batch) once the batch reached its final state:

  preparation   building the method's prepared state for the parent version (when this batch
                built it: ``built``) or updating the previous version's state from the removal
                that made the parent (``updated``; ``RemovalRun.next_prepared``)
  load          reading the parent version: its sha256 check, the model and its training set
  removal       the method's removal on the prepared state (the record's ``removal_seconds``)
  verification  the verification metrics and the privacy accounting
  publish       writing the new version (staging, fsync, rename) and moving CURRENT
  ledger        the ledger's transactions of the batch (schedule, applied / closed, the cost
                record of the batch before)
  other         the rest of the batch's wall time (recognising an earlier publication, ...)

so that the stages sum to the batch's measured wall time. ``amortise`` turns the recorded
batches into per-request costs: a batch's stages split evenly over its requests, and a prepared
state's build seconds over every request served from it or from the states updated from it
(its ``lineage``: one cold build, then one update per published batch).
"""
from __future__ import annotations

import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

STAGES: tuple[str, ...] = ("preparation", "load", "removal", "verification", "publish", "ledger", "other")
EVENT = "batch_costs"


@dataclass
class BatchCosts:
    """The stages of one batch in this process (seconds), its start, and its prepared state."""

    seconds: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES if s != "other"})
    started: float = field(default_factory=time.perf_counter)
    built: float = 0.0        # seconds of a preparation built for this batch
    updated: float = 0.0      # seconds of updating the previous version's state for this batch
    lineage: str | None = None  # the cold build the state this batch ran from descends from

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, float(seconds))

    def to_json(self, requests: int) -> dict[str, Any]:
        """The record: stage seconds (``other`` = wall - the stages), the wall, the preparation."""
        wall = time.perf_counter() - self.started
        stages = {s: self.seconds.get(s, 0.0) for s in STAGES if s != "other"}
        stages["other"] = max(0.0, wall - sum(stages.values()))
        return {"seconds": stages, "wall_seconds": max(wall, sum(stages.values())), "requests": int(requests),
                "preparation": {"built": self.built, "updated": self.updated, "lineage": self.lineage}}


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


def amortise(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-request costs from recorded batches, in order; each item: ``batch_key``, ``request_ids``
    and ``costs`` (the list of ``BatchCosts.to_json`` records of that batch, one per process that
    worked on it; empty: not recorded, e.g. the process was killed before it could record them).

    A batch's stages are shared evenly by its requests, except the preparation: the seconds of a
    cold build are shared by every request of every batch that ran from its lineage, an update's
    by the requests of the batch it was made for. Returns per batch and per request the seconds
    by stage and their sum, and the means over the recorded requests."""
    lineage_requests: dict[str, int] = {}
    lineage_built: dict[str, float] = {}
    for b in batches:
        for c in b["costs"]:
            lineage = c["preparation"].get("lineage")
            if lineage is not None:
                lineage_requests[lineage] = lineage_requests.get(lineage, 0) + len(b["request_ids"])
                lineage_built[lineage] = lineage_built.get(lineage, 0.0) + float(c["preparation"].get("built") or 0.0)
    per_batch: list[dict[str, Any]] = []
    per_request: list[dict[str, Any]] = []
    for b in batches:
        n = max(1, len(b["request_ids"]))
        if not b["costs"]:
            per_batch.append({"batch_key": b["batch_key"], "recorded": False})
            continue
        share = {s: 0.0 for s in STAGES}
        wall = 0.0
        for c in b["costs"]:
            for s, v in c["seconds"].items():
                share[s] = share.get(s, 0.0) + float(v) / n
            # the preparation this batch paid = a cold build + an update: the build's share is the lineage's
            lineage, built = c["preparation"].get("lineage"), float(c["preparation"].get("built") or 0.0)
            if lineage is not None and lineage_requests.get(lineage):
                share["preparation"] += lineage_built[lineage] / lineage_requests[lineage] - built / n
            wall += float(c["wall_seconds"])
        total = sum(share.values())
        per_batch.append({"batch_key": b["batch_key"], "recorded": True, "requests": len(b["request_ids"]),
                          "wall_seconds": wall, "per_request": {**share, "sum": total},
                          "paid": {s: sum(float(c["seconds"].get(s, 0.0)) for c in b["costs"]) for s in STAGES},
                          "preparation_built": sum(float(c["preparation"].get("built") or 0.0) for c in b["costs"]),
                          "preparation_updated": sum(float(c["preparation"].get("updated") or 0.0) for c in b["costs"]),
                          "lives": len(b["costs"])})
        for rid in b["request_ids"]:
            per_request.append({"request_id": rid, "batch_key": b["batch_key"], "seconds": dict(share), "sum": total})
    count = len(per_request)
    mean: dict[str, float | None] = {s: (sum(r["seconds"][s] for r in per_request) / count if count else None)
                                     for s in STAGES}
    mean["sum"] = sum(r["sum"] for r in per_request) / count if count else None
    return {
        "stages": list(STAGES),
        "what": "seconds per request, measured per batch where each stage ran (jobs/costs.py): a batch's stages "
                "shared evenly by its requests; a prepared state's build shared by every request served from it "
                "and from the states updated from it, an update by the requests of its batch; sum = the batch's "
                "wall time per request",
        "mean_per_request": mean,
        "requests_recorded": count,
        "batches_not_recorded": [b["batch_key"] for b in per_batch if not b["recorded"]],
        "total_seconds": sum(b.get("wall_seconds", 0.0) for b in per_batch),
        "per_batch": per_batch,
        "per_request": per_request,
    }
