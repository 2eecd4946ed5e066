"""Issue 35's structured-output cases against ``dpserve serve`` on the tiny model, as a client
sends them: a hostile constraint does not stall other users, an unsatisfiable one is a 400 (not
an empty "stop"), a tokenizer the grammar library cannot use is a 400 (not a dead engine), and
over many generated hostile constraints every answer is a 400 or a document that validates."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dpserve.limits import DEFAULT_REQUEST_LIMITS
from tests.integration.conftest import serving

BYSTANDER = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
# Issue 35's case 2: a few thousand properties, a 2 MB body (within the 8 MiB body limit).
HUGE_SCHEMA = {
    "type": "object",
    "properties": {
        f"field_number_{i}": {"type": "string", "description": "x" * 300} for i in range(5000)
    },
}
# Within the size limit, still costly: ~1,800 properties (~60 KB).
WIDE_SCHEMA = {
    "type": "object",
    "properties": {f"property_{i}": {"type": "integer"} for i in range(1800)},
}
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def schema_body(schema: Any, max_tokens: int = 32) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


async def timed_post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, int, dict[str, Any]]:
    started = time.monotonic()
    async with session.post(url, json=body) as response:
        answer = await response.json()
        return time.monotonic() - started, response.status, answer


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def assert_followed_or_refused(status: int, answer: dict[str, Any], schema: Any) -> None:
    """A 400, or a 200 whose "stop" text validates (a "length" answer is a cut prefix)."""
    assert status in (200, 400), answer
    if status == 200:
        choice = answer["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), choice
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


async def bystander_latencies(session: aiohttp.ClientSession, base: str, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        took, status, answer = await timed_post(session, f"{base}/completions", BYSTANDER)
        assert status == 200, answer
        latencies.append(took)
    return latencies


async def test_a_hostile_constraint_does_not_stall_other_requests(tiny_serve_url: str) -> None:
    """On 7c4c0c1 the 2 MB schema took ~30 s, bystanders waited up to 31.8 s (p95 2.2 s against
    0.13 s), and the answer was "{" with finish_reason "stop"."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await bystander_latencies(session, tiny_serve_url, 5)  # warm
        before = await bystander_latencies(session, tiny_serve_url, 40)
        chat = f"{tiny_serve_url}/chat/completions"
        answers: list[tuple[float, int, dict[str, Any], Any]] = []

        async def hostile() -> None:
            for schema in (HUGE_SCHEMA, WIDE_SCHEMA, HUGE_SCHEMA, WIDE_SCHEMA):
                took, status, answer = await timed_post(session, chat, schema_body(schema))
                answers.append((took, status, answer, schema))

        hostile_task = asyncio.create_task(hostile())
        during = await bystander_latencies(session, tiny_serve_url, 40)
        await hostile_task
    for took, status, answer, schema in answers:
        assert_followed_or_refused(status, answer, schema)
        assert took < DEFAULT_REQUEST_LIMITS.constraint_compile_timeout + 10
    huge_answers = [answer for _, status, answer, schema in answers if schema is HUGE_SCHEMA]
    assert all(answer["error"]["code"] == "max_constraint_bytes" for answer in huge_answers)
    # Within 2x of before. A bystander takes 5-15 ms here, and a legitimate 60 KB constraint's
    # compile (~0.3 s of a core, at nice 10) still shares the 2 cores with the engine's torch
    # threads, so the baseline is floored at 100 ms: what this catches is a stall (on 7c4c0c1
    # bystanders waited up to 31.8 s), not the scheduler's noise.
    assert p95(during) <= 2 * max(p95(before), 0.1), (p95(before), p95(during))


async def test_a_schema_with_no_finite_document_is_a_400(tiny_serve_url: str) -> None:
    """On 7c4c0c1 a $ref cycle with no base case returned "" with finish_reason "stop"."""
    self_required = {
        "type": "object",
        "properties": {"child": {"$ref": "#"}},
        "required": ["child"],
    }
    async with aiohttp.ClientSession() as session:
        for schema in (CYCLE, self_required):
            url = f"{tiny_serve_url}/chat/completions"
            _, status, answer = await timed_post(session, url, schema_body(schema))
            assert status == 400, answer
            assert "admits no" in answer["error"]["message"]
        _, status, answer = await timed_post(session, f"{tiny_serve_url}/completions", BYSTANDER)
        assert status == 200


