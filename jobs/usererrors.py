"""User errors on the command line: a clear one-paragraph message and exit status 1, never a
traceback. Everything the pipeline raises for bad input is listed here."""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import click
import yaml
from pydantic import ValidationError

from pipeline.data.sampleset import SampleIdError
from pipeline.store.ledger import LedgerError
from pipeline.store.versions import VersionStoreError

USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,            # SpecError, CampaignError, RequestFileError, SampleIdError, pydantic's ValidationError
    LedgerError, VersionStoreError, SampleIdError, ValidationError, yaml.YAMLError,
    FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn the pipeline's user-facing errors into ``click.ClickException`` (exit 1, no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as err:
            raise click.ClickException(str(err)) from None

    return wrapper  # type: ignore[return-value]
