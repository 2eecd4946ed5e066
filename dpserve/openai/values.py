"""Typed reads of JSON values from a request body: each raises ``InvalidRequest`` naming the
field, so the parsers in ``requests`` read like the API they accept."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpserve.openai.errors import InvalidRequest


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_id(value: Any) -> bool:
    return is_int(value) and 0 <= value < 2**31


def same_json(value: Any, expected: Any) -> bool:
    # JSON has one number type: 0 and 0.0 are the same, but true is not 1.
    return isinstance(value, bool) == isinstance(expected, bool) and value == expected


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def read_int(body: Mapping[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise InvalidRequest(f"{name} must be an integer, got {json_type(value)}", param=name)
    # JSON integers are unbounded; the wire format (msgpack) stops at 64 bits.
    if not -(2**63) <= value < 2**63:
        raise InvalidRequest(f"{name} is out of range", param=name)
    return value


def read_positive_int(body: Mapping[str, Any], name: str, default: int) -> int:
    value = read_int(body, name, default)
    if value < 1:
        raise InvalidRequest(f"{name} must be >= 1, got {value}", param=name)
    return int(value)


def read_number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, got {json_type(value)}", param=name)
    try:
        return float(value)
    except OverflowError:  # an integer too large for a float
        raise InvalidRequest(f"{name} is out of range", param=name) from None


def read_bool(
    body: Mapping[str, Any], name: str, *, default: bool, param: str | None = None
) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(
            f"{name} must be true or false, got {json_type(value)}", param=param or name
        )
    return value
