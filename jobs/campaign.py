"""`unlearn campaign`: run, resume, check and inspect batched deletion campaigns."""
from __future__ import annotations

from pathlib import Path

import click

from jobs.usererrors import user_errors

SPEC_HELP = """SPEC is a YAML file:

\b
  name: gdpr-2026-11            # campaign id
  model: {store: ./store, name: digits-linear}
  method: {name: lfoci-newton, settings: {epsilon: 1.0}}
  batch_size: 50
  seed: 0                       # batch k uses seed + k
  limits:
    budget: {epsilon: 10, delta: 1.0e-5, composition: pld}   # basic | pld | rdp
    retain_accuracy_margin: 0.05
  requests: requests.csv        # CSV / JSONL / parquet: request_id, subject, sample_ids
  report_dir: reports/gdpr      # optional
  memory_budget: auto           # or 8GiB: each removal stage's working memory
"""


def _load(spec: str):
    from jobs.specs import CampaignSpec, load_spec

    return load_spec(spec, CampaignSpec, "campaign spec")


def submit_to_ray(address: str, args: list[str]) -> str:
    """Submit ``unlearn <args>`` as a Ray job to ``address`` with `unlearn submit`'s helpers: the
    project directory is the job's working_dir. The spec's store, ledger and request paths must
    be reachable from the node that runs the job (a shared filesystem or paths inside the
    uploaded working directory)."""
    import sys

    from jobs.submit import DEFAULT_EXCLUDES, build_runtime_env, check_job_paths, client, entrypoint

    check_job_paths(Path.cwd(), tuple(args))
    return client(address).submit_job(entrypoint=entrypoint(sys.executable, tuple(args)),
                                      runtime_env=build_runtime_env(Path.cwd(), DEFAULT_EXCLUDES, ()))


@click.group("campaign", epilog=SPEC_HELP)
def command() -> None:
    """Batched deletion campaigns: ingest requests durably, apply them in batches, report.

    A campaign killed at any point finishes with `unlearn campaign resume SPEC`: no request is
    lost or applied twice, and the final version is bitwise the one an uninterrupted run makes.
    Exit status: 0 all batches applied, 1 bad input (nothing written), 3 finished but some
    batches need a retrain or failed (reasons printed and in the report and ledger).
    """


def _run(spec: str, resume: bool, ray_address: str | None, progress: bool | None) -> None:
    loaded = _load(spec)
    if ray_address:
        verb = "resume" if resume else "run"
        job = submit_to_ray(ray_address, ["campaign", verb, spec, "--no-progress"])
        click.echo(f"submitted Ray job {job} to {ray_address}; follow it with `unlearn submit logs {job} --follow`")
        return
    from jobs.campaign_runner import run_campaign

    result = run_campaign(loaded, resume=resume, progress=progress, echo=click.echo)
    if any(b.state != "applied" for b in result.batches):
        click.echo("some batches were not applied (see above and the report); exit status 3", err=True)
        click.get_current_context().exit(3)


@command.command("run", epilog=SPEC_HELP)
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--ray-address", default=None, help="Submit as a Ray job to this cluster (e.g. http://127.0.0.1:8265).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@user_errors
def run(spec: str, ray_address: str | None, progress: bool | None) -> None:
    """Start the campaign in SPEC and run it to the end."""
    _run(spec, False, ray_address, progress)


@command.command("resume", epilog=SPEC_HELP)
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--ray-address", default=None, help="Submit as a Ray job to this cluster.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@user_errors
def resume(spec: str, ray_address: str | None, progress: bool | None) -> None:
    """Finish a campaign that was interrupted (or start it, if it never got ingested)."""
    _run(spec, True, ray_address, progress)


@command.command("check", epilog=SPEC_HELP)
@click.argument("spec", type=click.Path(dir_okay=False))
@user_errors
def check(spec: str) -> None:
    """Validate SPEC, its request file and the sample ids, writing nothing."""
    from jobs.campaign_runner import read_campaign_requests, validate_campaign
    from pipeline.store.versions import VersionStore

    loaded = _load(spec)
    store = VersionStore(loaded.model.store)
    requests = read_campaign_requests(loaded)
    version = validate_campaign(loaded, store, requests)
    batches = -(-len(requests) // loaded.batch_size)
    click.echo(f"ok: {len(requests)} requests in {batches} batches on model '{loaded.model.name}' version {version}")


@command.command("cancel-batch", epilog=SPEC_HELP)
@click.argument("spec", type=click.Path(dir_okay=False))
@click.argument("index", type=click.IntRange(min=0))
@click.option("--reason", required=True, help="Why (recorded in the ledger and the report).")
@user_errors
def cancel_batch(spec: str, index: int, reason: str) -> None:
    """Close batch INDEX of a campaign, stuck as scheduled, as failed: its requests end failed
    with the reason, their samples may be requested again, and `resume` goes on with the next batch."""
    from jobs.campaign_runner import cancel_batch as cancel

    result = cancel(_load(spec), index, reason)
    click.echo(f"batch {result.batch_key}: {result.state}: {result.reason}")


@command.command("status")
@click.argument("spec", type=click.Path(dir_okay=False))
@user_errors
def status(spec: str) -> None:
    """Request states and batches of the campaign in SPEC."""
    import json

    from jobs.report import campaign_summary
    from pipeline.store.ledger import Ledger
    from pipeline.store.versions import VersionStore

    loaded = _load(spec)
    if not loaded.ledger_path().is_file():
        raise click.ClickException(f"no ledger at {loaded.ledger_path()}: the campaign has not started")
    summary = campaign_summary(VersionStore(loaded.model.store), Ledger(loaded.ledger_path()), loaded.name)
    summary.pop("spec")
    summary["costs"].pop("per_request", None)  # (in report.json)
    click.echo(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    command()
