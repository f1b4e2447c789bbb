"""The request ledger: a SQLite database (WAL journal, ``synchronous=FULL``) recording every
deletion request, the batches that apply them, campaigns and an audit trail of events.

Durability: every public write runs in one ``BEGIN IMMEDIATE ... COMMIT`` transaction and
returns only after the commit, so a caller may acknowledge a request as soon as ``submit``
returns. Request states move along

    accepted -> scheduled -> applied | failed | needs_retrain
    accepted -> failed | needs_retrain
    applied  -> needs_retrain          (only when the version that applied it is rolled back)
    scheduled -> accepted              (only by ``release_batch``: its batch published nothing)

and any other move raises ``TransitionError`` (so nothing is applied twice). Submitting the same
request id again with the same content is a no-op; with different content it raises
``LedgerConflictError``. A sample id may belong to at most one active (accepted, scheduled or
applied) request of a model: ``SampleConflictError`` otherwise.
"""
from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Sequence

from pipeline.checkpoint import atomic_write_bytes
from pipeline.data.requests import DeletionRequest
from pipeline.store.crashpoint import crash_point

STATES = ("accepted", "scheduled", "applied", "failed", "needs_retrain")
TRANSITIONS: dict[str, frozenset[str]] = {
    "accepted": frozenset({"scheduled", "failed", "needs_retrain"}),
    "scheduled": frozenset({"applied", "failed", "needs_retrain"}),
    "applied": frozenset({"needs_retrain"}),
    "failed": frozenset(),
    "needs_retrain": frozenset(),
}
ACTIVE_STATES = ("accepted", "scheduled", "applied")
BATCH_FINAL_STATES = ("applied", "failed", "needs_retrain")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id     TEXT NOT NULL UNIQUE,
    model          TEXT NOT NULL,
    subject        TEXT NOT NULL,
    sample_ids     TEXT NOT NULL,
    content_sha256 TEXT NOT NULL,
    origin         TEXT NOT NULL,
    received_at    TEXT NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('accepted','scheduled','applied','failed','needs_retrain')),
    batch_key      TEXT,
    version        INTEGER,
    epsilon_spent  REAL,
    metrics        TEXT,
    error          TEXT,
    updated_at     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_model_state ON requests (model, state, seq);
