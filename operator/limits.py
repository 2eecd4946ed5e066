"""Admission and sizing limits as fields of the spec: ``spec.coordinator.limits``.

One field per field of ``dpserve.limits.RequestLimits`` and ``AdmissionLimits``, named in
camelCase (``max_prompt_tokens`` → ``maxPromptTokens``); a field that is set becomes the
coordinator's flag of the same name (``--max-prompt-tokens``), one left out keeps the default
from ``dpserve.limits``. The CRD schema lists the same fields (tests/unit/test_operator_limits.py
holds the two together).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from dpserve.flags import CONSTRAINT_LIMITS, sampling_ceiling
from dpserve.limits import DEFAULT_ADMISSION_LIMITS, DEFAULT_REQUEST_LIMITS

# Fields whose flag `dpserve coordinator` does not have (yet): not offered in the spec.
WITHOUT_FLAG: Final[frozenset[str]] = frozenset()


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields() -> dict[str, tuple[str, int | float]]:
    """camelCase field → (snake_case name, default)."""
    result: dict[str, tuple[str, int | float]] = {}
    for defaults in (DEFAULT_REQUEST_LIMITS, DEFAULT_ADMISSION_LIMITS):
        for field in dataclasses.fields(defaults):
            if field.name not in WITHOUT_FLAG:
                result[camel(field.name)] = (field.name, getattr(defaults, field.name))
    return result


LIMIT_FIELDS: Final = _fields()


def parse_limits(data: Any, path: str, problems: list[str]) -> tuple[tuple[str, int | float], ...]:
    """The limits set in ``data`` as (snake_case name, value), in LIMIT_FIELDS order."""
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        problems.append(f"{path}: must be an object")
        return ()
    for key in sorted(set(data) - set(LIMIT_FIELDS)):
        problems.append(f"{path}.{key}: unknown limit; known: {', '.join(LIMIT_FIELDS)}")
    result = []
    for key, (name, default) in LIMIT_FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        kinds = (int,) if isinstance(default, int) else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
            kind = "integer" if isinstance(default, int) else "number"
            problems.append(f"{path}.{key}: must be a positive {kind}, got {value!r}")
            continue
        ceiling = sampling_ceiling(name)
        if ceiling is not None and value > ceiling:
            problems.append(
                f"{path}.{key}: must be at most {ceiling} (what an engine accepts), got {value!r}"
            )
            continue
        result.append((name, value))
    return tuple(result)


def limit_args(limits: tuple[tuple[str, int | float], ...]) -> list[str]:
    """``dpserve coordinator`` flags for the limits set."""
    return [part for name, value in limits for part in (flag(name), str(value))]


def engine_limit_args(limits: tuple[tuple[str, int | float], ...]) -> list[str]:
    """``dpserve engine`` flags for the limits set that engines enforce too: the
    structured-output limits (an engine compiles the constraints)."""
    return limit_args(tuple((name, value) for name, value in limits if name in CONSTRAINT_LIMITS))


def crd_schema() -> dict[str, Any]:
    """The CRD's schema of ``spec.coordinator.limits``."""
    properties = {}
    for key, (name, default) in LIMIT_FIELDS.items():
        if isinstance(default, int):
            properties[key] = {"type": "integer", "minimum": 1}
            ceiling = sampling_ceiling(name)
            if ceiling is not None:
                properties[key]["maximum"] = ceiling
        else:
            properties[key] = {"type": "number", "exclusiveMinimum": True, "minimum": 0}
        properties[key]["description"] = f"default {default}"
    return {
        "type": "object",
        "description": "Admission and request-size limits (docs/security.md); each is the "
        "coordinator flag of the same name (maxPromptTokens: --max-prompt-tokens).",
        "properties": properties,
    }
