"""``unlearn submit``: run any ``unlearn`` command as a Ray job (Ray Jobs SDK wrapper).

    unlearn submit run [--address URL] [--working-dir .] [--wait/--no-wait] -- forget --config c.yaml --workers 2
    unlearn submit status JOB_ID      unlearn submit logs JOB_ID [--follow]
    unlearn submit stop JOB_ID        unlearn submit list

``run`` uploads the working directory (``runtime_env.working_dir``; the virtualenv, git data,
runs/, caches, build outputs, version stores and ledgers excluded) and starts ``<python> -m jobs.cli ARGS`` as the
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
# A version store or a ledger is never uploaded: a job working on a copy would fork the store and
# its ledger (two "truths" about which requests were applied). They live on storage every node
# mounts, named by absolute paths (see ``check_job_paths``).
STORE_EXCLUDES: tuple[str, ...] = (
    "*.sqlite3", "*.sqlite3-wal", "*.sqlite3-shm", "*.sqlite3-journal", "versions/", ".staging/", "CURRENT",
    "LEDGERS", ".lock",
)
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".venv/", ".git/", "runs/", "__pycache__/", "*.pyc", ".torch_extensions/", "*.egg-info/",
    ".pytest_cache/", "bench/results/", ".whl/", ".gl/", "build/", *STORE_EXCLUDES,
)
# Fields of a job's YAML that name files or folders the job reads or writes.
PATH_FIELDS = frozenset({"model", "store", "ledger", "requests", "output", "out", "report_dir", "ids_file",
                         "model_dir", "port_file", "token_file"})
SHARED_FIELDS = frozenset({"store", "ledger"})  # must be the one shared copy, never an upload
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


def _excluded(relative: Path, excludes: tuple[str, ...]) -> bool:
    import fnmatch

    parts = relative.parts
    for pattern in excludes:
        if pattern.endswith("/"):
            name = pattern.rstrip("/")
            if "/" in name:
                if relative.as_posix().startswith(name + "/") or relative.as_posix() == name:
                    return True
            elif name in parts:
                return True
        elif any(fnmatch.fnmatch(part, pattern) for part in parts):
            return True
    return False


def _yaml_paths(obj: Any, where: str = "") -> list[tuple[str, str]]:
    """(field path, value) of every string under a PATH_FIELDS key of a YAML document."""
    out: list[tuple[str, str]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            at = f"{where}.{key}" if where else str(key)
            if key in PATH_FIELDS and isinstance(value, str):
                out.append((at, value))
            else:
                out += _yaml_paths(value, at)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out += _yaml_paths(value, f"{where}[{i}]")
    return out


def job_config_files(args: tuple[str, ...]) -> list[str]:
    """The YAML files an ``unlearn`` command line reads: ``--config X`` and campaign SPEC arguments."""
    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    files += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    if len(args) >= 3 and args[0] == "campaign" and args[1] in ("run", "resume", "check", "status", "cancel-batch"):
        files.append(args[2])
    return files


def check_job_paths(working_dir: Path, args: tuple[str, ...], excludes: tuple[str, ...] = DEFAULT_EXCLUDES) -> None:
    """Refuse, before anything is submitted, a job whose configuration names a path the job will
    not see: inside a Ray job the working directory is an upload of ``working_dir`` without
    ``excludes`` (runs/, stores, ledgers), so a relative ``model: runs/models/x`` fails there.
    A store or a ledger must be an absolute path on storage every node mounts."""
    import yaml

    problems: list[str] = []
    for name in job_config_files(args):
        config = Path(name)
        local = config if config.is_absolute() else working_dir / config
        if not config.is_absolute() and _excluded(config, excludes):
            problems.append(f"{name}: the configuration file itself is not uploaded (excluded); keep it in the project")
        if not local.is_file():
            continue  # the command itself reports a missing file
        try:
            document = yaml.safe_load(local.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
            continue  # the command reports the syntax error with its own message
        for field, value in _yaml_paths(document):
            path = Path(value)
            if path.is_absolute():
                continue
            if field.split(".")[-1] in SHARED_FIELDS or field in ("model.store",):
                problems.append(f"{name}: {field} = '{value}' is relative: a job would write a copy of the store/ledger "
                                "inside its uploaded working directory; give an absolute path on storage every node mounts")
            elif _excluded(path, excludes) or (value.startswith("..")):
                problems.append(f"{name}: {field} = '{value}' is not uploaded with the working directory (excluded or outside it); "
                                "give an absolute path on storage every node mounts (e.g. /shared/unlearn/...)")
    if problems:
        raise click.ClickException("the job would not find its files on the cluster:\n  - " + "\n  - ".join(problems))


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
    check_job_paths(working_dir.resolve(), args, DEFAULT_EXCLUDES + tuple(excludes))
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
