"""A deletion request's HTTP body, parsed the one way the service accepts it, and the error the
service answers with: ``HttpError`` (status, message, extra fields) and ``parse_json_body`` (depth
checked before parsing, bad UTF-8, bad JSON or huge integers a 400 with the reason, never a 500).
Used by the service's logic (``jobs.service``) and its HTTP front end (``jobs.http_api``)."""
from __future__ import annotations

import json
from typing import Any

__all__ = ["HttpError", "MAX_JSON_DEPTH", "parse_json_body"]

MAX_JSON_DEPTH = 32


class HttpError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


def _depth(raw: bytes) -> int:
    """Deepest nesting of brackets outside strings (checked before parsing, so no RecursionError)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse_json_body(raw: bytes) -> Any:
    """A request body as JSON; any problem (bad UTF-8 or JSON, nesting deeper than
    MAX_JSON_DEPTH, an integer of thousands of digits) is a 400 with the reason, never a 500."""
    if _depth(raw) > MAX_JSON_DEPTH:
        raise HttpError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels; send a flat JSON object")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HttpError(400, f"the body is not valid JSON ({err})") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer longer than Python's 4300-digit limit
        raise HttpError(400, f"the body is not valid JSON ({str(err)[:160]})") from None
