"""The exactly-once state machine between the request ledger and the model version store: the
one place that schedules, computes, publishes, marks applied, recognises a published batch and
follows a rollback. Campaigns (jobs/campaign_runner.py), the stream service (jobs/service.py)
and `unlearn versions rollback` (jobs/versions.py) all go through ``ExactlyOnce``.

A batch k of requests on parent version v moves like this (every step durable before the next):

  1. schedule : the ledger records the batch (requests, sample ids, parent v, seed) and moves its
                requests to ``scheduled``, in one transaction;
  2. recognise: a version published for this batch before a crash is found by its manifest's
                batch content hash (request ids, sample ids, seed, method, settings) and checked
                against the batch's request and sample ids - never by the batch's name - and
                  * is (an ancestor of) CURRENT: the batch is marked applied;
                  * was CURRENT once and was rolled back: the batch ends ``needs_retrain``
                    (a resume never re-publishes what an operator rolled back);
                  * sits on CURRENT, never current (killed between rename and pointer): adopted;
                  * anything else is an orphan: the batch is rebased on CURRENT and computed anew;
  3. compute  : the removal from the parent with the batch's seed (deterministic);
                an exception inside it closes the batch (``needs_retrain`` when the method says it
                cannot serve the request - an error class named ``*NotServed*`` or a record with
                ``needs_retrain`` - else ``failed``), with the reason; only I/O and store/ledger
                errors leave it scheduled, to be resumed;
  4. verify   : privacy budget (typed releases; ``certified`` / ``heuristic`` counted apart) and
                the retain-accuracy margin; a failed check ends ``needs_retrain``;
  5. publish  : version v' staged, fsynced, renamed, then CURRENT moved to it;
  6. applied  : the ledger marks the batch and its requests applied at v'.

Rollback (``rollback``): every ledger that recorded work on the model is opened and validated
BEFORE CURRENT moves; after the move, requests applied by versions left behind (and scheduled
batches whose published version was left behind) move to ``needs_retrain``. A kill between the
two is repaired by ``follow_rollbacks``, which every writer runs when it takes the model's lock.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from pydantic import ValidationError

from jobs.costs import EVENT as COSTS_EVENT, BatchCosts, new_lineage
from jobs.specs import LEDGER_FILE, Limits
from pipeline import memory
from pipeline.errors import RemovalNotServed
from pipeline.jsonio import jsonable
from pipeline.privacy.accountant import check_budget, release_from_record
from pipeline.privacy.release import Guarantee, PrivacyRelease
from pipeline.store.crashpoint import crash_point
from pipeline.store.ledger import BatchRow, Ledger, LedgerError
from pipeline.store.versions import VersionInfo, VersionStore, VersionStoreError

# Errors that say nothing about the batch (the disk, the store, the ledger, a memory budget that
# cannot hold one chunk of a stage on this machine now): the run stops and the batch stays
# scheduled, to be resumed (with a larger budget, or elsewhere). Every other exception from a
# removal closes its batch.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, VersionStoreError, LedgerError, memory.MemoryBudgetError)
# Below this noise multiplier the PLD accountant needs minutes and gigabytes (measured: z = 0.48
# takes 5 s, z = 0.097 takes 48 s and 1 GB; epsilon 10000 asked for 320 GiB).
MIN_PLD_NOISE_MULTIPLIER = 0.25


class _SplitBatch(Exception):
    """Internal: a multi-request stream batch whose removal raised; it is split, not closed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BatchInputError(ValueError):
    """Settings or requests that would make every batch fail; refused before anything is written."""


@dataclass(frozen=True)
class BatchResult:
    batch_key: str
    state: str
    version: int | None
    reason: str | None
    metrics: dict[str, Any] | None
    costs: dict[str, Any] | None = None  # what this process spent on the batch (jobs/costs.py), when it worked on it


# -- the typed privacy release -----------------------------------------------------------------
def release_of_record(record: dict[str, Any]) -> PrivacyRelease:
    """The removal's typed release (``pipeline.privacy.accountant.release_from_record``, the one reader)."""
    return release_from_record(record)


def guarantee_counts(releases: Iterable[PrivacyRelease]) -> dict[str, int]:
    counts = {g.value: 0 for g in Guarantee}
    for r in releases:
        counts[r.guarantee.value] += 1
    return counts


