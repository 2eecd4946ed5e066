"""Structured output under the hardest model there is, a random one: 200 random JSON schemas
(hypothesis), each sampled on the tiny random-weight Llama under its grammar; every output
must parse and validate (jsonschema). The schemas bound what they generate (string lengths,
integer ranges, array sizes) so a valid answer always fits in the tokens allowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest, TokenUpdate
from dpserve.sampling import SamplingParams

SCHEMAS = 200
BATCH = 20  # schemas sampled together, as one engine batch

_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(
            lambda values: {"enum": values},
            st.lists(
                st.one_of(_NAMES, st.integers(-9, 9), st.booleans()),
                min_size=1,
                max_size=3,
                unique=True,
            ),
        ),
    )


def _schema(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    if depth == 0:
        return _leaf()
    child = _schema(depth - 1)
    obj = st.builds(
        lambda props, data: {
            "type": "object",
            "properties": props,
            "required": sorted(data.draw(st.sets(st.sampled_from(sorted(props))))) if props else [],
            "additionalProperties": False,
        },
        st.dictionaries(_NAMES, child, max_size=3),
        st.data(),
    )
    array = st.builds(
        lambda items, n: {"type": "array", "items": items, "maxItems": n},
        child,
        st.integers(0, 2),
    )
    any_of = st.builds(lambda a, b: {"anyOf": [a, b]}, child, child)
    return st.one_of(_leaf(), obj, array, any_of)


@pytest.fixture(scope="module")
def runner(tiny_model_path: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model_path), max_num_seqs=BATCH, device="cpu")


def _run(runner: ModelRunner, params: list[SamplingParams]) -> list[list[int]]:
    for index, p in enumerate(params):
        runner.add(RunnerRequest(index, [1, 20, 30, 40], p))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(params))}
    finish: dict[int, str | None] = {}
    while runner.has_work():
        update: TokenUpdate
        for update in runner.step():
            tokens[update.request_id] += update.tokens
            if update.finish_reason is not None:
                finish[update.request_id] = update.finish_reason
    assert all(reason == "stop" for reason in finish.values()), finish
    return [tokens[i] for i in range(len(params))]


def test_random_schemas_always_give_valid_json(runner: ModelRunner) -> None:
    collected: list[dict[str, Any]] = []

    @settings(
        max_examples=SCHEMAS,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_schema(2))
    def collect(schema: dict[str, Any]) -> None:
        collected.append(schema)

    collect()
    assert len(collected) >= SCHEMAS * 0.9
    for start in range(0, len(collected), BATCH):
        schemas = collected[start : start + BATCH]
        params = [
            SamplingParams(
                temperature=1.0,
                seed=start + i,
                num_tokens_to_generate=240,
                guided_json=json.dumps(schema),
            )
            for i, schema in enumerate(schemas)
        ]
        outputs = _run(runner, params)
        for schema, generated in zip(schemas, outputs, strict=True):
            text = runner.tokenizer.decode(generated, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), schema)
