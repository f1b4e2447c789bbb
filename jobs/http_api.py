"""The stream service's HTTP API: FastAPI on uvicorn (asyncio, no thread per connection).

Endpoints (JSON; all but the three public ones need ``Authorization: Bearer <token>``):
  POST /v1/requests        {"request_id", "subject", "sample_ids"} -> 202 once committed to the
                           ledger (200 for an identical resubmission by the same client; 409
                           conflict; 422 invalid; 413 body too large; 415 not JSON; 411/400)
  GET  /v1/requests/{id}   the request's state -- only the client that submitted it sees it (404
                           for everyone else, the same answer as for an id that does not exist)
  GET  /v1/versions        the model's versions and the current one
  GET  /healthz            liveness (public)
  GET  /readyz             503 until the service is started and while it stops (public)
  GET  /openapi.json       the OpenAPI schema (public)
Authentication, then the per-client rate limit (429 + Retry-After), run before routing, so an
unauthenticated call learns nothing about which paths exist.  A 409 never names another
client's request ids.

Connection handling (``HttpLimits``): a client must finish its request line and headers within
``header_timeout_s`` (bytes trickled slowly do not extend it) and its body within
``body_timeout_s``; idle keep-alive connections close after ``keep_alive_s``; request line +
headers are capped at ``max_header_bytes``; above ``max_connections`` open connections new
requests get 503.  ``HttpServer.stop`` stops accepting, closes idle connections and gives
requests in flight ``shutdown_timeout_s``.  Binding beyond loopback needs TLS or an explicit
``allow_insecure_remote`` (checked by the configuration and again here).
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
import threading
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse as _BaseJSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from jobs.request_body import HttpError, parse_json_body
from jobs.specs import ServiceConfig
from pipeline.data.requests import DeletionRequest
from pipeline.jsonio import jsonable

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"})
ENDPOINTS = "POST /v1/requests, GET /v1/requests/{id}, GET /v1/versions"
CLAIMED_SAMPLE = re.compile(r"(\d+) \(request '")


class JSONResponse(_BaseJSONResponse):
    """JSON with no NaN/Infinity (written as null) and anything else unusual as its str()."""

    def render(self, content: Any) -> bytes:
        return json.dumps(jsonable(content), default=str, allow_nan=False, separators=(",", ":")).encode()


class ApiError(Exception):
    """An error answered as {"error": {"status", "message", ...}}."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.headers, self.extra = status, message, headers or {}, extra


def error_response(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    # errors close the connection (an unread body must not be taken for the next request)
    return JSONResponse({"error": {"status": status, "message": message, **extra}}, status_code=status,
                        headers={"Connection": "close", **(headers or {})})


def _from_service(err: Exception) -> ApiError:
    """The service's HttpError (status, message, extra) as an ApiError."""
    extra = {k: v for k, v in getattr(err, "extra", {}).items() if k != "retry_after"}
    return ApiError(err.status, err.message, **extra)  # type: ignore[attr-defined]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_bind(config: ServiceConfig) -> None:
    """Refuse plain HTTP beyond loopback unless the configuration says so explicitly."""
    if not is_loopback(config.host) and config.tls is None and not config.allow_insecure_remote:
        raise ValueError(f"refusing to serve plain HTTP on {config.host}: set tls (certfile, keyfile) or "
                         "allow_insecure_remote: true in the stream configuration, or bind 127.0.0.1")


# ----------------------------------------------------------------------------------------------
# the application
# ----------------------------------------------------------------------------------------------
def build_app(service: Any) -> FastAPI:
    """The FastAPI app over an ``UnlearnService`` (its public methods only)."""
    config: ServiceConfig = service.config
    app = FastAPI(title="unlearn stream service", version="1",
                  description="Deletion requests for one model, applied in micro-batches.",
                  docs_url=None, redoc_url=None)  # no CDN assets: the schema is at /openapi.json

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.message, err.headers, **err.extra)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if err.status_code == 405:
            allowed = (err.headers or {}).get("Allow", "GET")
            return error_response(405, f"use {allowed} on {path}", {"Allow": allowed})
        if err.status_code == 404:
            return error_response(404, f"no endpoint {path}; endpoints: {ENDPOINTS}")
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        service.log(f"internal error on {request.method} {request.url.path}: {type(err).__name__}: {err}")
        return error_response(500, "internal error; see the service log")

    @app.middleware("http")
    async def _auth_and_rate_limit(request: Request, call_next):
        if request.url.path in PUBLIC_PATHS:
            return await call_next(request)
        try:
            client = service.authenticate(request.headers.get("Authorization"))
        except Exception as err:  # the service's HttpError (401)
            if getattr(err, "status", None) != 401:
                raise
            return error_response(401, err.message, {"WWW-Authenticate": 'Bearer realm="unlearn"'})  # type: ignore[attr-defined]
        wait = service.limiter.allow(client)
        if wait > 0:
            return error_response(429, f"rate limit of client '{client}' exceeded; retry in {wait:.2f} s",
                                  {"Retry-After": str(max(1, int(wait + 0.999)))})
        request.state.client = client
        return await call_next(request)

    request_schema = DeletionRequest.model_json_schema()

    @app.post("/v1/requests", status_code=202, summary="Submit a deletion request",
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"application/json": {"schema": request_schema}}}},
              responses={200: {"description": "identical resubmission"}, 409: {"description": "conflict"},
                         413: {"description": "body too large"}, 422: {"description": "invalid request"}})
    async def submit(request: Request) -> JSONResponse:
        body = await _json_body(request, config)
        status, payload = await run_in_threadpool(_submit_owned, service, request.state.client, body)
        return JSONResponse(payload, status_code=status)

    @app.get("/v1/requests/{request_id}", summary="A request's state (own requests only)")
    async def request_state(request_id: str, request: Request) -> JSONResponse:
        payload = await run_in_threadpool(_state_owned, service, request.state.client, request_id)
        return JSONResponse(payload)

    @app.get("/v1/versions", summary="The model's versions")
    async def versions() -> JSONResponse:
        return JSONResponse(await run_in_threadpool(service.versions))

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: accepting and applying requests")
    async def readyz() -> JSONResponse:
        ready, why = service.readiness()
        return JSONResponse({"ready": ready, "reason": why}, status_code=200 if ready else 503)

    return app


