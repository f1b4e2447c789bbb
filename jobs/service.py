"""The streaming removal service: an HTTP front end that records deletion requests durably and
one worker that applies them in micro-batches, each batch publishing a new model version.

HTTP: FastAPI on uvicorn, see ``jobs.http_api`` (endpoints, bearer tokens, per-client
ownership, body/header limits and timeouts, /healthz, /readyz, /openapi.json).

Worker: pending (accepted) stream requests are applied in arrival order, in batches of at most
``batching.max_requests``, as soon as that many are pending or the oldest has waited
``batching.max_wait_s``, through the exactly-once state machine (``jobs.exactly_once``); a
micro-batch whose removal fails is split so that one bad request does not fail the others. On shutdown
the HTTP server stops first, then the worker finishes the batch in flight and stops; requests
still pending stay accepted in the ledger and are applied by the next start.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from jobs.exactly_once import BatchInputError, ExactlyOnce, validate_settings
from jobs.http_api import HttpServer
from jobs.request_body import HttpError
from pipeline import memory
from pipeline.removal import training_set
from jobs.specs import ServiceConfig
from pipeline.checkpoint import atomic_write_bytes
from pipeline.data.requests import DeletionRequest
from pipeline.models.card import read_card
from pipeline.store.ledger import Ledger, LedgerConflictError, SampleConflictError
from pipeline.store.versions import VersionStore

MAX_RETRY_AFTER_S = 86_400.0  # a 429 never asks for more than a day (rate 1e-320 would say inf)
# Stream batch k uses seed + k: the seed must leave room for this many batches below 2^63.
STREAM_SEED_HEADROOM = 2**40


class RateLimiter:
    """Token bucket per client: ``rate`` tokens per second, at most ``burst`` saved up."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, client: str) -> float:
        """0.0 if the client may proceed now, else the seconds to wait."""
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(client, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[client] = (tokens - 1.0, now)
                return 0.0
            self._buckets[client] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
            return wait if wait < MAX_RETRY_AFTER_S else MAX_RETRY_AFTER_S


def _age_seconds(received_at: str) -> float:
    return (datetime.now(timezone.utc) - datetime.fromisoformat(received_at)).total_seconds()


class UnlearnService:
    """Owns the model's write lock, the ledger, the HTTP server and the worker thread."""

    def __init__(self, config: ServiceConfig, *, log=None) -> None:
        self.config = config
        self.model = config.model.name
        self.store = VersionStore(config.model.store)
        self.store.require_model(self.model)
        self.tokens = {c.resolve(): c.client for c in config.auth.clients}
        self.limiter = RateLimiter(config.rate_limit.requests_per_second, config.rate_limit.burst)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.batch_origin = f"stream:{self.model}"
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.worker_error: BaseException | None = None
        self._lock_cm = None
        self.server: HttpServer | None = None
        self._threads: list[threading.Thread] = []
        self._ready = False
        self.fast = None

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> tuple[str, int]:
        """Check the settings, take the model's lock, follow rollbacks, bring unfinished batches to
        an end, bind and start serving."""
        current = self.store.open_verified(self.model)
        try:
            validate_settings(self.config.method, None, self.config.limits, current.path,
                              first_seed=self.config.seed, last_seed=self.config.seed + STREAM_SEED_HEADROOM,
                              memory_budget=self.config.memory_budget)
        except BatchInputError as err:
            raise BatchInputError(f"service configuration: {err}") from None
        self.fast = self._fast_path_remover()
        self._lock_cm = self.store.lock(self.model)
        self._lock_cm.__enter__()
        try:
            self.ledger = Ledger(self.config.ledger_path())
            fast = self.fast
            self.machine = ExactlyOnce(
                self.store, self.ledger, self.model, method=self.config.method, limits=self.config.limits,
                remover=None if fast is None else (lambda directory, batch: fast.remove(directory, batch.sample_ids,
                                                                                        batch.seed)),
                measure=None if fast is None else fast.metrics, memory_budget=self.config.memory_budget)
            self.machine.follow_rollbacks()
            current = self.store.open_verified(self.model)
            self.known_ids = frozenset(training_set(read_card(current.path)).sample_ids.tolist())
            self.machine.finish_leftovers(self.batch_origin, lambda k: self.config.seed + k, self.log)
            if fast is not None:  # warm before serving: from the current version, never from other weights
                with memory.use_budget(self.config.memory_budget):
                    fast.warm(self.store.open_verified(self.model).path)
            self._threads = [threading.Thread(target=self._worker, name="removal-worker", daemon=True)]
            self._threads[0].start()
            self.server = HttpServer(self)
            host, port = self.server.start()
        except BaseException:
            self._stopping.set()
            self._wake.set()
            for t in self._threads:
                t.join()
            self._release()
            raise
        self._ready = True
        if self.config.port_file is not None:
            atomic_write_bytes(self.config.port_file, str(port).encode())
        scheme = "https" if self.config.tls is not None else "http"
        self.log(f"serving model '{self.model}' on {scheme}://{host}:{port}")
        return str(host), int(port)

    def _fast_path_remover(self):
        """The warm decision-layer remover when ``fast_path.enabled`` (else None); the settings are
        checked here, before anything is written."""
        spec = self.config.fast_path
        if not spec.enabled:
            return None
        from pipeline.stream_removal import FastPathError, WarmStreamRemover, stream_settings_of

        try:
            return WarmStreamRemover(self.config.method.method, self.config.method.settings, stream_settings_of(spec),
                                     log=self.log)
        except FastPathError as err:
            raise BatchInputError(f"service configuration: {err}") from None

    def stop(self) -> None:
        """Stop accepting, let handlers finish, drain the batch in flight, release the lock."""
        self._ready = False
        if self.server is not None:
            self.server.stop()  # stop accepting; requests in flight get http.shutdown_timeout_s
        self._stopping.set()
        self._wake.set()
        for t in self._threads:
            t.join()
        self._release()
        self.log("stopped")

    def _release(self) -> None:
        if getattr(self, "ledger", None) is not None:
            self.ledger.close()
            self.ledger = None  # type: ignore[assignment]
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)
            self._lock_cm = None

    def serve_forever(self) -> int:
        """Run until SIGTERM/SIGINT (or a worker failure); returns the exit status."""
        stop_requested = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            self.log(f"received {signal.Signals(signum).name}; finishing the batch in flight")
            stop_requested.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            while not stop_requested.wait(0.2):
                if self.worker_error is not None:
                    break
            self.stop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.worker_error is not None:
            self.log(f"error: the worker stopped: {self.worker_error}")
            return 1
        return 0

    # -- worker ------------------------------------------------------------------------------
    def _worker(self) -> None:
        batching = self.config.batching
        while not self._stopping.is_set():
            self._wake.clear()
            pending = self.ledger.requests(model=self.model, state="accepted", origin_prefix="stream:",
                                           limit=batching.max_requests)
            if not pending:
                self._wake.wait(0.5)
                continue
            wait = batching.max_wait_s - _age_seconds(pending[0].received_at)
            if len(pending) < batching.max_requests and wait > 0:
                self._wake.wait(min(wait, 0.5))
                continue
            try:
                self._apply([r.request_id for r in pending])
            except BaseException as err:  # noqa: BLE001 - surfaced by serve_forever, batch stays scheduled
                self.worker_error = err
                self.log(f"worker error: {type(err).__name__}: {err}")
                return

    def _apply(self, request_ids: list[str]) -> None:
        for result in self.machine.apply_isolating(self.batch_origin, request_ids, lambda k: self.config.seed + k):
            self.log(f"batch {result.batch_key}: {result.state}"
                     + (f" (version {result.version})" if result.version is not None else f": {result.reason}"))

    # -- request handling (called from handler threads) ---------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz: started, the worker alive, not stopping."""
        if not self._ready:
            return False, "starting or stopping"
        if self.worker_error is not None or not all(t.is_alive() for t in self._threads):
            return False, "the removal worker stopped"
        return True, "ok"


    def authenticate(self, header: str | None) -> str:
        import hmac

        scheme, _, credentials = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise HttpError(401, "missing bearer token: send 'Authorization: Bearer <token>'")
        given = credentials.strip().encode()
        client = None
        for token, name in self.tokens.items():
            if hmac.compare_digest(given, token.encode()):
                client = name
        if client is None:
            raise HttpError(401, "invalid bearer token")
        return client

    def submit(self, client: str, body: Any) -> tuple[int, dict[str, Any]]:
        if not isinstance(body, dict):
            raise HttpError(422, "the body must be a JSON object with request_id, subject, sample_ids")
        try:
            request = DeletionRequest.model_validate(body)
        except ValidationError as err:
            fields = [{"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in err.errors()]
            raise HttpError(422, "invalid deletion request: " + "; ".join(f"{f['field']}: {f['message']}" for f in fields),
                            fields=fields) from None
        resubmitted = self.ledger.get_request(request.request_id) is not None  # the ledger decides: same or conflict
        unknown = [] if resubmitted else [i for i in request.sample_ids if i not in self.known_ids]
        if unknown:
            raise HttpError(422, f"sample_ids not in the training set of model '{self.model}': {unknown[:10]}; "
                                 "use ids from the dataset's sample_id column", fields=[{"field": "sample_ids"}])
        try:
            row, created = self.ledger.submit(self.model, request, origin=f"stream:{client}")
        except (LedgerConflictError, SampleConflictError) as err:
            raise HttpError(409, str(err)) from None
        if row.model != self.model:
            raise HttpError(409, f"request_id '{row.request_id}' belongs to another model; use a new request_id")
        self._wake.set()
        return (202 if created else 200), self._request_json(row)

    def request_state(self, request_id: str) -> dict[str, Any]:
        row = self.ledger.get_request(request_id)
        if row is None or row.model != self.model:
            raise HttpError(404, f"no request '{request_id}' for model '{self.model}'")
        return self._request_json(row)

    def versions(self) -> dict[str, Any]:
        current = self.store.current(self.model)
        return {"model": self.model, "current": current,
                "versions": [self.store.info(self.model, v).summary(current) for v in self.store.versions(self.model)]}

    @staticmethod
    def _request_json(row) -> dict[str, Any]:
        out = row.to_json()
        out.pop("seq", None)
        return out