def is_not_served(err: BaseException) -> bool:
    """The method says a local step cannot serve this request (retrain instead)."""
    return isinstance(err, RemovalNotServed)


def batch_content_sha256(model: str, batch: BatchRow, method: str, settings: dict[str, Any]) -> str:
    """What a published version must match to be this batch's: its requests, samples, seed and method."""
    body = {"model": model, "origin": batch.origin, "index": batch.index, "request_ids": list(batch.request_ids),
            "sample_ids": list(batch.sample_ids), "seed": batch.seed, "method": method, "settings": settings}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


# -- validation before anything is written ----------------------------------------------------
def validate_settings(method: str, settings: dict[str, Any], limits: Limits, version_dir: Path, *,
                      first_seed: int, last_seed: int, field: str = "method", memory_budget: str | int = "auto") -> None:
    """What can be checked before a batch runs: the settings parse, named parameters exist in the
    model, the seeds fit [0, 2^63 - 1], epsilon is finite and the budget's composition can
    account for it, a set ``memory_budget`` holds one sample's passes through the model (``auto``
    is measured when each batch starts). Raises ``BatchInputError`` naming the field."""
    from pipeline.methods.base import MAX_SEED
    from pipeline.removal import method_ref

    if not (0 <= first_seed <= last_seed <= MAX_SEED):
        raise BatchInputError(
            f"seed: batches would use seeds {first_seed}..{last_seed}, outside [0, 2^63 - 1 = {MAX_SEED}]; "
            "choose a smaller seed")
    try:
        parsed = method_ref(method, settings).settings
    except (ValidationError, ValueError) as err:
        raise BatchInputError(f"{field}.settings are invalid: {err}") from None
    names = getattr(parsed, "parameters", None)
    if isinstance(names, (list, tuple)) and names:
        from safetensors import safe_open

        from pipeline.models.card import WEIGHTS_FILE

        with safe_open(str(version_dir / WEIGHTS_FILE), framework="pt") as fh:
            known = list(fh.keys())
        missing = [n for n in names if n not in known]
        if missing:
            raise BatchInputError(
                f"{field}.settings.parameters: {missing[:5]} are not parameters of the model "
                f"(it has {known[:12]}{' ...' if len(known) > 12 else ''}); name existing parameters")
    epsilon = getattr(parsed, "epsilon", None)
    if isinstance(epsilon, float) and math.isnan(epsilon):
        raise BatchInputError(f"{field}.settings.epsilon is NaN; give a positive number")
    if isinstance(epsilon, float) and math.isfinite(epsilon) and limits.budget.composition == "pld":
        delta = float(getattr(parsed, "delta", None) or limits.budget.delta)
        z = math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon
        if z < MIN_PLD_NOISE_MULTIPLIER:
            raise BatchInputError(
                f"{field}.settings.epsilon = {epsilon:g} (noise multiplier {z:.3g}) is too large for limits.budget.composition: "
                f"pld, whose accountant cannot represent noise below multiplier {MIN_PLD_NOISE_MULTIPLIER}; use "
                f"epsilon <= {math.sqrt(2.0 * math.log(1.25 / delta)) / MIN_PLD_NOISE_MULTIPLIER:.3g}, or composition: basic / rdp")
    validate_memory_budget(memory_budget, version_dir)


def validate_memory_budget(memory_budget: str | int, version_dir: Path) -> None:
    """A set ``memory_budget`` must hold one sample's forward and gradient passes through the
    model of ``version_dir`` (every method needs both; ``auto`` is measured when each batch
    starts). Raises ``BatchInputError`` naming the field. A later stage that needs more (a Hessian
    chunk, a probe pass) raises ``MemoryBudgetError`` when it starts, leaving its batch scheduled."""
    budget = memory.MemoryBudget.from_setting(memory_budget)
    if budget.source != "setting":
        return
    from pipeline.models.card import load_model_dir
    from pipeline.removal import training_set

    model, task, card = load_model_dir(version_dir)
    try:
        memory.check_one_sample(model, task, training_set(card, model), budget)
    except memory.MemoryBudgetError as err:
        raise BatchInputError(f"memory_budget: {err}") from None


