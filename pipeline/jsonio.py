"""Strict JSON for every record, result and benchmark file the project writes.

JSON has no Infinity or NaN (RFC 8259); Python's ``json`` writes them by default and parsers
other than Python's reject the file. ``jsonable`` turns a record into plain JSON types
(non-finite floats -> null, tensors / numpy values -> numbers or lists, paths -> strings) and
``dumps`` / ``write_json`` refuse anything else (``allow_nan=False``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def jsonable(obj: Any) -> Any:
    """Plain JSON types: tensors / numpy -> lists or numbers, non-finite floats -> None, paths
    -> strings, tuples -> lists, mapping keys -> strings."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "tolist") and not isinstance(obj, bytes):  # tensors, numpy arrays and scalars
        return jsonable(obj.tolist())
    if hasattr(obj, "model_dump"):  # pydantic models
        return jsonable(obj.model_dump(mode="json"))
    return obj


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    """Strict JSON text of ``obj`` (after ``jsonable``); never writes Infinity or NaN."""
    return json.dumps(jsonable(obj), indent=indent, allow_nan=False)


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as strict, indented JSON atomically (temporary name, fsync, rename)."""
    from pipeline.checkpoint import atomic_write_bytes

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, dumps(obj).encode())
    return path
