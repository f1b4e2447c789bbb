"""A deletion campaign: ingest every request durably, then apply them in deterministic batches
(request file order, ``batch_size`` per batch, batch k seeded with ``seed + k``), each batch on
the current version and published as a new one, then write the report.

Resumable at any point: ingestion is one transaction (all requests or none); each batch goes
through the exactly-once state machine (jobs/exactly_once.py), which recognises a batch that was
published before a crash and never re-publishes one an operator rolled back. ``resume``
re-enters the same loop; ``cancel_batch`` closes a stuck batch so the campaign can go on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from jobs.costs import STAGES
from jobs.exactly_once import BatchInputError, BatchResult, ExactlyOnce, validate_memory_budget, validate_settings
from pipeline.removal import training_set
from jobs.report import write_report
from jobs.specs import CampaignSpec
from pipeline.data.requests import DeletionRequest, read_requests
from pipeline.models.card import read_card
from pipeline.progress import bar as progress_bar, forced, note
from pipeline.store.crashpoint import crash_point
from pipeline.store.ledger import Ledger
from pipeline.store.versions import VersionStore


class RunningCosts:
    """What this run spent so far per request, by stage (``jobs.costs``; the preparation as paid,
    not amortised: the report amortises it)."""

    def __init__(self) -> None:
        self.requests, self.seconds = 0, {s: 0.0 for s in STAGES}

    def add(self, costs: dict | None) -> None:
        if costs:
            self.requests += costs["requests"]
            for s in STAGES:
                self.seconds[s] += costs["seconds"].get(s, 0.0)

    def describe(self, full: bool = False) -> str:
        if not self.requests:
            return "no batch applied in this run yet"
        total = sum(self.seconds.values()) / self.requests
        parts = ", ".join(f"{s} {v / self.requests:.3g}" for s, v in self.seconds.items() if full or v > 0)
        return f"{total:.3g} s/request ({parts})" + (f" over {self.requests} requests" if full else "")


class CampaignError(ValueError):
    """A campaign cannot start or resume as asked; the message says what to do instead."""


@dataclass(frozen=True)
class CampaignResult:
    campaign_id: str
    batches: list[BatchResult]
    final_version: int
    report_dir: Path


def spec_record(spec: CampaignSpec) -> dict:
    """The spec as stored in the ledger (JSON, paths resolved): a resume must present the same.
    ``memory_budget`` is left out: it changes how a removal is chunked, not what it computes, so a
    campaign may resume with another budget (on a smaller machine, or after a budget error)."""
    return spec.model_dump(mode="json", exclude={"memory_budget"})


def check_sample_ids(version_dir: Path, requests: Sequence[DeletionRequest], model: str, version: int) -> None:
    """Every sample id must be in the version's training set (not unknown, not already removed)."""
    known = set(training_set(read_card(version_dir)).sample_ids.tolist())
    bad = [(r.request_id, [i for i in r.sample_ids if i not in known]) for r in requests]
    bad = [(rid, ids) for rid, ids in bad if ids]
    if bad:
        listed = "; ".join(f"request '{rid}': {ids[:10]}" for rid, ids in bad[:5])
        raise CampaignError(
            f"{len(bad)} request(s) name sample ids that are not in the training set of model '{model}' version {version} "
            f"({listed}); use ids from the dataset's sample_id column that have not been removed yet"
        )


def read_campaign_requests(spec: CampaignSpec) -> list[DeletionRequest]:
    try:
        return read_requests(spec.requests)
    except RecursionError:
        raise CampaignError(f"request file {spec.requests} nests too deeply to read; requests are flat rows") from None