# -- the machine -------------------------------------------------------------------------------
class ExactlyOnce:
    """One model's batches in one ledger, applied with one method, settings and limits.
    Every method is called inside ``store.lock(model)``."""

    def __init__(self, store: VersionStore, ledger: Ledger, model: str, *, method: Any = "lfoci-newton",
                 settings: Any = None, limits: Limits | None = None, cluster: Any = None,
                 remover: Callable[..., Any] | None = None, measure: Callable[..., dict[str, Any]] | None = None,
                 memory_budget: str | int = "auto") -> None:
        self.store, self.ledger, self.model = store, ledger, model
        # the working memory each stage of a batch's removal and verification may use ("auto": a
        # share of what the machine has free when the batch starts; ``pipeline.memory``)
        self.memory_budget = memory_budget
        from pipeline.removal import method_ref

        # the method a name or MethodRef means (a variant in configs/methods/, its settings on top), parsed once
        self.ref = method_ref(method, settings)
        self.method, self.settings = self.ref.method, self.ref.settings.model_dump(mode="json")
        # the method's prepared state for the version the next batch starts from (``pipeline.prepared``): kept
        # between batches, updated from a published removal where the maths allows, rebuilt where it does not
        # hold (another version, after a rollback or a restart)
        self.prepared: Any = None
        self._published_run: Any = None  # the last published removal: its next_prepared(), taken when needed
        self._lineage: str | None = None  # the cold build ``prepared`` descends from (jobs/costs.py)
        self._costs: dict[str, BatchCosts] = {}  # batch key -> what this process spent on it so far
        self._ledger_carry = 0.0  # seconds of the last cost record's write: charged to the next batch
        self._batch_costs: BatchCosts | None = None  # the batch being applied
        self.limits = limits or Limits()
        self.cluster = cluster  # cluster.hooks.ClusterOptions, or None: in this process
        self._remover = remover
        # verification metrics (default: RemovalMetrics, which keeps an unchanged frozen prefix's outputs
        # from batch to batch)
        self._measure = measure
        self._split_on_error = False
        # version -> its removal's release (None: not a removal); manifests are immutable once
        # published (never overwritten; prune keeps them), so each is read once, not per batch
        self._releases: dict[int, PrivacyRelease | None] = {}
        store.register_ledger(model, ledger.path)

    # -- follow a rollback ----------------------------------------------------------------------
    def follow_rollbacks(self) -> list[str]:
        return follow_rollbacks(self.store, self.ledger, self.model)

    # -- schedule -----------------------------------------------------------------------------
    def schedule(self, origin: str, index: int, request_ids: Sequence[str], seed: int) -> BatchRow:
        key = f"{origin}:{index}"
        costs = self._costs.setdefault(key, BatchCosts())
        with costs.stage("ledger"):
            batch = self.ledger.schedule_batch(batch_key=key, model=self.model, origin=origin, index=index,
                                               request_ids=list(request_ids),
                                               parent_version=self.store.current(self.model), seed=seed)
        crash_point("after_schedule")
        return batch

    def cancel(self, batch_key: str, reason: str) -> BatchResult:
        """Close a stuck scheduled batch as failed (its samples can be requested again)."""
        batch = self.ledger.get_batch(batch_key)
        if batch is None or batch.model != self.model:
            raise LedgerError(f"batch '{batch_key}' is not a batch of model '{self.model}' in {self.ledger.path}")
        if batch.state != "scheduled":
            raise LedgerError(f"batch '{batch_key}' is already {batch.state}; only a scheduled batch can be cancelled")
        published = self._published(batch)
        if published is not None and published.version in self.store.ancestors(self.model, self.store.current(self.model)):
            raise LedgerError(
                f"batch '{batch_key}' is already published as version {published.version}, which is current; "
                "resume to mark it applied, or roll the version back")
        self.ledger.finish_batch(batch_key, "failed", reason=f"cancelled by the operator: {reason}")
        return self.result(batch_key)

    # -- recognise -----------------------------------------------------------------------------
    def content_sha256(self, batch: BatchRow) -> str:
        return batch_content_sha256(self.model, batch, self.method, self.settings)

    def _published(self, batch: BatchRow) -> VersionInfo | None:
        found = self.store.find_published(self.model, self.content_sha256(batch), parent=batch.parent_version)
        if found is None:
            return None
        meta = found.manifest.get("batch") or {}
        if list(meta.get("request_ids", [])) != list(batch.request_ids) or list(meta.get("sample_ids", [])) != list(batch.sample_ids):
            return None
        return found

    # -- apply -----------------------------------------------------------------------------------
    def apply(self, batch: BatchRow, cumulative_ids: Sequence[int] = ()) -> BatchResult:
        """Bring a batch to a final state (see the module docstring); returns that state, with what
        this process spent on it (``costs``, also recorded in the ledger: ``jobs.costs``)."""
        if batch.state != "scheduled":
            return self.result(batch.batch_key)
        costs = self._costs.setdefault(batch.batch_key, BatchCosts())
        costs.add("ledger", self._ledger_carry)
        self._ledger_carry = 0.0
        self._batch_costs = costs
        try:
            result = self._apply(batch, cumulative_ids)
        finally:
            self._batch_costs = None
        self._costs.pop(batch.batch_key, None)
        record = costs.to_json(len(batch.request_ids))
        started = time.perf_counter()
        self.ledger.record_event(self.model, COSTS_EVENT, batch.batch_key, record)
        self._ledger_carry = time.perf_counter() - started
        return replace(result, costs=record)

    def _apply(self, batch: BatchRow, cumulative_ids: Sequence[int]) -> BatchResult:
        current = self.store.current(self.model)
        published = self._published(batch)
        if published is not None:
            if published.version in self.store.ancestors(self.model, current):
                return self._record_published(batch, published)
            if self.store.was_current(self.model, published.version):
                self.ledger.finish_batch(batch.batch_key, "needs_retrain", reason=_rolled_back(published.version, current))
                return self.result(batch.batch_key)
            if current == published.parent:
                return self._record_published(batch, published)
        if current != batch.parent_version:  # a rollback since scheduling (orphaning any version published for it)
            with self._stage("ledger"):
                self.ledger.rebase_batch(batch.batch_key, current)
            batch = self.ledger.get_batch(batch.batch_key)  # type: ignore[assignment]
        with self._stage("load"):
            parent = self.store.open_verified(self.model, batch.parent_version)
        return self._compute_and_publish(batch, parent, cumulative_ids)

    def _stage(self, name: str):
        """Time a stage of the batch being applied (``jobs.costs``); a no-op outside ``apply``."""
        return self._batch_costs.stage(name) if self._batch_costs is not None else nullcontext()

    def _compute_and_publish(self, batch: BatchRow, parent: VersionInfo, cumulative_ids: Sequence[int]) -> BatchResult:
        from pipeline.evaluate.removal_metrics import RemovalMetrics
        from pipeline.models.card import read_card

        with self._stage("load"):
            n = read_card(parent.path).training.n
        if len(batch.sample_ids) >= n:
            return self._close(batch, "needs_retrain", (
                f"the batch removes {len(batch.sample_ids)} samples, every one of the {n} training samples of version "
                f"{parent.version}; no update of the weights can serve it - retrain (or retire) the model"))
        budget = memory.MemoryBudget.from_setting(self.memory_budget)  # "auto": measured once, as the batch starts
        try:
            with memory.use_budget(budget):
                run = self._remove(parent.path, batch)
        except TRANSIENT_ERRORS:
            raise
        except Exception as err:  # noqa: BLE001 - deterministic: recorded, never retried forever
            reason = f"the removal failed: {type(err).__name__}: {err}"
            if self._split_on_error and len(batch.request_ids) > 1:
                raise _SplitBatch(reason) from None
            return self._close(batch, "needs_retrain" if is_not_served(err) else "failed", reason)
        if run.record.get("needs_retrain"):
            return self._close(batch, "needs_retrain", f"the method cannot serve this batch: {run.record['needs_retrain']}")
        crash_point("after_compute")
        try:
            with self._stage("verification"), memory.use_budget(budget):
                if self._measure is None:
                    self._measure = RemovalMetrics()
                metrics = self._measure(parent.path, run, batch.sample_ids, cumulative_ids)
                release = release_of_record(run.record)
                history = self._release_history()
                decision = check_budget(history, release, self.limits.budget)
        except TRANSIENT_ERRORS:
            raise
        except (ValidationError, ValueError, ArithmeticError, MemoryError) as err:
            return self._close(batch, "needs_retrain", f"the privacy accounting failed: {type(err).__name__}: {err}")
        counts = guarantee_counts([*history, release])
        privacy = jsonable({"release": release.model_dump(mode="json"), "guarantee": release.guarantee.value,
                               "releases": counts, "spent_before": decision.before.to_json(),
                               "spent_after": decision.after.to_json(), "budget": self.limits.budget.model_dump()})
        problems = [decision.reason] if decision.reason else []
        if getattr(self.limits.budget, "require_certified", False) and release.guarantee is not Guarantee.CERTIFIED:
            why = "; ".join(release.reasons) or release.guarantee.value
            problems.append(f"the budget requires certified releases but this one is {release.guarantee.value} ({why}); "
                            "use a method and settings whose bound holds, or set limits.budget.require_certified: false")
        margin, drop = self.limits.retain_accuracy_margin, metrics.get("retain_accuracy_drop")
        if margin is not None and drop is not None and drop > margin:
            problems.append(
                f"verification failed: retain accuracy fell by {drop:.4f} ({metrics['retain_accuracy_before']:.4f} -> "
                f"{metrics['retain_accuracy']:.4f}), more than the margin {margin}; retrain without these samples, "
                "or loosen limits.retain_accuracy_margin")
        if problems:
            return self._close(batch, "needs_retrain", "; ".join(problems), metrics={**metrics, "privacy": privacy})
        manifest = jsonable({
            "batch": {"key": batch.batch_key, "origin": batch.origin, "index": batch.index,
                      "request_ids": batch.request_ids, "sample_ids": batch.sample_ids, "seed": batch.seed,
                      "content_sha256": self.content_sha256(batch)},
            "method": self.method, "settings": run.record.get("settings"), "seed": batch.seed,
            "privacy": privacy, "metrics": metrics, "record": run.record,
        })
        with self._stage("publish"):
            info = self.store.publish(self.model, run.new_state, run.card, parent=batch.parent_version,
                                      manifest=manifest)
        self._published_run = run  # the next batch starts from this version: its state updated from this removal
        return self._record_published(batch, info)

    def _remove(self, model_dir: Path, batch: BatchRow):
        """The removal itself, in process or with its probe and curvature on Ray workers, inside
        the scoped memory budget (``memory_budget``; the workers get it when it is set)."""
        from pipeline.progress import StageProgress
        from pipeline.removal import remove

        costs = self._batch_costs or BatchCosts()
        started = time.perf_counter()
        if self._remover is not None:
            run = self._remover(model_dir, batch)
            self._charge_removal(costs, run, time.perf_counter() - started)
            return run
        if self._published_run is not None:  # (used only where it holds for this parent: run_removal checks)
            t = time.perf_counter()
            carried = self._published_run.next_prepared()
            costs.updated += time.perf_counter() - t
            costs.add("preparation", time.perf_counter() - t)
            self.prepared = carried or self.prepared
            self._published_run = None
        hook = StageProgress(f"batch {batch.index} ({self.ref.name})")
        started = time.perf_counter()
        if self.cluster is None:
            run = remove(model_dir, batch.sample_ids, method=self.ref, prepared=self.prepared, seed=batch.seed,
                         stage_hook=hook, memory_budget=memory.current_budget())
        else:
            from cluster.hooks import ray_removal_hooks

            with ray_removal_hooks(model_dir, self.cluster) as hooks:
                describe = hooks.pop("describe")
                run = remove(model_dir, batch.sample_ids, method=self.ref, prepared=self.prepared,
                             seed=batch.seed, stage_hook=hook, memory_budget=memory.current_budget(), **hooks)
                run.record["distributed"] = describe()
        self._charge_removal(costs, run, time.perf_counter() - started)
        self.prepared = run.prepared  # the parent's state: still the right one if this batch is not published
        return run

    def _charge_removal(self, costs: BatchCosts, run: Any, wall: float) -> None:
        """Split a removal call's wall time: a preparation it built (a new lineage), the method's
        removal, and the rest (loading the parent version and its data, checking the result)."""
        record = getattr(run, "record", None) or {}
        prep, fast = record.get("preparation") or {}, record.get("fast_path")
        if fast is not None:  # the stream's warm remover: its state built (or not) inside the call
            built_now = bool(fast.get("built"))
            built = float((fast.get("built") or {}).get("seconds") or 0.0)
            removal = wall - built
        else:
            built_now = bool(prep.get("built_for_this_request"))
            built = float(prep.get("seconds") or 0.0) if built_now else 0.0
            removal = float(record.get("removal_seconds") or 0.0) if prep else wall
        if built_now or self._lineage is None:
            self._lineage = new_lineage()
        costs.built += built
        costs.lineage = self._lineage
        costs.add("preparation", built)
        costs.add("removal", removal)
        costs.add("load", wall - built - removal)

    def _release_history(self) -> list[PrivacyRelease]:
        """The release of every published removal (rolled back or not: a release stays released),
        in version order, as ``store.removal_manifests`` gives them; each manifest read once."""
        out: list[PrivacyRelease] = []
        for v in self.store.versions(self.model):
            if v not in self._releases:
                manifest = self.store.manifest(self.model, v)
                self._releases[v] = self._manifest_release(manifest) if manifest.get("kind") == "removal" else None
            release = self._releases[v]
            if release is not None:
                out.append(release)
        return out

    @staticmethod
    def _manifest_release(manifest: dict[str, Any]) -> PrivacyRelease:
        raw = (manifest.get("privacy") or {}).get("release")
        return PrivacyRelease.model_validate(raw) if raw else PrivacyRelease.non_private()

    def _close(self, batch: BatchRow, state: str, reason: str, metrics: dict[str, Any] | None = None) -> BatchResult:
        with self._stage("ledger"):
            self.ledger.finish_batch(batch.batch_key, state, reason=reason, metrics=metrics)
        return self.result(batch.batch_key)

    def _record_published(self, batch: BatchRow, info: VersionInfo) -> BatchResult:
        """Steps 5-6 for a version that exists: CURRENT onto it (from its parent), then the ledger."""
        with self._stage("publish"):
            if self.store.current(self.model) == info.parent:
                self.store.set_current(self.model, info.version, expected=info.parent, kind="publish")
        privacy = info.manifest["privacy"]
        epsilon = privacy["release"].get("epsilon")
        with self._stage("ledger"):
            self.ledger.finish_batch(
                batch.batch_key, "applied", version=info.version, epsilon=math.inf if epsilon is None else epsilon,
                metrics={**info.manifest["metrics"],
                         "privacy": {"guarantee": privacy.get("guarantee"), "releases": privacy.get("releases"),
                                     "epsilon_total": privacy["spent_after"]["epsilon"],
                                     "delta_total": privacy["spent_after"]["delta"]}},
            )
        crash_point("after_ledger_applied")
        return self.result(batch.batch_key)

    def result(self, batch_key: str) -> BatchResult:
        row = self.ledger.get_batch(batch_key)
        assert row is not None
        first = self.ledger.get_request(row.request_ids[0]) if row.request_ids else None
        return BatchResult(row.batch_key, row.state, row.version, row.reason, first.metrics if first else None)

    # -- the stream's micro-batches ------------------------------------------------------------
    def apply_isolating(self, origin: str, request_ids: Sequence[str], seed_of: Callable[[int], int]) -> list[BatchResult]:
        """Apply requests as one batch; if the removal itself fails (not the budget or the
        verification) and the batch holds several requests, give them back and apply each alone,
        so one bad request does not fail the others."""
        index = len(self.ledger.batches(model=self.model, origin=origin))
        return self._apply_splitting(self.schedule(origin, index, request_ids, seed_of(index)), seed_of)

    def _apply_splitting(self, batch: BatchRow, seed_of: Callable[[int], int]) -> list[BatchResult]:
        self._split_on_error = True
        try:
            return [self.apply(batch)]
        except _SplitBatch as split:
            self.ledger.release_batch(batch.batch_key, f"split into single requests after: {split.reason}")
        finally:
            self._split_on_error = False
        out = []
        for rid in batch.request_ids:
            index = len(self.ledger.batches(model=self.model, origin=batch.origin))
            out.append(self.apply(self.schedule(batch.origin, index, [rid], seed_of(index))))
        return out

    def finish_leftovers(self, origin: str, seed_of: Callable[[int], int],
                         log: Callable[[str], None] = lambda _: None) -> list[BatchResult]:
        """Bring the scheduled batches a killed stream worker left to an end (split like new ones)."""
        out: list[BatchResult] = []
        for batch in self.ledger.batches(model=self.model, origin=origin, state="scheduled"):
            log(f"finishing batch {batch.batch_key} left from the last run")
            out += self._apply_splitting(batch, seed_of)
        return out