CREATE TABLE IF NOT EXISTS request_samples (
    model      TEXT NOT NULL,
    sample_id  INTEGER NOT NULL,
    request_id TEXT NOT NULL REFERENCES requests (request_id),
    PRIMARY KEY (model, sample_id, request_id)
);
CREATE TABLE IF NOT EXISTS batches (
    batch_key      TEXT PRIMARY KEY,
    model          TEXT NOT NULL,
    origin         TEXT NOT NULL,
    idx            INTEGER NOT NULL,
    request_ids    TEXT NOT NULL,
    sample_ids     TEXT NOT NULL,
    parent_version INTEGER NOT NULL,
    seed           INTEGER NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('scheduled','applied','failed','needs_retrain')),
    version        INTEGER,
    reason         TEXT,
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL,
    UNIQUE (origin, idx)
);
CREATE TABLE IF NOT EXISTS campaigns (
    campaign_id  TEXT PRIMARY KEY,
    model        TEXT NOT NULL,
    spec         TEXT NOT NULL,
    spec_sha256  TEXT NOT NULL,
    state        TEXT NOT NULL,
    created_at   TEXT NOT NULL,
    updated_at   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS campaign_requests (
    campaign_id TEXT NOT NULL REFERENCES campaigns (campaign_id),
    position    INTEGER NOT NULL,
    request_id  TEXT NOT NULL UNIQUE REFERENCES requests (request_id),
    PRIMARY KEY (campaign_id, position)
);
CREATE TABLE IF NOT EXISTS events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      TEXT NOT NULL,
    model   TEXT NOT NULL,
    kind    TEXT NOT NULL,
    key     TEXT,
    detail  TEXT NOT NULL
);
"""
TABLES = ("requests", "request_samples", "batches", "campaigns", "campaign_requests", "events")


class LedgerError(RuntimeError):
    """The ledger cannot be opened or a write is not allowed."""


class LedgerConflictError(LedgerError):
    """The same id was submitted before with different content."""


class SampleConflictError(LedgerError):
    """A sample id already belongs to another active request of the same model."""


class TransitionError(LedgerError):
    """A request or batch state change that the state machine does not allow."""


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def content_sha256(model: str, request: DeletionRequest) -> str:
    body = json.dumps({"model": model, **request.content()}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass(frozen=True)
class RequestRow:
    seq: int
    request_id: str
    model: str
    subject: str
    sample_ids: list[int]
    origin: str
    received_at: str
    state: str
    batch_key: str | None
    version: int | None
    epsilon_spent: float | None
    metrics: dict[str, Any] | None
    error: str | None
    updated_at: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BatchRow:
    batch_key: str
    model: str
    origin: str
    index: int
    request_ids: list[str]
    sample_ids: list[int]
    parent_version: int
    seed: int
    state: str
    version: int | None
    reason: str | None


@dataclass(frozen=True)
class CampaignRow:
    campaign_id: str
    model: str
    spec: dict[str, Any]
    spec_sha256: str
    state: str


def _request_row(r: sqlite3.Row) -> RequestRow:
    return RequestRow(
        seq=r["seq"], request_id=r["request_id"], model=r["model"], subject=r["subject"],
        sample_ids=json.loads(r["sample_ids"]), origin=r["origin"], received_at=r["received_at"],
        state=r["state"], batch_key=r["batch_key"], version=r["version"], epsilon_spent=r["epsilon_spent"],
        metrics=json.loads(r["metrics"]) if r["metrics"] is not None else None, error=r["error"],
        updated_at=r["updated_at"],
    )


def _batch_row(r: sqlite3.Row) -> BatchRow:
    return BatchRow(
        batch_key=r["batch_key"], model=r["model"], origin=r["origin"], index=r["idx"],
        request_ids=json.loads(r["request_ids"]), sample_ids=json.loads(r["sample_ids"]),
        parent_version=r["parent_version"], seed=r["seed"], state=r["state"], version=r["version"],
        reason=r["reason"],
    )


class Ledger:
    """One SQLite ledger file. Thread-safe (one connection behind a lock); several processes
    may open the same file (SQLite serialises writers)."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        """``create=False``: the file must already be a ledger (nothing is created or added)."""
        self.path = Path(path)
        self._lock = threading.RLock()
        if not create and not self.path.is_file():
            raise LedgerError(f"ledger {self.path} does not exist; point --ledger at the model's ledger file")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
            if not create:
                tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if not set(TABLES) <= tables:
                    self._conn.close()
                    raise LedgerError(f"{self.path} is an SQLite file but not a ledger (tables missing: "
                                      f"{sorted(set(TABLES) - tables)}); point --ledger at the model's ledger file")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.execute("PRAGMA busy_timeout=30000")
            with self._tx() as conn:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
        except sqlite3.DatabaseError as err:
            raise LedgerError(f"ledger {self.path} is not a usable SQLite database ({err}); point --ledger at a ledger file or a new path") from None

    # -- plumbing ----------------------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (durably) when the block ends without error."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._rollback()
                raise
            try:
                self._conn.execute("COMMIT")
            except BaseException:  # a failed COMMIT leaves the transaction open: end it
                self._rollback()
                raise

    def _rollback(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _event(self, conn: sqlite3.Connection, model: str, kind: str, key: str | None, detail: dict[str, Any]) -> None:
        conn.execute(
            "INSERT INTO events (at, model, kind, key, detail) VALUES (?, ?, ?, ?, ?)",
            (utc_now(), model, kind, key, json.dumps(detail, sort_keys=True)),
        )

    def record_event(self, model: str, kind: str, key: str | None, detail: dict[str, Any]) -> None:
        with self._tx() as conn:
            self._event(conn, model, kind, key, detail)

    # -- requests ----------------------------------------------------------------------------
    def _insert_request(self, conn: sqlite3.Connection, model: str, request: DeletionRequest, origin: str) -> RequestRow | None:
        """Insert a new request; returns the existing row for an identical resubmission."""
        digest = content_sha256(model, request)
        old = conn.execute("SELECT * FROM requests WHERE request_id = ?", (request.request_id,)).fetchone()
        if old is not None:
            if old["content_sha256"] != digest:
                raise LedgerConflictError(
                    f"request_id '{request.request_id}' was already submitted with different content "
                    f"(model '{old['model']}', subject/sample ids differ); use a new request_id"
                )
            return _request_row(old)
        marks = ",".join("?" * len(request.sample_ids))
        clash = conn.execute(
            f"SELECT s.sample_id, r.request_id, r.state FROM request_samples s JOIN requests r USING (request_id) "
            f"WHERE s.model = ? AND r.state IN ('accepted','scheduled','applied') AND s.sample_id IN ({marks}) "
            "ORDER BY s.sample_id LIMIT 5",
            (model, *request.sample_ids),
        ).fetchall()
        if clash:
            desc = ", ".join(f"{c['sample_id']} (request '{c['request_id']}', {c['state']})" for c in clash)
            raise SampleConflictError(
                f"request '{request.request_id}': sample ids already claimed by other requests of model '{model}': {desc}; "
                "a sample is removed once - drop these ids from the request"
            )
        now = utc_now()
        conn.execute(
            "INSERT INTO requests (request_id, model, subject, sample_ids, content_sha256, origin, received_at, state, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'accepted', ?)",
            (request.request_id, model, request.subject, json.dumps(list(request.sample_ids)), digest, origin, now, now),
        )
        conn.executemany(
            "INSERT INTO request_samples (model, sample_id, request_id) VALUES (?, ?, ?)",
            [(model, int(s), request.request_id) for s in request.sample_ids],
        )
        return None

    def submit(self, model: str, request: DeletionRequest, origin: str) -> tuple[RequestRow, bool]:
        """Record a request durably. Returns (row, created); created is False for an identical resubmission."""
        with self._tx() as conn:
            existing = self._insert_request(conn, model, request, origin)
        if existing is not None:
            return existing, False
        row = self.get_request(request.request_id)
        assert row is not None
        return row, True

    def get_request(self, request_id: str) -> RequestRow | None:
        rows = self._query("SELECT * FROM requests WHERE request_id = ?", (request_id,))
        return _request_row(rows[0]) if rows else None

    @staticmethod
    def _where(**equal: Any) -> tuple[list[str], list[Any]]:
        """SQL clauses and arguments for the given column = value filters (None: no filter)."""
        pairs = [(column, value) for column, value in equal.items() if value is not None]
        return [f"{column} = ?" for column, _ in pairs], [value for _, value in pairs]

    def requests(self, *, model: str | None = None, state: str | None = None, origin: str | None = None,
                 origin_prefix: str | None = None, limit: int | None = None) -> list[RequestRow]:
        """Requests in arrival order, filtered by exact fields and/or an origin prefix."""
        clauses, args = self._where(model=model, state=state, origin=origin)
        if origin_prefix is not None:
            clauses.append("substr(origin, 1, ?) = ?")
            args += [len(origin_prefix), origin_prefix]
        sql = "SELECT * FROM requests" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY seq"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [_request_row(r) for r in self._query(sql, args)]

    def _move(self, conn: sqlite3.Connection, request_id: str, new_state: str, **fields: Any) -> None:
        row = conn.execute("SELECT state FROM requests WHERE request_id = ?", (request_id,)).fetchone()
        if row is None:
            raise LedgerError(f"request '{request_id}' is not in the ledger")
        if new_state not in TRANSITIONS[row["state"]]:
            raise TransitionError(f"request '{request_id}' cannot move from {row['state']} to {new_state}")
        sets = ["state = ?", "updated_at = ?"] + [f"{k} = ?" for k in fields]
        values = [new_state, utc_now()] + [json.dumps(v, sort_keys=True) if k == "metrics" and v is not None else v for k, v in fields.items()]
        conn.execute(f"UPDATE requests SET {', '.join(sets)} WHERE request_id = ?", (*values, request_id))

    def mark_needs_retrain(self, model: str, request_ids: Sequence[str], reason: str) -> None:
        """Move requests (e.g. applied by a rolled-back version) to needs_retrain, with the reason."""
        with self._tx() as conn:
            for rid in request_ids:
                self._move(conn, rid, "needs_retrain", error=reason)
            self._event(conn, model, "needs_retrain", None, {"request_ids": list(request_ids), "reason": reason})

    # -- batches -----------------------------------------------------------------------------
    def schedule_batch(self, *, batch_key: str, model: str, origin: str, index: int, request_ids: Sequence[str],
                       parent_version: int, seed: int) -> BatchRow:
        """Record 'batch ``index`` of ``origin`` holds these requests, on parent version v' and move
        the requests to scheduled, in one transaction."""
        with self._tx() as conn:
            sample_ids: list[int] = []
            for rid in request_ids:
                row = conn.execute("SELECT model, sample_ids FROM requests WHERE request_id = ?", (rid,)).fetchone()
                if row is None or row["model"] != model:
                    raise LedgerError(f"request '{rid}' is not a request of model '{model}'")
                sample_ids.extend(json.loads(row["sample_ids"]))
                self._move(conn, rid, "scheduled", batch_key=batch_key)
            now = utc_now()
            conn.execute(
                "INSERT INTO batches (batch_key, model, origin, idx, request_ids, sample_ids, parent_version, seed, state, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'scheduled', ?, ?)",
                (batch_key, model, origin, index, json.dumps(list(request_ids)), json.dumps(sample_ids), parent_version, seed, now, now),
            )
            self._event(conn, model, "batch_scheduled", batch_key, {"request_ids": list(request_ids), "parent_version": parent_version, "seed": seed})
        return self.get_batch(batch_key)  # type: ignore[return-value]

    def get_batch(self, batch_key: str) -> BatchRow | None:
        rows = self._query("SELECT * FROM batches WHERE batch_key = ?", (batch_key,))
        return _batch_row(rows[0]) if rows else None

    def batches(self, *, model: str | None = None, origin: str | None = None, state: str | None = None) -> list[BatchRow]:
        clauses, args = self._where(model=model, origin=origin, state=state)
        sql = "SELECT * FROM batches" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY created_at, idx"
        return [_batch_row(r) for r in self._query(sql, args)]

    def rebase_batch(self, batch_key: str, parent_version: int) -> None:
        """A scheduled, unpublished batch moves onto another parent (the current version changed)."""
        with self._tx() as conn:
            row = conn.execute("SELECT model, state, parent_version FROM batches WHERE batch_key = ?", (batch_key,)).fetchone()
            if row is None or row["state"] != "scheduled":
                raise TransitionError(f"batch '{batch_key}' is not scheduled; it cannot be rebased")
            conn.execute("UPDATE batches SET parent_version = ?, updated_at = ? WHERE batch_key = ?", (parent_version, utc_now(), batch_key))
            self._event(conn, row["model"], "batch_rebased", batch_key, {"from": row["parent_version"], "to": parent_version})

    def finish_batch(self, batch_key: str, state: str, *, version: int | None = None, reason: str | None = None,
                     epsilon: float | None = None, metrics: dict[str, Any] | None = None) -> None:
        """Close a scheduled batch as applied (with its version), failed or needs_retrain (with the
        reason), moving all its requests the same way, in one transaction."""
        if state not in BATCH_FINAL_STATES:
            raise ValueError(f"batch state must be one of {BATCH_FINAL_STATES}, got {state!r}")
        if state == "applied" and version is None:
            raise ValueError("an applied batch needs the version that applied it")
        if state != "applied" and not reason:
            raise ValueError(f"a batch closed as {state} needs a reason")
        with self._tx() as conn:
            row = conn.execute("SELECT * FROM batches WHERE batch_key = ?", (batch_key,)).fetchone()
            if row is None:
                raise LedgerError(f"batch '{batch_key}' is not in the ledger")
            if row["state"] != "scheduled":
                raise TransitionError(f"batch '{batch_key}' is already {row['state']}; it cannot become {state}")
            conn.execute(
                "UPDATE batches SET state = ?, version = ?, reason = ?, updated_at = ? WHERE batch_key = ?",
                (state, version, reason, utc_now(), batch_key),
            )
            for rid in json.loads(row["request_ids"]):
                self._move(conn, rid, state, version=version, epsilon_spent=epsilon, metrics=metrics, error=reason)
            self._event(conn, row["model"], f"batch_{state}", batch_key,
                        {"version": version, "reason": reason, "epsilon": epsilon})

    def release_batch(self, batch_key: str, reason: str) -> list[str]:
        """Abandon a scheduled batch that published nothing (it is closed as failed with the
        reason) and give its requests back to the queue (accepted again, no batch): used to split
        a micro-batch one of whose requests made the removal fail. Returns the request ids."""
        with self._tx() as conn:
            row = conn.execute("SELECT * FROM batches WHERE batch_key = ?", (batch_key,)).fetchone()
            if row is None or row["state"] != "scheduled":
                raise TransitionError(f"batch '{batch_key}' is not scheduled; it cannot be released")
            now = utc_now()
            conn.execute("UPDATE batches SET state = 'failed', reason = ?, updated_at = ? WHERE batch_key = ?",
                         (reason, now, batch_key))
            ids = json.loads(row["request_ids"])
            for rid in ids:
                moved = conn.execute(
                    "UPDATE requests SET state = 'accepted', batch_key = NULL, updated_at = ? "
                    "WHERE request_id = ? AND state = 'scheduled' AND batch_key = ?", (now, rid, batch_key))
                if moved.rowcount != 1:
                    raise TransitionError(f"request '{rid}' of batch '{batch_key}' is not scheduled by it")
            self._event(conn, row["model"], "batch_released", batch_key, {"request_ids": ids, "reason": reason})
        return ids

    # -- campaigns ---------------------------------------------------------------------------
    def ingest_campaign(self, campaign_id: str, model: str, spec: dict[str, Any], requests: Sequence[DeletionRequest]) -> None:
        """Record a campaign and all its requests as accepted, in one transaction (all or nothing)."""
        spec_json = json.dumps(spec, sort_keys=True)
        origin = f"campaign:{campaign_id}"
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM campaigns WHERE campaign_id = ?", (campaign_id,)).fetchone():
                raise LedgerConflictError(f"campaign '{campaign_id}' already exists; resume it or choose another name")
            now = utc_now()
            conn.execute(
                "INSERT INTO campaigns (campaign_id, model, spec, spec_sha256, state, created_at, updated_at) VALUES (?, ?, ?, ?, 'running', ?, ?)",
                (campaign_id, model, spec_json, hashlib.sha256(spec_json.encode()).hexdigest(), now, now),
            )
            for position, request in enumerate(requests):
                existing = self._insert_request(conn, model, request, origin)
                if existing is not None:
                    raise LedgerConflictError(
                        f"request_id '{request.request_id}' is already in the ledger (from {existing.origin}, {existing.state}); "
                        "campaign requests need new request ids"
                    )
                conn.execute("INSERT INTO campaign_requests (campaign_id, position, request_id) VALUES (?, ?, ?)",
                             (campaign_id, position, request.request_id))
                crash_point("ingest_row")
            self._event(conn, model, "campaign_ingested", campaign_id, {"requests": len(requests)})

    def get_campaign(self, campaign_id: str) -> CampaignRow | None:
        rows = self._query("SELECT * FROM campaigns WHERE campaign_id = ?", (campaign_id,))
        if not rows:
            return None
        r = rows[0]
        return CampaignRow(r["campaign_id"], r["model"], json.loads(r["spec"]), r["spec_sha256"], r["state"])

    def campaign_request_ids(self, campaign_id: str) -> list[str]:
        rows = self._query("SELECT request_id FROM campaign_requests WHERE campaign_id = ? ORDER BY position", (campaign_id,))
        return [r["request_id"] for r in rows]

    def set_campaign_state(self, campaign_id: str, state: str) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE campaigns SET state = ?, updated_at = ? WHERE campaign_id = ?", (state, utc_now(), campaign_id))

    # -- audit and export -------------------------------------------------------------------
    def events(self, model: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT * FROM events" + (" WHERE model = ?" if model else "") + " ORDER BY id"
        return [{**dict(r), "detail": json.loads(r["detail"])} for r in self._query(sql, (model,) if model else ())]

    def fingerprint(self) -> str:
        """sha256 over every row of every table: equal fingerprints mean an unchanged ledger."""
        h = hashlib.sha256()
        with self._lock:
            for table in TABLES:
                h.update(table.encode())
                for row in self._conn.execute(f"SELECT * FROM {table} ORDER BY rowid"):
                    h.update(repr(tuple(row)).encode())
        return h.hexdigest()

    def export_parquet(self, out: str | Path, table: str = "requests") -> int:
        """Write one table to parquet atomically; returns the number of rows."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if table not in EXPORTS:
            raise ValueError(f"table '{table}' cannot be exported; choose one of {sorted(EXPORTS)}")
        rows = [dict(r) for r in self._query(f"SELECT * FROM {table} ORDER BY rowid")]
        arrow = pa.Table.from_pylist([EXPORTS[table](r) for r in rows], schema=EXPORT_SCHEMAS[table]())
        buffer = io.BytesIO()
        pq.write_table(arrow, buffer)
        atomic_write_bytes(out, buffer.getvalue())
        return len(rows)


