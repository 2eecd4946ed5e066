"""Structured-output constraints on the engine: compiled off the step loop within their limits,
refused (never answered as followed) when they cannot be followed, and never able to end the
engine (issue 35). The real llguidance on the tiny model throughout."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RequestRejected, RunnerRequest, TokenUpdate
from dpserve.engine.sample.finite_schema import finite_document_problem
from dpserve.engine.sample.grammar import Grammars, GrammarUnavailable
from dpserve.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.protocol import ErrorCode
from dpserve.sampling import SamplingParams

PROMPT = [5, 6, 7, 8]
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SELF_REQUIRED = {
    "type": "object",
    "properties": {"child": {"$ref": "#"}},
    "required": ["child"],
}


def wide_schema(properties: int) -> dict[str, Any]:
    strings = {f"p{i}": {"type": "string"} for i in range(properties)}
    return {"type": "object", "properties": strings}


@pytest.mark.parametrize(
    "schema",
    [
        CYCLE,
        SELF_REQUIRED,
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"x": {"$ref": "#/$defs/n"}},
                    "required": ["x"],
                }
            },
            "anyOf": [{"$ref": "#/$defs/n"}],
        },
        {"allOf": [{"$ref": "#"}]},
        False,
    ],
)
def test_schemas_without_a_finite_document_are_found(schema: Any) -> None:
    assert finite_document_problem(schema) is not None


@pytest.mark.parametrize(
    "schema",
    [
        True,
        {},
        {"type": "object", "properties": {"child": {"$ref": "#"}}},  # optional: {} ends it
        {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]},
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {
            "$defs": {
                "tree": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
                    "required": ["kids"],
                }
            },
            "$ref": "#/$defs/tree",
        },
        {"$ref": "https://example.com/elsewhere"},  # not ours to resolve: the library's
    ],
)
def test_schemas_with_a_finite_document_pass(schema: Any) -> None:
    assert finite_document_problem(schema) is None


@pytest.fixture(scope="module")
def runner(tiny_model_path: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model_path), max_num_seqs=8, device="cpu")


def run_all(runner: ModelRunner, requests: list[RunnerRequest]) -> dict[int, list[TokenUpdate]]:
    for request in requests:
        runner.add(request)
    updates: dict[int, list[TokenUpdate]] = {r.request_id: [] for r in requests}
    deadline = time.monotonic() + 60
    while runner.has_work() and time.monotonic() < deadline:
        for update in runner.step():
            updates[update.request_id].append(update)
    assert not runner.has_work()
    return updates


def refusal(updates: list[TokenUpdate]) -> str:
    (update,) = updates
    assert update.finish_reason == ErrorCode.BAD_REQUEST and update.tokens == []
    assert update.error is not None
    return update.error


def guided(schema: Any, **extra: Any) -> SamplingParams:
    return SamplingParams(guided_json=json.dumps(schema), num_tokens_to_generate=40, **extra)


def test_a_ref_cycle_is_refused_not_answered_as_an_empty_stop(runner: ModelRunner) -> None:
    # On 7c4c0c1 this returned "" with finish_reason "stop".
    updates = run_all(runner, [RunnerRequest(1, PROMPT, guided(CYCLE))])
    assert "admits no" in refusal(updates[1])


def test_a_schema_that_must_contain_itself_is_refused(runner: ModelRunner) -> None:
    updates = run_all(runner, [RunnerRequest(2, PROMPT, guided(SELF_REQUIRED))])
    assert "admits no finite document" in refusal(updates[2])


def test_a_constraint_over_the_size_limit_is_refused_before_it_is_queued(
    runner: ModelRunner,
) -> None:
    params = guided(wide_schema(3000))
    assert len(params.guided_json or "") > DEFAULT_REQUEST_LIMITS.max_constraint_bytes
    with pytest.raises(RequestRejected) as refused:
        runner.add(RunnerRequest(3, PROMPT, params))
    assert refused.value.code == ErrorCode.BAD_REQUEST
    assert "max_constraint_bytes=65536" in refused.value.message
    assert not runner.has_work()


def test_a_slow_compile_is_refused_at_its_budget_while_others_keep_generating(
    tiny_model_path: Path,
) -> None:
    limits = RequestLimits(constraint_compile_timeout=0.05, max_constraint_bytes=10**6)
    runner = ModelRunner(str(tiny_model_path), max_num_seqs=8, device="cpu", limits=limits)
    hostile = guided(wide_schema(2500))  # ~0.5-1 s to compile on one core
    bystander = SamplingParams(num_tokens_to_generate=30, ignore_eos=True)
    runner.add(RunnerRequest(10, PROMPT, hostile))
    runner.add(RunnerRequest(11, PROMPT, bystander))
    seen: dict[int, list[TokenUpdate]] = {10: [], 11: []}
    tokens_while_compiling = 0
    while runner.has_work():
        compiling = runner._compiler.pending()
        for update in runner.step():
            seen[update.request_id].append(update)
            if update.request_id == 11 and compiling:
                tokens_while_compiling += len(update.tokens)
    assert "constraint_compile_timeout=0.05" in refusal(seen[10])
    assert seen[11][-1].finish_reason == "length"
    assert sum(len(update.tokens) for update in seen[11]) == 30
    # Steps ran (and returned tokens) while the compile was under way: it is off the loop.
    assert tokens_while_compiling > 0


def test_a_constraint_whose_mask_is_too_costly_is_refused(tiny_model_path: Path) -> None:
    limits = RequestLimits(constraint_mask_timeout=1e-9)
    runner = ModelRunner(str(tiny_model_path), max_num_seqs=8, device="cpu", limits=limits)
    updates = run_all(runner, [RunnerRequest(20, PROMPT, guided({"type": "object"}))])
    assert "constraint_mask_timeout" in refusal(updates[20])


def test_a_cancelled_compile_reports_nothing(runner: ModelRunner) -> None:
    runner.add(RunnerRequest(30, PROMPT, guided({"type": "object"})))
    runner.cancel(30)
    assert not runner.has_work()


def test_every_stop_under_a_constraint_is_a_valid_document(runner: ModelRunner) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    requests = [
        RunnerRequest(40 + seed, PROMPT, guided(schema, temperature=1.0, seed=seed))
        for seed in range(6)
    ]
    updates = run_all(runner, requests)
    import jsonschema  # type: ignore[import-untyped]

    for request in requests:
        last = updates[request.request_id][-1]
        assert last.error is None
        if last.finish_reason == "stop":
            tokens = [t for u in updates[request.request_id] for t in u.tokens]
            jsonschema.validate(json.loads(runner.tokenizer.decode(tokens)), schema)


def test_an_error_mid_generation_fails_the_request_instead_of_stopping(
    runner: ModelRunner,
) -> None:
    """A matcher in llguidance's error state (here: fed a token its mask forbids, as a limit hit
    while computing a mask leaves it) ends its request with an error, not "stop"."""
    grammars = Grammars(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)
    params = guided({"type": "object"})
    sequence_params = RunnerRequest(50, PROMPT, params)
    runner.add(sequence_params)
    while runner.has_work() and 50 not in runner._live:
        runner.step()
    sequence = runner._live[50]
    matcher = sequence.matcher
    assert matcher is not None and grammars is not None
    forbidden = runner.tokenizer.encode("]", add_special_tokens=False)[0]
    broken = runner._follow_constraint(sequence, forbidden)
    assert broken is not None and broken.finish_reason == ErrorCode.ENGINE_ERROR
    assert broken.error is not None and "failed during generation" in broken.error
    runner.cancel(50)


def test_a_stop_token_before_the_document_is_complete_is_an_error(runner: ModelRunner) -> None:
    runner.add(RunnerRequest(60, PROMPT, guided({"type": "object"})))
    while runner.has_work() and 60 not in runner._live:
        runner.step()
    sequence = runner._live[60]
    eos = next(iter(sequence.stop_ids))
    broken = runner._follow_constraint(sequence, eos)  # nothing generated yet: "" is no object
    assert broken is not None and broken.error is not None
    assert "before the document was complete" in broken.error
    runner.cancel(60)


def test_a_tokenizer_the_grammar_library_cannot_use_is_a_400_not_a_dead_engine(
    tiny_byte_model_path: Path,
) -> None:
    runner = ModelRunner(str(tiny_byte_model_path), max_num_seqs=4, device="cpu")
    with pytest.raises(GrammarUnavailable):
        Grammars(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)
    runner.warm_up()  # the engine's start builds the tables: unavailable is no reason to die
    for request_id in (70, 71):  # the second is refused from the cached reason
        with pytest.raises(RequestRejected) as refused:
            runner.add(RunnerRequest(request_id, PROMPT, guided({"type": "object"})))
        assert refused.value.code == ErrorCode.BAD_REQUEST
        assert "cannot use its tokenizer" in refused.value.message
    plain = run_all(runner, [RunnerRequest(72, PROMPT, SamplingParams(num_tokens_to_generate=4))])
    assert plain[72][-1].finish_reason in ("length", "stop")