@pytest.fixture(scope="module")
def byte_serve_url(
    tiny_byte_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    log = tmp_path_factory.mktemp("byte-serve") / "serve.log"
    with serving(tiny_byte_model_path, log) as url:
        yield url


class City(BaseModel):
    name: str
    capital: bool


def test_parse_on_a_tokenizer_without_a_fast_version_is_a_400(byte_serve_url: str) -> None:
    """On 7c4c0c1 the OpenAI SDK's parse() ended the engine (llguidance: "Only fast tokenizers
    are supported") and `dpserve serve` with it: 503 to everything."""
    client = openai.OpenAI(api_key="unused", base_url=byte_serve_url, max_retries=0, timeout=60)
    messages: Any = [{"role": "user", "content": "A city?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.beta.chat.completions.parse(
            model="m", messages=messages, response_format=City, max_tokens=20
        )
    assert "cannot use its tokenizer" in str(refused.value)
    # Nobody else noticed: the engine and serve still answer.
    plain = client.completions.create(model="m", prompt="abc", max_tokens=4, temperature=0)
    assert plain.choices[0].finish_reason in ("length", "stop")


# Hostile constraints: deep, wide, recursive, huge enumerations, pathological regexes.
_LEAF = st.sampled_from(
    [
        {"type": "string"},
        {"type": "integer"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "string", "pattern": "^(a+)+b$"},
        {"type": "string", "maxLength": 3},
        {"$ref": "#"},
    ]
)


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, max_size=6).map(
        lambda properties: {
            "type": "object",
            "properties": properties,
            "required": sorted(properties)[: len(properties) // 2],
            "additionalProperties": False,
        }
    )


_SCHEMAS = st.one_of(
    st.recursive(
        _LEAF,
        lambda children: st.one_of(
            _object(children),
            st.builds(
                lambda items, least: {"type": "array", "items": items, "minItems": least},
                children,
                st.integers(0, 3),
            ),
            st.lists(children, min_size=1, max_size=4).map(lambda options: {"anyOf": options}),
        ),
        max_leaves=12,
    ),
    st.integers(1, 3000).map(lambda n: {"enum": [f"value-{i}" for i in range(n)]}),
    st.integers(100, 4000).map(
        lambda n: {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(n)}}
    ),
    st.integers(5, 300).map(
        lambda depth: json.loads('{"type":"array","items":' * depth + "{}" + "}" * depth)
    ),
)
_REGEXES = st.sampled_from(
    ["(a+)+$", "(a|aa)*b", "([a-z]+)*[0-9]{2,40}", "(x{1,50}){1,50}y", "[0-9]{1000}", "(.*a){12}"]
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    constraint=st.one_of(
        _SCHEMAS.map(lambda s: ("schema", s)), _REGEXES.map(lambda r: ("regex", r))
    )
)
def test_every_answer_to_a_hostile_constraint_is_a_400_or_a_valid_document(
    tiny_serve_url: str, constraint: tuple[str, Any]
) -> None:
    kind, value = constraint
    if kind == "schema":
        body = schema_body(value)
        url = f"{tiny_serve_url}/chat/completions"
    else:
        body = {"prompt": "x", "max_tokens": 32, "temperature": 1.0, "seed": 1}
        body["guided_regex"] = value
        url = f"{tiny_serve_url}/completions"

    async def ask() -> tuple[float, int, dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await timed_post(session, url, body)

    took, status, answer = asyncio.run(ask())
    # The compile budget (front check and engine compile) plus 32 tokens on the tiny model.
    assert took < 2 * DEFAULT_REQUEST_LIMITS.constraint_compile_timeout + 10, (took, value)
    if kind == "schema":
        assert_followed_or_refused(status, answer, value)
    else:
        assert status in (200, 400), answer
        if status == 200 and answer["choices"][0]["finish_reason"] == "stop":
            assert re.fullmatch(value, answer["choices"][0]["text"])
