"""An HTTP body -> a JSON object, refusing what no later step could handle: invalid JSON,
nesting deeper than the limit (checked without recursion), and text that cannot be encoded
as UTF-8 (a lone surrogate such as ``"\\ud800"`` parses as JSON but fails every encoder)."""

from __future__ import annotations

import json
from typing import Any, Final

from dpserve.limits import RequestLimits
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.values import json_type

_SCALARS: Final = frozenset({int, float, bool, type(None)})  # what json.loads makes besides str


def parse_json_body(raw: bytes, limits: RequestLimits) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:  # the C decoder stops at the interpreter's recursion limit
        raise _too_deep(limits.max_json_depth) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidRequest(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"the request body must be a JSON object, got {json_type(body)}", code="invalid_json"
        )
    check_values(body, limits.max_json_depth)
    return body


def check_values(body: dict[str, Any], max_depth: int) -> None:
    """Walk the parsed body once, iteratively: its depth and every string, keys included.
    A refusal names the top-level field it was found under."""
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            _check_text(value, field)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > max_depth:
            raise _too_deep(max_depth)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field or key)
                stack.append((item, depth + 1, field or key))
        elif not _SCALARS.issuperset(map(type, value)):
            # A list of numbers (a token-id prompt of 32k ids) is skipped at C speed.
            stack.extend((item, depth + 1, field) for item in value)


def _check_text(text: str, field: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{field or 'the request'} holds text that is not valid Unicode ({exc.reason} at "
            f"character {exc.start}): lone surrogates such as \\ud800 cannot be encoded",
            param=field,
            code="invalid_unicode",
        ) from None


def _too_deep(max_depth: int) -> InvalidRequest:
    return InvalidRequest(
        f"the request body nests deeper than max_json_depth={max_depth} (flag --max-json-depth)",
        code="max_json_depth",
    )
