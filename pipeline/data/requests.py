"""The deletion-request schema, and readers for request files (CSV, JSONL, parquet).

A request names a subject (the person asking) and the sample ids of their data. Files have the
columns ``request_id, subject, sample_ids``; in CSV, ``sample_ids`` is a list of integers
separated by ``;``, spaces or commas (``"3;17;42"``) or a JSON list (``"[3, 17, 42]"``).
Readers are looked up by file suffix in ``READERS``.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from pipeline.config import parse_json

REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
MAX_SAMPLES_PER_REQUEST = 100_000
MAX_SAMPLE_ID = 2**63 - 1  # the ledger stores ids as SQLite INTEGER (signed 64-bit)
COLUMNS = ("request_id", "subject", "sample_ids")


class RequestFileError(ValueError):
    """A request file is unreadable or one of its rows is invalid; the message names the row."""


class DeletionRequest(BaseModel):
    """One deletion request: who asks and which training samples are theirs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: Annotated[str, Strict()] = Field(pattern=REQUEST_ID_PATTERN, description="unique id of the request")
    subject: Annotated[str, Strict()] = Field(min_length=1, max_length=256, description="the person or identity asking")
    sample_ids: tuple[Annotated[int, Strict()], ...] = Field(min_length=1, max_length=MAX_SAMPLES_PER_REQUEST)

    @field_validator("sample_ids")
    @classmethod
    def _ids_valid(cls, ids: tuple[int, ...]) -> tuple[int, ...]:
        negative = [i for i in ids if i < 0]
        if negative:
            raise ValueError(f"sample ids must be >= 0, got {negative[:5]}")
        huge = [i for i in ids if i > MAX_SAMPLE_ID]
        if huge:
            raise ValueError(f"sample ids must be <= 2^63 - 1, got one of {len(str(huge[0]))} digits")
        seen: set[int] = set()
        dups = sorted({i for i in ids if i in seen or seen.add(i)})
        if dups:
            raise ValueError(f"duplicate sample ids {dups[:10]}: list each sample once")
        return ids

    def content(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "subject": self.subject, "sample_ids": list(self.sample_ids)}


def _split_ids(raw: Any) -> Any:
    """CSV cells: '1;2;3', '1 2 3', '1,2,3' or a JSON list; other values pass to pydantic."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if text.startswith("["):
        try:
            return parse_json(text, f"sample_ids '{raw[:40]}'")
        except (ValueError, RecursionError) as err:  # JSONDecodeError, an integer too long, too deep
            raise ValueError(f"sample_ids '{raw[:40]}' is not a valid JSON list of integers ({_json_problem(err)})") from None
    parts = [p for p in text.replace(";", " ").replace(",", " ").split() if p]
    out = []
    for p in parts:
        try:
            out.append(int(p))
        except ValueError:
            raise ValueError(f"sample_ids '{raw[:40]}' holds '{p[:40]}', which is not an integer") from None
    return out


def _json_problem(err: BaseException) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at column {err.colno}"
    if isinstance(err, RecursionError):
        return "nested too deeply; a request is a flat object"
    return f"{err}"[:200]


def _read_csv(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise RequestFileError(f"{path}: not UTF-8 text ({err.reason}); save the CSV as UTF-8") from None
    reader = csv.DictReader(io.StringIO(text), strict=True)
    header = reader.fieldnames or []
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise RequestFileError(f"{path}: header {header} lacks columns {missing}; the header must be {','.join(COLUMNS)}")
    extra = [c for c in header if c not in COLUMNS]
    if extra:
        raise RequestFileError(f"{path}: unknown columns {extra}; allowed columns are {list(COLUMNS)}")
    try:
        for row in reader:
            if None in row:
                raise RequestFileError(f"{path} line {reader.line_num}: more cells than columns; quote cells that contain commas")
            yield f"line {reader.line_num}", dict(row)
    except csv.Error as err:
        raise RequestFileError(f"{path} line {reader.line_num}: malformed CSV ({err})") from None


def _read_jsonl(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = parse_json(line, f"{path} line {number}")
        except (ValueError, RecursionError) as err:  # JSONDecodeError, an integer too long, too deep
            raise RequestFileError(f"{path} line {number}: not valid JSON ({_json_problem(err)})") from None
        if not isinstance(obj, dict):
            raise RequestFileError(f"{path} line {number}: each line must be a JSON object with {list(COLUMNS)}")
        yield f"line {number}", obj


def _read_parquet(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise RequestFileError(f"{path}: not a readable parquet file ({err})") from None
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise RequestFileError(f"{path}: columns {table.column_names} lack {missing}")
    extra = [c for c in table.column_names if c not in COLUMNS]
    if extra:
        raise RequestFileError(f"{path}: unknown columns {extra}; allowed columns are {list(COLUMNS)}")
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"row {number}", row


READERS: dict[str, Callable[[Path], Iterable[tuple[str, dict[str, Any]]]]] = {
    ".csv": _read_csv,
    ".jsonl": _read_jsonl,
    ".ndjson": _read_jsonl,
    ".parquet": _read_parquet,
}


def _validation_text(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "row"
        parts.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def read_requests(path: str | Path) -> list[DeletionRequest]:
    """All requests of a file, validated; any bad row, duplicate id or an empty file is an error."""
    path = Path(path)
    if not path.is_file():
        raise RequestFileError(f"request file {path} does not exist")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise RequestFileError(f"{path}: unknown request file type '{path.suffix}'; use one of {sorted(READERS)}")
    out: list[DeletionRequest] = []
    seen: dict[str, str] = {}
    for where, row in reader(path):
        try:
            row = {**row, "sample_ids": _split_ids(row.get("sample_ids"))}
            req = DeletionRequest.model_validate(row)
        except ValueError as err:  # ValidationError is a ValueError
            text = _validation_text(err) if isinstance(err, ValidationError) else str(err)
            rid = row.get("request_id") if isinstance(row, dict) else None
            raise RequestFileError(f"{path} {where} (request_id {rid!r}): {text}") from None
        if req.request_id in seen:
            raise RequestFileError(
                f"{path} {where}: request_id '{req.request_id}' already used at {seen[req.request_id]}; request ids must be unique"
            )
        seen[req.request_id] = where
        out.append(req)
    if not out:
        raise RequestFileError(f"{path} holds no requests: add at least one row with {list(COLUMNS)}")
    return out
