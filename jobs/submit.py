"""``unlearn submit``: run any ``unlearn`` command as a Ray job (Ray Jobs SDK wrapper).

    unlearn submit run [--address URL] [--working-dir .] [--wait/--no-wait] -- forget --config c.yaml --workers 2
    unlearn submit status JOB_ID      unlearn submit logs JOB_ID [--follow]
    unlearn submit stop JOB_ID        unlearn submit list

``run`` uploads the working directory (``runtime_env.working_dir``; the virtualenv, git data,
runs/, caches and build outputs excluded) and starts ``<python> -m jobs.cli ARGS`` as the
job's entrypoint, ``<python>`` being this interpreter unless ``--python`` names the cluster's.
It is the same as ``ray job submit --working-dir . -- python -m jobs.cli ARGS``. With
``--wait`` (default) it follows the job to the end, prints its logs and exits 0 only if the
job SUCCEEDED. The address is the dashboard's HTTP address (``--address``, else
``RAY_JOB_ADDRESS`` / ``RAY_ADDRESS`` when it is an http URL, else http://127.0.0.1:8265).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import click

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# gitignore-style patterns relative to the working dir (Ray's runtime_env "excludes").
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".venv/", ".git/", "runs/", "__pycache__/", "*.pyc", ".torch_extensions/", "*.egg-info/",
    ".pytest_cache/", "bench/results/", ".whl/", ".gl/", "build/",
)
JOB_ENV: dict[str, str] = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def default_address() -> str:
    for var in ("RAY_JOB_ADDRESS", "RAY_ADDRESS"):
        value = os.environ.get(var, "")
        if value.startswith(("http://", "https://")):
            return value
    return DEFAULT_ADDRESS


def client(address: str):
    """A JobSubmissionClient, with an error that says how to start a head if none answers."""
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as err:  # ConnectionError, or Ray's own subclasses
        raise click.ClickException(
            f"no Ray dashboard answers at {address} ({err.__class__.__name__}: {err}). Start a head with "
            "`ray start --head --dashboard-host=127.0.0.1` or pass --address http://HOST:8265") from None


def build_runtime_env(working_dir: Path, excludes: tuple[str, ...], env: tuple[str, ...]) -> dict[str, Any]:
    """The job's runtime_env: working_dir upload with excludes, offline env vars, user vars."""
    if not (working_dir / "jobs" / "cli.py").exists():
        raise click.BadParameter(f"{working_dir} does not hold jobs/cli.py: run from the project root "
                                 "or pass --working-dir PATH_TO_PROJECT", param_hint="--working-dir")
    env_vars = dict(JOB_ENV)
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"'{item}' is not KEY=VALUE", param_hint="--env")
        env_vars[key] = value
    return {"working_dir": str(working_dir), "excludes": list(DEFAULT_EXCLUDES) + list(excludes),
            "env_vars": env_vars}


def entrypoint(python: str, args: tuple[str, ...]) -> str:
    if not args:
        raise click.UsageError("give the unlearn command to run after --, e.g. -- forget --config c.yaml")
    return shlex.join([python, "-m", "jobs.cli", *args])


def wait_for(c: Any, job_id: str, timeout_s: float, poll_s: float = 1.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        raw = c.get_job_status(job_id)
        status = str(getattr(raw, "value", raw))
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            raise click.ClickException(f"job {job_id} is still {status} after {timeout_s:.0f} s "
                                       f"(`unlearn submit stop {job_id}` stops it)")
        time.sleep(poll_s)


address_option = click.option("--address", default=None,
                              help=f"Ray dashboard address (default: RAY_JOB_ADDRESS, else {DEFAULT_ADDRESS}).")


@click.group("submit")
def command() -> None:
    """Run unlearn commands as Ray jobs and manage them (status, logs, stop, list)."""


@command.command("run", context_settings={"ignore_unknown_options": True})
@address_option
@click.option("--working-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=".",
              show_default=True, help="Project directory uploaded as the job's working_dir.")
@click.option("--python", "python", default=None,
              help="Interpreter on the cluster that has the package installed (default: this one).")
@click.option("--exclude", "excludes", multiple=True, help="Extra working_dir exclude pattern (repeatable).")
@click.option("--env", "env", multiple=True, help="KEY=VALUE for the job's environment (repeatable).")
@click.option("--job-id", default=None, help="Submission id (default: generated by Ray).")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Follow the job to its end.")
@click.option("--timeout", "timeout_s", type=float, default=3600.0, show_default=True,
              help="With --wait: give up after this many seconds.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(address: str | None, working_dir: Path, python: str | None, excludes: tuple[str, ...],
        env: tuple[str, ...], job_id: str | None, wait: bool, timeout_s: float, args: tuple[str, ...]) -> None:
    """Submit `unlearn ARGS` as a Ray job (after --)."""
    address = address or default_address()
    runtime_env = build_runtime_env(working_dir.resolve(), excludes, env)
    c = client(address)
    sub = c.submit_job(entrypoint=entrypoint(python or sys.executable, args), runtime_env=runtime_env,
                       submission_id=job_id)
    click.echo(json.dumps({"job_id": sub, "address": address}))
    if not wait:
        return
    status = wait_for(c, sub, timeout_s)
    click.echo(c.get_job_logs(sub), nl=False)
    click.echo(json.dumps({"job_id": sub, "status": status}))
    if status != "SUCCEEDED":
        sys.exit(1)


@command.command("status")
@address_option
@click.argument("job_id")
def status(address: str | None, job_id: str) -> None:
    """Print a job's status (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)."""
    info = client(address or default_address()).get_job_info(job_id)
    click.echo(json.dumps({"job_id": job_id, "status": str(info.status.value), "message": info.message,
                           "entrypoint": info.entrypoint}))


@command.command("logs")
@address_option
@click.option("--follow", is_flag=True, help="Stream the logs until the job ends.")
@click.argument("job_id")
def logs(address: str | None, follow: bool, job_id: str) -> None:
    """Print a job's logs."""
    c = client(address or default_address())
    if not follow:
        click.echo(c.get_job_logs(job_id), nl=False)
        return
    import asyncio

    async def tail() -> None:
        async for lines in c.tail_job_logs(job_id):
            click.echo(lines, nl=False)

    asyncio.run(tail())


@command.command("stop")
@address_option
@click.argument("job_id")
def stop(address: str | None, job_id: str) -> None:
    """Ask Ray to stop a job."""
    stopped = client(address or default_address()).stop_job(job_id)
    click.echo(json.dumps({"job_id": job_id, "stop_requested": bool(stopped)}))


@command.command("list")
@address_option
def list_jobs(address: str | None) -> None:
    """List the cluster's jobs."""
    for info in client(address or default_address()).list_jobs():
        click.echo(json.dumps({"job_id": info.submission_id, "status": str(info.status.value),
                               "entrypoint": info.entrypoint}))