def _rolled_back(version: int, current: int) -> str:
    return (f"version {version}, which applied this request, was rolled back (current version: {current}); "
            "submit the request again or retrain")


def follow_rollbacks(store: VersionStore, ledger: Ledger, model: str) -> list[str]:
    """Requests applied by versions that are no longer ancestors of CURRENT, and scheduled batches
    whose published version was current once and no longer is, move to needs_retrain with the
    reason. Idempotent; returns the request ids moved."""
    current = store.current(model)
    alive = set(store.ancestors(model, current))
    moved: list[str] = []
    applied = ledger.requests(model=model, state="applied")
    for version in sorted({r.version for r in applied} - alive):
        ids = [r.request_id for r in applied if r.version == version]
        ledger.mark_needs_retrain(model, ids, _rolled_back(version, current))
        moved += ids
    gone = [v for v in store.versions(model) if v not in alive and store.was_current(model, v)]
    for v in gone:
        meta = store.manifest(model, v).get("batch") or {}
        batch = ledger.get_batch(meta["key"]) if meta.get("key") else None
        if batch is not None and batch.state == "scheduled" and batch.request_ids == meta.get("request_ids") \
                and batch.sample_ids == meta.get("sample_ids"):
            ledger.finish_batch(batch.batch_key, "needs_retrain", reason=_rolled_back(v, current))
            moved += batch.request_ids
    return moved


