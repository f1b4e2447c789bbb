"""`unlearn ledger`: show and export the request ledger."""
from __future__ import annotations

import json
from pathlib import Path

import click

from jobs.usererrors import user_errors


def _open(store: str | None, ledger: str | None):
    from jobs.specs import LEDGER_FILE
    from pipeline.store.ledger import Ledger

    if not store and not ledger:
        raise click.UsageError("give --store (uses <store>/ledger.sqlite3) or --ledger")
    path = Path(ledger) if ledger else Path(store) / LEDGER_FILE  # type: ignore[arg-type]
    if not path.is_file():
        raise click.ClickException(f"no ledger at {path}; check --store/--ledger")
    return Ledger(path)


ledger_options = [
    click.option("--store", default=None, type=click.Path(file_okay=False), help="Version store (ledger inside it)."),
    click.option("--ledger", default=None, type=click.Path(dir_okay=False), help="Ledger file."),
]


def _with_ledger_options(fn):
    for opt in reversed(ledger_options):
        fn = opt(fn)
    return fn


@click.group("ledger")
def command() -> None:
    """The request ledger (SQLite): every request, its state, version, epsilon and metrics."""


@command.command("show")
@_with_ledger_options
@click.option("--model", default=None, help="Only this model's requests.")
@click.option("--state", type=click.Choice(["accepted", "scheduled", "applied", "failed", "needs_retrain"]), default=None)
@click.option("--request", "request_id", default=None, help="One request, in full.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines.")
@user_errors
def show(store: str | None, ledger: str | None, model: str | None, state: str | None, request_id: str | None,
         as_json: bool) -> None:
    """List requests (or one request in full)."""
    led = _open(store, ledger)
    if request_id:
        row = led.get_request(request_id)
        if row is None:
            raise click.ClickException(f"request '{request_id}' is not in the ledger {led.path}")
        click.echo(json.dumps(row.to_json(), indent=2))
        return
    for row in led.requests(model=model, state=state):
        if as_json:
            click.echo(json.dumps(row.to_json()))
        else:
            guarantee = ((row.metrics or {}).get("privacy") or {}).get("guarantee") or "-"
            click.echo(f"{row.request_id:<24} {row.model:<16} {row.state:<13} v={row.version!s:<5} "
                       f"samples={len(row.sample_ids):<4} eps={row.epsilon_spent} release={guarantee} {row.error or ''}")
    if not request_id and not as_json:
        counts = guarantee_counts(led, model)
        click.echo("releases: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))


def guarantee_counts(led, model: str | None = None) -> dict[str, int]:
    """Applied requests by the guarantee of the release that applied them (certified / heuristic / none)."""
    counts = {"certified": 0, "heuristic": 0, "none": 0}
    for row in led.requests(model=model, state="applied"):
        kind = ((row.metrics or {}).get("privacy") or {}).get("guarantee") or "none"
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@command.command("export")
@_with_ledger_options
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Parquet file to write.")
@click.option("--table", type=click.Choice(["requests", "batches", "events"]), default="requests")
@user_errors
def export(store: str | None, ledger: str | None, out: str, table: str) -> None:
    """Export a ledger table to parquet (written atomically)."""
    count = _open(store, ledger).export_parquet(out, table)
    click.echo(f"wrote {count} {table} rows to {out}")


if __name__ == "__main__":
    command()
