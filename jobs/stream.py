"""`unlearn stream`: the long-running removal service (see jobs/service.py)."""
from __future__ import annotations

import sys

import click

from jobs.usererrors import user_errors

CONFIG_HELP = """The configuration is YAML:

\b
  model: {store: ./store, name: faces}
  method: {name: lfoci-newton, settings: {epsilon: 1.0}}
  limits: {budget: {epsilon: 20}, retain_accuracy_margin: 0.05}
  host: 127.0.0.1               # loopback unless you mean otherwise
  port: 8787                    # 0 = any free port (see port_file)
  auth:
    clients:
      - {client: intake, token_env: UNLEARN_TOKEN}   # or token: / token_file:
  batching: {max_requests: 50, max_wait_s: 0.5}
  rate_limit: {requests_per_second: 20, burst: 40}
  max_body_bytes: 65536
  memory_budget: auto           # or 8GiB: each removal stage's working memory
  # tls: {certfile: cert.pem, keyfile: key.pem}   # required beyond loopback, unless
  # allow_insecure_remote: true                   # (plain HTTP, e.g. behind a TLS proxy)
  http: {header_timeout_s: 10, body_timeout_s: 10, keep_alive_s: 5,
         max_connections: 1000, max_header_bytes: 16384, shutdown_timeout_s: 5}
  # warm decision-layer state between batches: needs method decision-layer-newton (e.g.
  # method: newton-head) with epsilon .inf and limits.budget.allow_non_private: true
  fast_path: {enabled: false, refresh_every: 100, drift_threshold: 1.0e-5, drift_measure: gradient}
"""


@click.group("stream", epilog=CONFIG_HELP)
def command() -> None:
    """Streaming removals: an HTTP service that accepts deletion requests and applies them in
    micro-batches, publishing a new model version per batch."""


@command.command("serve", epilog=CONFIG_HELP)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Service YAML.")
@user_errors
def serve(config_path: str) -> None:
    """Serve until SIGTERM or SIGINT (the batch in flight is finished first)."""
    from jobs.service import UnlearnService
    from jobs.specs import ServiceConfig, load_spec

    config = load_spec(config_path, ServiceConfig, "service configuration")
    try:
        status = UnlearnService(config).serve_forever()
    except OSError as err:
        raise click.ClickException(f"cannot serve on {config.host}:{config.port}: {err.strerror or err}; "
                                   "choose another host/port in the configuration") from None
    sys.exit(status)


@command.command("check", epilog=CONFIG_HELP)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Service YAML.")
@user_errors
def check(config_path: str) -> None:
    """Validate the configuration (tokens included) and the model, writing nothing."""
    from jobs.specs import ServiceConfig, load_spec
    from pipeline.store.versions import VersionStore

    config = load_spec(config_path, ServiceConfig, "service configuration")
    for client in config.auth.clients:
        client.resolve()
    info = VersionStore(config.model.store).open_verified(config.model.name)
    from jobs.exactly_once import validate_settings
    from jobs.service import STREAM_SEED_HEADROOM

    validate_settings(config.method, None, config.limits, info.path,
                      first_seed=config.seed, last_seed=config.seed + STREAM_SEED_HEADROOM, memory_budget=config.memory_budget)
    click.echo(f"ok: model '{config.model.name}' at version {info.version}; would bind {config.host}:{config.port}")


if __name__ == "__main__":
    command()