def _export_request(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "sample_ids": json.loads(r["sample_ids"])}


def _export_batch(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "request_ids": json.loads(r["request_ids"]), "sample_ids": json.loads(r["sample_ids"])}


def _request_schema():
    import pyarrow as pa

    return pa.schema([
        ("seq", pa.int64()), ("request_id", pa.string()), ("model", pa.string()), ("subject", pa.string()),
        ("sample_ids", pa.list_(pa.int64())), ("content_sha256", pa.string()), ("origin", pa.string()),
        ("received_at", pa.string()), ("state", pa.string()), ("batch_key", pa.string()), ("version", pa.int64()),
        ("epsilon_spent", pa.float64()), ("metrics", pa.string()), ("error", pa.string()), ("updated_at", pa.string()),
    ])


def _batch_schema():
    import pyarrow as pa

    return pa.schema([
        ("batch_key", pa.string()), ("model", pa.string()), ("origin", pa.string()), ("idx", pa.int64()),
        ("request_ids", pa.list_(pa.string())), ("sample_ids", pa.list_(pa.int64())), ("parent_version", pa.int64()),
        ("seed", pa.int64()), ("state", pa.string()), ("version", pa.int64()), ("reason", pa.string()),
        ("created_at", pa.string()), ("updated_at", pa.string()),
    ])


def _event_schema():
    import pyarrow as pa

    return pa.schema([("id", pa.int64()), ("at", pa.string()), ("model", pa.string()), ("kind", pa.string()),
                      ("key", pa.string()), ("detail", pa.string())])


EXPORTS = {"requests": _export_request, "batches": _export_batch, "events": dict}
EXPORT_SCHEMAS = {"requests": _request_schema, "batches": _batch_schema, "events": _event_schema}
