"""YAML specs of campaigns and of the stream service, validated with pydantic (unknown fields
are errors). ``load_spec`` reads them through the one config loader (``pipeline.config``):
any problem is a ``ConfigError`` whose message names the field and the fix. Relative paths in
a spec are relative to the spec file's folder. ``method:`` is a ``MethodRef`` (a bare name
loads configs/methods/<name>.yaml; the settings stay parsed)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline import memory
from pipeline.config import ConfigError, load_config, referenced
from pipeline.methods.base import MethodRef

from pipeline.privacy.accountant import Budget
from pipeline.store.versions import MODEL_NAME_PATTERN

LEDGER_FILE = "ledger.sqlite3"


class SpecError(ConfigError):
    """A spec value is unusable at run time (e.g. a token source); the message names the fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRef(Strict):
    store: Path = Field(description="folder of the version store (see `unlearn versions import`)")
    name: str = Field(pattern=MODEL_NAME_PATTERN.pattern, description="model name inside the store")


class Limits(Strict):
    budget: Budget = Field(default_factory=Budget, description="the model's total privacy budget")
    retain_accuracy_margin: float | None = Field(
        default=0.05, ge=0, le=1,
        description="largest allowed drop of retain-set accuracy per batch (0.05 = 5 points); null = no check",
    )


class RaySpec(Strict):
    """Run the probe shards and the training-set Hessian-vector products on Ray workers; a
    bare name refers to configs/cluster/<name>.yaml."""

    @model_validator(mode="before")
    @classmethod
    def _reference(cls, raw: object) -> object:
        return referenced("cluster", raw)

    address: str | None = Field(default=None, description="Ray cluster address; null = RAY_ADDRESS or a local Ray")
    workers: int | None = Field(default=None, gt=0, description="number of workers; null = one per GPU, else per CPU")

    def options(self):
        from cluster.hooks import ClusterOptions

        return ClusterOptions(address=self.address, workers=self.workers)


def batch_memory_budget() -> Any:
    """The ``memory_budget`` field of the specs that run batches (campaigns, the stream service)."""
    return Field(default="auto", description="working memory each stage of a removal (and its verification) may "
                                             f"use on top of the loaded model and data: 'auto' ({memory.AUTO_FRACTION:g} "
                                             "x available RAM, or CUDA free memory, when the batch starts) or a size "
                                             "like '8GiB'; Ray workers get a set size, and derive 'auto' from their "
                                             "own machine")


class CampaignSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="campaign id (letters, digits, . _ -)")
    model: ModelRef
    ledger: Path | None = Field(default=None, description=f"SQLite ledger file; default <store>/{LEDGER_FILE}")
    method: MethodRef = Field(default_factory=MethodRef)
    batch_size: int = Field(gt=0, le=100_000, description="requests per batch (a positive integer)")
    seed: int = Field(default=0, ge=0, description="campaign seed; batch k uses seed + k")
    limits: Limits = Field(default_factory=Limits)
    requests: Path = Field(description="CSV, JSONL or parquet file with request_id, subject, sample_ids")
    report_dir: Path | None = Field(default=None, description="where the report goes; default <store>/<model>/reports/<name>")
    ray: RaySpec | None = Field(default=None, description="run the removal's probe and curvature on Ray workers")
    memory_budget: memory.Setting = batch_memory_budget()

    def ledger_path(self) -> Path:
        return self.ledger or self.model.store / LEDGER_FILE

    def report_path(self) -> Path:
        return self.report_dir or self.model.store / self.model.name / "reports" / self.name


class ClientToken(Strict):
    client: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="client name (rate limits are per client)")
    token: str | None = Field(default=None, min_length=16, description="the bearer token itself (16+ characters)")
    token_env: str | None = Field(default=None, description="environment variable holding the token")
    token_file: Path | None = Field(default=None, description="file holding the token")

    @model_validator(mode="after")
    def _one_source(self) -> "ClientToken":
        given = [k for k in ("token", "token_env", "token_file") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"client '{self.client}': give exactly one of token, token_env, token_file (got {given or 'none'})")
        return self

    def resolve(self) -> str:
        """The token's value (read from the environment or file when so configured)."""
        if self.token is not None:
            return self.token
        if self.token_env is not None:
            value = os.environ.get(self.token_env, "")
            where = f"environment variable {self.token_env}"
        else:
            assert self.token_file is not None
            value = self.token_file.read_text().strip() if self.token_file.is_file() else ""
            where = f"token file {self.token_file}"
        if len(value) < 16:
            raise SpecError(f"auth.clients[{self.client}]: {where} is unset or shorter than 16 characters; set a long random token")
        return value


class Auth(Strict):
    clients: list[ClientToken] = Field(min_length=1, description="bearer tokens, one per client")


class Batching(Strict):
    max_requests: int = Field(default=50, gt=0, le=100_000, description="apply a batch at this many pending requests")
    max_wait_s: float = Field(default=0.5, gt=0, le=86_400, description="or when the oldest pending request is this old")