# -- rollback ----------------------------------------------------------------------------------
def ledgers_for(store: VersionStore, model: str, explicit: str | Path | None) -> list[Path]:
    """The ledgers a rollback must update: the one named, else every ledger recorded for the
    model plus the store's default one if it exists. Every one must be an existing file."""
    if explicit is not None:
        paths = [Path(explicit)]
    else:
        default = store.root / LEDGER_FILE
        paths = list(dict.fromkeys([*store.ledgers(model), *([default] if default.is_file() else [])]))
    for p in paths:
        if not p.is_file():
            raise LedgerError(
                f"ledger {p} does not exist{' (it is recorded as a ledger of this model)' if explicit is None else ''}; "
                "name the model's ledger file with --ledger; nothing was changed")
    return paths


def _record_rollback(ledger: Ledger, model: str, move: dict[str, Any], **extra: Any) -> None:
    """The ledger's ``rollback`` event of one pointer move (the CURRENT history entry), keyed by
    the move's time: a rerun finishing a killed rollback records it once, whether or not the
    killed run got as far as recording it."""
    key = f"rollback@{move['at']}"
    if any(e["key"] == key for e in ledger.events(model)):
        return
    ledger.record_event(model, "rollback", key, {"from": move["from"], "to": move["version"], "reason": move["reason"],
                                                 **extra})