def validate_campaign(spec: CampaignSpec, store: VersionStore, requests: Sequence[DeletionRequest]) -> int:
    """Everything that can be checked before a write: the current version verifies, the sample ids
    are in its training set, the method settings fit the model, the seeds fit, a set memory budget
    holds one sample. Returns the version."""
    model = spec.model.name
    current = store.open_verified(model)  # refuses a tampered current version before anything is written
    check_sample_ids(current.path, requests, model, current.version)
    batches = -(-len(requests) // spec.batch_size)
    try:
        validate_settings(spec.method, None, spec.limits, current.path,
                          first_seed=spec.seed, last_seed=spec.seed + batches - 1, memory_budget=spec.memory_budget)
    except BatchInputError as err:
        raise CampaignError(str(err)) from None
    return current.version


def run_campaign(spec: CampaignSpec, *, resume: bool = False, progress: bool | None = None,
                 echo: Callable[[str], None] = print) -> CampaignResult:
    """Run (or with ``resume``, continue) a campaign to its end and write its report.
    ``progress``: bars on stderr (None: when stderr is a terminal or UNLEARN_PROGRESS=1); a bar
    over the batches and, inside each removal, one per stage (``pipeline.progress``)."""
    with forced(progress):
        return _run_campaign(spec, resume=resume, echo=echo)


def _run_campaign(spec: CampaignSpec, *, resume: bool, echo: Callable[[str], None]) -> CampaignResult:
    model = spec.model.name
    store = VersionStore(spec.model.store)
    store.require_model(model)
    requests: list[DeletionRequest] | None = None
    if not spec.ledger_path().exists():  # a new ledger: validate everything before creating it
        requests = read_campaign_requests(spec)
        validate_campaign(spec, store, requests)
    ledger = Ledger(spec.ledger_path())
    try:
        with store.lock(model):
            existing = ledger.get_campaign(spec.name)
            if existing is not None and not resume:
                raise CampaignError(
                    f"campaign '{spec.name}' already exists in {ledger.path} ({existing.state}); "
                    "continue it with `unlearn campaign resume`, or give the new campaign another name"
                )
            if existing is not None and existing.spec != spec_record(spec):
                raise CampaignError(
                    f"the spec of campaign '{spec.name}' differs from the one it was started with; "
                    "resume with the original spec file, or start a campaign under a new name"
                )
            if existing is not None and existing.model != model:
                raise CampaignError(f"campaign '{spec.name}' belongs to model '{existing.model}', not '{model}'")
            if existing is not None:  # a resume may bring another budget: checked as a new campaign's is
                try:
                    validate_memory_budget(spec.memory_budget, store.open_verified(model).path)
                except BatchInputError as err:
                    raise CampaignError(str(err)) from None
            machine = ExactlyOnce(store, ledger, model, method=spec.method,
                                  limits=spec.limits, cluster=spec.ray.options() if spec.ray else None,
                                  memory_budget=spec.memory_budget)
            machine.follow_rollbacks()
            if existing is None:
                requests = requests if requests is not None else read_campaign_requests(spec)
                validate_campaign(spec, store, requests)
                ledger.ingest_campaign(spec.name, model, spec_record(spec), requests)
                echo(f"accepted {len(requests)} requests into {ledger.path} (campaign '{spec.name}')")
            crash_point("after_ingest")

            request_ids = ledger.campaign_request_ids(spec.name)
            chunks = [request_ids[i : i + spec.batch_size] for i in range(0, len(request_ids), spec.batch_size)]
            origin = f"campaign:{spec.name}"
            results: list[BatchResult] = []
            removed: list[int] = []
            spent = RunningCosts()
            with progress_bar(len(chunks), f"campaign {spec.name}", unit="batch", leave=True) as bar:
                for k, chunk in enumerate(chunks):
                    batch = ledger.get_batch(f"{origin}:{k}")
                    if batch is None:
                        batch = machine.schedule(origin, k, chunk, spec.seed + k)
                    result = machine.apply(batch, cumulative_ids=[*removed, *batch.sample_ids])
                    if result.state == "applied":
                        removed += batch.sample_ids
                    results.append(result)
                    spent.add(result.costs)
                    bar.set_postfix_str(f"{result.state} v{result.version}; {spent.describe()}", refresh=False)
                    if result.costs:
                        note(f"batch {k}: {result.state} (version {result.version}), {result.costs['requests']} "
                             f"requests, {result.costs['wall_seconds'] / max(1, result.costs['requests']):.3g} s/request")
                    bar.update(1)
            crash_point("before_report")
            report_dir = write_report(store, ledger, spec.name, spec.report_path())
            crash_point("after_report")
            ledger.set_campaign_state(spec.name, "completed")
            final = store.current(model)
    finally:
        ledger.close()
    applied = sum(r.state == "applied" for r in results)
    echo(f"campaign '{spec.name}': {applied}/{len(results)} batches applied, model '{model}' at version {final}; "
         f"report in {report_dir}")
    if spent.requests:
        echo(f"  this run: {spent.describe(full=True)}")
    for r in results:
        if r.state != "applied":
            echo(f"  batch {r.batch_key}: {r.state}: {r.reason}")
    return CampaignResult(spec.name, results, final, report_dir)


def cancel_batch(spec: CampaignSpec, index: int, reason: str) -> BatchResult:
    """Close batch ``index`` of the campaign (stuck scheduled) as failed, under the model's lock."""
    model = spec.model.name
    store = VersionStore(spec.model.store)
    store.require_model(model)
    ledger = Ledger(spec.ledger_path(), create=False)
    try:
        with store.lock(model):
            if ledger.get_campaign(spec.name) is None:
                raise CampaignError(f"campaign '{spec.name}' is not in the ledger {ledger.path}")
            machine = ExactlyOnce(store, ledger, model, method=spec.method,
                                  limits=spec.limits)
            return machine.cancel(f"campaign:{spec.name}:{index}", reason)
    finally:
        ledger.close()