class FastPath(Strict):
    """The streaming fast path (pipeline/stream_removal.py's WarmStreamRemover over
    pipeline/streaming.py's DecisionLayerStream): the decision layer's prepared state kept warm
    between micro-batches. Needs method decision-layer-newton (e.g. the variant ``newton-head``)
    with ``epsilon: .inf`` (no noise, so ``limits.budget.allow_non_private: true``); the service
    refuses any other method before it writes anything."""

    enabled: bool = Field(default=False, description="opt in: apply batches on the warm state instead of from scratch")
    refresh_every: int = Field(default=100, ge=1, description="exact refresh (full pass) after this many batches")
    drift_threshold: float = Field(default=1e-5, gt=0, description="refresh once the drift (drift_measure) passes this; "
                                                                   "||theta - theta*|| <= drift / weight_decay")
    drift_measure: Literal["gradient", "lipschitz"] = Field(
        default="gradient", description="gradient: the exact residual ||grad F_R - a|| on the cached layer inputs (one "
                                        "O(n K d) product per batch); lipschitz: the a-priori bound C_R ||theta - theta_ref||^2 "
                                        "(O(1), pessimistic)")
    refresh_tol: float = Field(default=1e-9, gt=0, description="a refresh converges to ||grad F_R - a|| <= this")
    refresh_max_steps: int = Field(default=8, ge=1, description="Newton steps with fresh curvature in a refresh at most (chord steps: 4x this)")


class RateLimit(Strict):
    requests_per_second: float = Field(default=20.0, gt=0, description="sustained requests per second per client")
    burst: int = Field(default=40, gt=0, description="requests a client may send at once")


class Tls(Strict):
    certfile: Path = Field(description="PEM certificate chain served to clients")
    keyfile: Path = Field(description="PEM private key of the certificate")


class HttpLimits(Strict):
    header_timeout_s: float = Field(default=10.0, gt=0, le=300,
                                    description="a client must send its request line and headers within this time")
    body_timeout_s: float = Field(default=10.0, gt=0, le=300, description="and its body within this time (else 408)")
    keep_alive_s: int = Field(default=5, ge=1, le=300, description="idle keep-alive connections are closed after this")
    max_connections: int = Field(default=1000, ge=1, le=100_000,
                                 description="open connections (and requests in flight) above this get 503")
    max_header_bytes: int = Field(default=16_384, ge=1024, le=1_048_576, description="largest request line + headers")
    shutdown_timeout_s: float = Field(default=5.0, gt=0, le=300,
                                      description="on stop, requests in flight get this long before their connections close")


class ServiceConfig(Strict):
    model: ModelRef
    ledger: Path | None = Field(default=None, description=f"SQLite ledger file; default <store>/{LEDGER_FILE}")
    method: MethodRef = Field(default_factory=MethodRef)
    seed: int = Field(default=0, ge=0, description="service seed; stream batch k uses seed + k")
    limits: Limits = Field(default_factory=Limits)
    host: str = Field(default="127.0.0.1", description="address to bind (loopback unless you mean otherwise)")
    port: int = Field(default=8787, ge=0, le=65535, description="TCP port; 0 = any free port")
    port_file: Path | None = Field(default=None, description="the bound port is written here once listening")
    auth: Auth
    batching: Batching = Field(default_factory=Batching)
    rate_limit: RateLimit = Field(default_factory=RateLimit)
    max_body_bytes: int = Field(default=65_536, gt=0, le=16 * 2**20, description="largest accepted request body")
    tls: Tls | None = Field(default=None, description="serve HTTPS with this certificate (needed beyond loopback)")
    allow_insecure_remote: bool = Field(default=False,
                                        description="allow plain HTTP on a non-loopback address (tokens travel in clear)")
    http: HttpLimits = Field(default_factory=HttpLimits)
    fast_path: FastPath = Field(default_factory=FastPath, description="the streaming fast path (off by default)")
    memory_budget: memory.Setting = batch_memory_budget()

    @model_validator(mode="after")
    def _loopback_or_tls(self) -> "ServiceConfig":
        import ipaddress

        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        if not loopback and self.tls is None and not self.allow_insecure_remote:
            raise ValueError(f"host {self.host!r} is not a loopback address: bearer tokens would travel in clear; "
                             "set tls: {certfile, keyfile}, or allow_insecure_remote: true behind a TLS proxy, "
                             "or bind host: 127.0.0.1")
        return self

    @field_validator("auth")
    @classmethod
    def _unique_clients(cls, auth: Auth) -> Auth:
        names = [c.client for c in auth.clients]
        if len(set(names)) != len(names):
            raise ValueError("client names must be unique")
        return auth

    def ledger_path(self) -> Path:
        return self.ledger or self.model.store / LEDGER_FILE


Spec = TypeVar("Spec", bound=BaseModel)


def load_spec(path: str | Path, cls: type[Spec], what: str = "spec") -> Spec:
    """Read and validate a YAML spec (``pipeline.config``); relative paths become relative to
    the file's folder."""
    return load_config(cls, path, what, relative_paths=True)
