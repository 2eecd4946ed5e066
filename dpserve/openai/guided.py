"""Structured-output fields of a request (``response_format`` and vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice``) -> ``SamplingParams``' guided fields.

What can be checked without the model's tokenizer is checked here, so a bad constraint is a
400 naming the problem before anything is sent: a schema must be a valid JSON Schema (its
meta-schema), a regex must compile. The engine compiles the grammar (llguidance) and refuses
what it cannot compile with a ``bad_request`` (also a 400).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from dpserve.openai.errors import InvalidRequest
from dpserve.openai.values import json_type

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_guided(body: Mapping[str, Any]) -> dict[str, Any]:
    """The guided ``SamplingParams`` fields the body asks for (at most one constraint)."""
    found: dict[str, Any] = {}
    response_format = body.get("response_format")
    if response_format is not None:
        found.update(_response_format(response_format))
    if body.get("guided_json") is not None:
        found["guided_json"] = _schema_text(body["guided_json"], "guided_json")
    if body.get("guided_regex") is not None:
        regex = body["guided_regex"]
        if not isinstance(regex, str) or not regex:
            raise InvalidRequest("guided_regex must be a non-empty string", param="guided_regex")
        try:
            re.compile(regex)
        except re.error as exc:
            raise InvalidRequest(
                f"guided_regex is not a regular expression: {exc}", "guided_regex"
            ) from None
        found["guided_regex"] = regex
    if body.get("guided_choice") is not None:
        choices = body["guided_choice"]
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise InvalidRequest(
                "guided_choice must be a non-empty list of non-empty strings", "guided_choice"
            )
        found["guided_choice"] = tuple(choices)
    if len(found) > 1:
        raise InvalidRequest(
            "at most one structured-output constraint (response_format json_object / "
            "json_schema, guided_json, guided_regex, guided_choice) per request",
            param="response_format",
        )
    return found


def _response_format(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest("response_format must be an object", param="response_format")
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
            param="response_format.type",
        )
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"guided_json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequest(
            "response_format json_schema needs json_schema: {name, schema, strict}",
            param="response_format.json_schema",
        )
    return {"guided_json": _schema_text(spec["schema"], "response_format.json_schema.schema")}


def _schema_text(schema: object, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{param} is not JSON: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(
            f"{param} must be a JSON schema object, got {json_type(schema)}", param
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "(root)"
        raise InvalidRequest(
            f"{param} is not a valid JSON Schema at {where}: {exc.message}", param=param
        ) from None
    return json.dumps(schema)