def _owner(client: str) -> str:
    return f"stream:{client}"


def _not_found(service: Any, request_id: str) -> ApiError:
    return ApiError(404, f"no request '{request_id}' for model '{service.model}'")


def _state_owned(service: Any, client: str, request_id: str) -> dict[str, Any]:
    try:
        payload = service.request_state(request_id)
    except Exception as err:
        if getattr(err, "status", None) is None:
            raise
        raise _from_service(err) from None
    if payload.get("origin") != _owner(client):
        raise _not_found(service, request_id)  # another client's request: as if it did not exist
    return payload


def _submit_owned(service: Any, client: str, body: Any) -> tuple[int, dict[str, Any]]:
    """``service.submit`` for ``client``; a request id or sample of another client is a 409 that
    names only what the caller sent."""
    rid = body.get("request_id") if isinstance(body, dict) else None
    if isinstance(rid, str):
        try:
            existing = service.request_state(rid)
        except Exception as err:
            if getattr(err, "status", None) != 404:
                raise
            existing = None
        if existing is not None and existing.get("origin") != _owner(client):
            raise ApiError(409, f"request_id '{rid}' is already in use; use a new request_id")
    try:
        return service.submit(client, body)
    except Exception as err:
        status = getattr(err, "status", None)
        if status is None:
            raise
        if status == 409 and "already claimed" in err.message:  # type: ignore[attr-defined]
            claimed = sorted({int(s) for s in CLAIMED_SAMPLE.findall(err.message)})  # type: ignore[attr-defined]
            raise ApiError(409, f"sample ids already claimed by an earlier request: {claimed}; "
                                "a sample is removed once - drop these ids from the request") from None
        raise _from_service(err) from None


async def _json_body(request: Request, config: ServiceConfig) -> Any:
    ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(415, "send the body as Content-Type: application/json")
    raw_length = request.headers.get("Content-Length")
    if raw_length is None:
        raise ApiError(411, "Content-Length is required")
    try:
        length = int(raw_length)
        if length < 0:
            raise ValueError
    except ValueError:
        raise ApiError(400, f"Content-Length {raw_length!r} is not a non-negative integer") from None
    limit = config.max_body_bytes
    if length > limit:
        raise ApiError(413, f"body of {length} bytes exceeds the limit of {limit} bytes; split the request")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"body exceeds the limit of {limit} bytes; split the request")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), timeout=config.http.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {config.http.body_timeout_s} s") from None
    try:
        return parse_json_body(raw)
    except HttpError as err:
        raise ApiError(err.status, err.message) from None


# ----------------------------------------------------------------------------------------------
# the server
# ----------------------------------------------------------------------------------------------
def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's line and headers.

    uvicorn's keep-alive timer restarts on every byte received, so a client that trickles header
    bytes would hold its connection forever; this deadline is armed when a connection opens and
    after each response, and closes the connection if the next request's headers are still
    incomplete when it fires.
    """

    class HeaderTimeoutProtocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_timeout(self) -> None:
            self._header_deadline = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return HeaderTimeoutProtocol


class HttpServer:
    """uvicorn serving ``build_app(service)`` from a background thread (its own event loop)."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.config: ServiceConfig = service.config
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self.error: BaseException | None = None

    def start(self) -> tuple[str, int]:
        """Bind (refusing plain HTTP beyond loopback), start serving; returns (host, port)."""
        check_bind(self.config)
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((cfg.host, cfg.port))
            sock.listen(min(socket.SOMAXCONN, 1024))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        limits = cfg.http
        uv = uvicorn.Config(
            build_app(self.service), log_level="warning", access_log=False, lifespan="off",
            http=header_timeout_protocol(limits.header_timeout_s), ws="none",
            timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections,
            h11_max_incomplete_event_size=limits.max_header_bytes,
            timeout_graceful_shutdown=limits.shutdown_timeout_s, server_header=False,
            ssl_certfile=str(cfg.tls.certfile) if cfg.tls else None,
            ssl_keyfile=str(cfg.tls.keyfile) if cfg.tls else None,
        )
        self._server = uvicorn.Server(uv)
        started = threading.Event()

        def run() -> None:
            try:
                asyncio.run(self._serve(started))
            except BaseException as err:  # noqa: BLE001 - reported by start()/the service
                self.error = err
                started.set()

        self._thread = threading.Thread(target=run, name="http", daemon=True)
        self._thread.start()
        started.wait(30)
        if self.error is not None or not self._server.started:
            self.stop()
            raise RuntimeError(f"the HTTP server did not start: {self.error}")
        host, port = sock.getsockname()[:2]
        return str(host), int(port)

    async def _serve(self, started: threading.Event) -> None:
        assert self._server is not None
        task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not task.done():
            await asyncio.sleep(0.01)
        started.set()
        await task

    def stop(self) -> None:
        """Stop accepting, close idle connections, let requests in flight finish (bounded)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.config.http.shutdown_timeout_s + 5)
            self._thread = None
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
            self._sock = None
