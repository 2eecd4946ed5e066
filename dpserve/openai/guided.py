"""Structured-output fields of a request (``response_format`` and vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice``) -> ``SamplingParams``' guided fields.

What can be checked without the model's tokenizer is checked here, so a bad constraint is a
400 naming the problem before anything is sent: its size (``max_constraint_bytes``), a regex
must compile, and a schema must be a valid JSON Schema (its meta-schema, by jsonschema-rs:
about a millisecond for the largest schema the size limit lets through; ``check_constraint``
still runs it on a worker thread within ``constraint_compile_timeout``, never on the front's
event loop). The
engine compiles the grammar (llguidance), within the same limits, and refuses what it cannot
compile or what admits no document with a ``bad_request`` (also a 400).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Any, Final

import jsonschema_rs

from dpserve.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.values import json_type
from dpserve.sampling import SamplingParams

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_guided(
    body: Mapping[str, Any], limits: RequestLimits = DEFAULT_REQUEST_LIMITS
) -> dict[str, Any]:
    """The guided ``SamplingParams`` fields the body asks for (at most one constraint), within
    ``max_constraint_bytes``. A schema's meta-schema check is ``check_constraint``'s."""
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
    check_size(found, limits)
    return found


def check_size(found: Mapping[str, Any], limits: RequestLimits, param: str | None = None) -> None:
    """Guided fields within ``max_constraint_bytes``; the engine counts the same bytes
    (``grammar.constraint_size``). ``param``: the field the constraint came from."""
    texts = [found.get("guided_json") or "", found.get("guided_regex") or ""]
    size = sum(len(text.encode()) for text in [*texts, *found.get("guided_choice", ())])
    if size > limits.max_constraint_bytes:
        param = param or ("response_format" if "guided_json" in found else next(iter(found)))
        raise InvalidRequest(
            f"the structured-output constraint has {size} bytes (a schema as compact JSON), "
            f"more than max_constraint_bytes={limits.max_constraint_bytes} "
            "(flag --max-constraint-bytes)",
            param=param,
            code="max_constraint_bytes",
        )


def schema_param(body: Mapping[str, Any]) -> str:
    """The parameter a request's JSON schema came in (errors name it)."""
    if body.get("guided_json") is not None:
        return "guided_json"
    return "response_format.json_schema.schema"


async def check_constraint(
    params: SamplingParams, param: str | None, limits: RequestLimits
) -> None:
    """A schema must be a valid JSON Schema: checked on a worker thread, so a large schema
    never holds up the front's other requests; one that takes longer than
    ``constraint_compile_timeout`` is refused (400) naming the limit. The thread runs on to
    its end (``max_constraint_bytes`` bounds how long) and its result is dropped."""
    if params.guided_json is None:
        return
    param = param or "guided_json"
    schema = json.loads(params.guided_json)
    try:
        await asyncio.wait_for(
            asyncio.to_thread(_check_schema, schema, param), limits.constraint_compile_timeout
        )
    except TimeoutError:
        raise InvalidRequest(
            f"{param} could not be checked within constraint_compile_timeout="
            f"{limits.constraint_compile_timeout:g} s (flag --constraint-compile-timeout)",
            param=param,
            code="constraint_compile_timeout",
        ) from None


def _refuse_retrieval(uri: str) -> Any:
    raise ValueError(f"{uri} is not fetched: a schema's meta-schema must be a known draft")


# A registry of no resources: meta-schema validation then resolves only the drafts the library
# ships and never fetches a `$schema` URI (without one, an unknown URI was fetched over HTTP).
_OFFLINE: Final = jsonschema_rs.Registry([], retriever=_refuse_retrieval)


def _check_schema(schema: Any, param: str) -> None:
    try:
        jsonschema_rs.meta.validate(schema, registry=_OFFLINE)
    except jsonschema_rs.ValidationError as exc:
        where = "/".join(str(part) for part in exc.instance_path) or "(root)"
        raise InvalidRequest(
            f"{param} is not a valid JSON Schema at {where}: {exc.message}", param=param
        ) from None
    except jsonschema_rs.ReferencingError:
        raise InvalidRequest(
            f"{param} names a meta-schema ($schema) that is not a JSON Schema draft this server "
            "knows (draft-04, -06, -07, 2019-09, 2020-12)",
            param=param,
        ) from None


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
    # Compact: the bytes max_constraint_bytes counts, and what travels to the engine.
    return json.dumps(schema, separators=(",", ":"))
