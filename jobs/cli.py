"""The ``unlearn`` command line. Each sub-command lives in its own module under jobs/ and
exposes a click command named ``command``; this file only assembles them."""
from __future__ import annotations

import importlib
import os
import sys

import click

# Offline by default: nothing may reach a hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

COMMAND_MODULES: tuple[str, ...] = (
    "jobs.forget",
    "jobs.campaign",
    "jobs.stream",
    "jobs.versions",
    "jobs.ledger",
    "jobs.train",
    "jobs.evaluate",
    "jobs.submit",
    "jobs.mixed_linear_dist",
    "jobs.receipt",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Remove the influence of given training samples from trained models.

    Methods: lfoci-newton (L-CODEC/L-FOCI selection + DP-noised blockwise Newton, the default),
    and the others listed by `unlearn forget --help`. Everything runs offline; Ray starts
    locally unless a cluster address is given.
    """


for _name in COMMAND_MODULES:
    _module = importlib.import_module(_name)
    cli.add_command(_module.command)


def main() -> None:
    try:
        cli.main(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