def rollback(store: VersionStore, model: str, version: int, reason: str, ledger_paths: Sequence[Path]) -> tuple[int, int, list[str]]:
    """Inside ``store.lock(model)``: open and validate every ledger, then move CURRENT, then record
    the rollback and follow it in each ledger. Rolling back to the version that is already current
    only finishes a rollback a kill interrupted (an error if there is nothing to finish)."""
    ledgers = [Ledger(p, create=False) for p in ledger_paths]
    try:
        old = store.current(model)
        moved: list[str] = []
        if version == old:
            last = store.pointer(model)["history"][-1]
            for ledger in ledgers:
                followed = follow_rollbacks(store, ledger, model)
                if followed and last["kind"] == "rollback":  # a kill may have come before the event
                    _record_rollback(ledger, model, last, finished_after_kill=True)
                moved += followed
            if not moved:
                raise VersionStoreError(f"rollback target {version} is not older than the current version {old}; "
                                        "name an older version")
            return old, version, moved
        store.rollback(model, version, reason)
        crash_point("rollback_moved")
        move = store.pointer(model)["history"][-1]
        for ledger in ledgers:
            _record_rollback(ledger, model, move)
            crash_point("rollback_recorded")
            moved += follow_rollbacks(store, ledger, model)
        return old, version, moved
    finally:
        for ledger in ledgers:
            ledger.close()
