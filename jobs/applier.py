"""Apply one scheduled batch of requests to a model: the step campaigns and the stream service
share. It wires the ledger and the version store (pipeline/store) to the maths
(``pipeline.removal.remove``) in an order that survives a kill at any point:

  1. the ledger already holds "batch k: requests [...] on parent version v, seed s"
     (``Ledger.schedule_batch``, committed before anything is computed);
  2. if a version whose manifest names batch k on parent v exists (and CURRENT is v or that
     version), the batch was published before a crash: only the pointer and the ledger are
     brought up to date (steps 6-7). If CURRENT moved elsewhere meanwhile (a rollback), the
     batch is rebased onto CURRENT and computed afresh; the orphaned version stays on disk;
  3. compute the removal from parent v with seed s (deterministic: same inputs, same bits);
  4. verify it: privacy budget (``pipeline.privacy``) and the retain-accuracy margin; a failed
     check closes the batch as needs_retrain with the reason, and nothing is published;
  5. publish version v' (staged, fsynced, renamed; the manifest names batch k and its requests);
  6. move CURRENT to v';
  7. mark the batch and its requests applied in the ledger, with v', epsilon and metrics.

Everything before step 7 is either invisible or found again by step 2, so a resumed run never
applies a request twice and ends with the same weights as an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipeline.evaluate.removal_metrics import removal_metrics
from pipeline.removal import remove
from jobs.specs import Limits
from pipeline.data.sampleset import SampleIdError
from pipeline.privacy.accountant import Release, check_budget
from pipeline.store.crashpoint import crash_point
from pipeline.store.ledger import BatchRow, Ledger
from pipeline.store.versions import VersionInfo, VersionStore

# A removal that raises one of these (bad ids, invalid settings, non-finite or singular maths:
# deterministic, so a retry would fail the same way) closes its batch as failed - recorded,
# never skipped. Anything else (a tampered parent, a full disk, out of memory) stops the run
# with the batch still scheduled, to be resumed.
REMOVAL_ERRORS: tuple[type[BaseException], ...] = (SampleIdError, ValueError, ArithmeticError, torch.linalg.LinAlgError)


@dataclass(frozen=True)
class BatchResult:
    batch_key: str
    state: str
    version: int | None
    reason: str | None
    metrics: dict[str, Any] | None


def release_of(manifest: dict[str, Any]) -> Release:
    r = manifest["privacy"]["release"]
    return Release(float(r["sigma"]), r.get("sensitivity"), float(r["epsilon"]), float(r["delta"]))


def sync_rollbacks(store: VersionStore, ledger: Ledger, model: str) -> list[str]:
    """Requests applied by versions that are no longer ancestors of CURRENT (rolled back) move to
    needs_retrain with the reason. Idempotent; returns the request ids moved."""
    current = store.current(model)
    alive = set(store.ancestors(model, current))
    moved: list[str] = []
    for version in sorted({r.version for r in ledger.requests(model=model, state="applied")} - alive):
        ids = [r.request_id for r in ledger.requests(model=model, state="applied") if r.version == version]
        ledger.mark_needs_retrain(model, ids, (
            f"version {version}, which applied this request, was rolled back (current version: {current}); "
            "submit the request again or retrain"
        ))
        moved += ids
    return moved


class BatchApplier:
    """Applies scheduled batches of one model with one method, settings and limits.
    Call inside ``store.lock(model)``."""

    def __init__(self, store: VersionStore, ledger: Ledger, model: str, *, method: str,
                 settings: dict[str, Any], limits: Limits, cluster: Any = None) -> None:
        self.store, self.ledger, self.model = store, ledger, model
        self.method, self.settings, self.limits = method, settings, limits
        self.cluster = cluster  # cluster.hooks.ClusterOptions, or None: in this process

    def _remove(self, model_dir: Any, batch: BatchRow):
        """The removal itself, in process or with its probe and curvature on Ray workers."""
        if self.cluster is None:
            return remove(model_dir, batch.sample_ids, method=self.method, settings=self.settings, seed=batch.seed)
        from cluster.hooks import ray_removal_hooks

        with ray_removal_hooks(model_dir, self.cluster) as hooks:
            describe = hooks.pop("describe")
            run = remove(model_dir, batch.sample_ids, method=self.method, settings=self.settings,
                         seed=batch.seed, **hooks)
            run.record["distributed"] = describe()
        return run

    def apply(self, batch: BatchRow, cumulative_ids: Sequence[int] = ()) -> BatchResult:
        """Bring ``batch`` to a final state (see the module docstring); returns that state."""
        if batch.state != "scheduled":
            return self._result(batch.batch_key)
        published = self.store.find_batch(self.model, batch.batch_key, parent=batch.parent_version)
        current = self.store.current(self.model)
        if published is not None and current in (published.version, published.parent):
            return self._record_published(batch, published)
        if current != batch.parent_version:  # a rollback since scheduling (orphaning any version published for it)
            self.ledger.rebase_batch(batch.batch_key, current)
            batch = self.ledger.get_batch(batch.batch_key)  # type: ignore[assignment]
        parent = self.store.open_verified(self.model, batch.parent_version)
        try:
            run = self._remove(parent.path, batch)
        except REMOVAL_ERRORS as err:
            self.ledger.finish_batch(batch.batch_key, "failed", reason=f"the removal failed: {type(err).__name__}: {err}")
            return self._result(batch.batch_key)
        crash_point("after_compute")
        metrics = removal_metrics(parent.path, run, batch.sample_ids, cumulative_ids)
        release = Release.from_record(run.record)
        history = [release_of(m) for m in self.store.removal_manifests(self.model)]
        decision = check_budget(history, release, self.limits.budget)
        privacy = {"release": release.to_json(), "spent_before": decision.before.to_json(),
                   "spent_after": decision.after.to_json(), "budget": self.limits.budget.model_dump()}
        problems = [decision.reason] if decision.reason else []
        margin, drop = self.limits.retain_accuracy_margin, metrics.get("retain_accuracy_drop")
        if margin is not None and drop is not None and drop > margin:
            problems.append(
                f"verification failed: retain accuracy fell by {drop:.4f} ({metrics['retain_accuracy_before']:.4f} -> "
                f"{metrics['retain_accuracy']:.4f}), more than the margin {margin}; retrain without these samples, "
                "or loosen limits.retain_accuracy_margin"
            )
        if problems:
            self.ledger.finish_batch(batch.batch_key, "needs_retrain", reason="; ".join(problems),
                                     metrics={**metrics, "privacy": privacy})
            return self._result(batch.batch_key)
        manifest = {
            "batch": {"key": batch.batch_key, "origin": batch.origin, "index": batch.index,
                      "request_ids": batch.request_ids, "sample_ids": batch.sample_ids, "seed": batch.seed},
            "method": self.method, "settings": run.record.get("settings"), "seed": batch.seed,
            "privacy": privacy, "metrics": metrics, "record": run.record,
        }
        info = self.store.publish(self.model, run.new_state, run.card, parent=batch.parent_version, manifest=manifest)
        return self._record_published(batch, info)

    def _record_published(self, batch: BatchRow, info: VersionInfo) -> BatchResult:
        """Steps 6-7 for a version that exists: CURRENT onto it (from its parent), then the ledger."""
        if self.store.current(self.model) != info.version:
            self.store.set_current(self.model, info.version, expected=info.parent, kind="publish")
        privacy = info.manifest["privacy"]
        self.ledger.finish_batch(
            batch.batch_key, "applied", version=info.version, epsilon=privacy["release"]["epsilon"],
            metrics={**info.manifest["metrics"], "privacy": {"epsilon_total": privacy["spent_after"]["epsilon"],
                                                             "delta_total": privacy["spent_after"]["delta"]}},
        )
        crash_point("after_ledger_applied")
        return self._result(batch.batch_key)

    def _result(self, batch_key: str) -> BatchResult:
        row = self.ledger.get_batch(batch_key)
        assert row is not None
        metrics = None
        if row.request_ids:
            first = self.ledger.get_request(row.request_ids[0])
            metrics = first.metrics if first else None
        return BatchResult(row.batch_key, row.state, row.version, row.reason, metrics)
