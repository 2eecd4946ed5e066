"""ModelRunner on the tiny random Llama: top log-probs, prompt log-probs, penalties and
structured output, checked against transformers' own forward where a reference exists."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RequestRejected, RunnerRequest, TokenUpdate
from dpserve.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner(tiny_model_path: Path) -> ModelRunner:
    # Small chunks so a prompt's log-probs come from several prefill chunks.
    return ModelRunner(
        str(tiny_model_path), max_num_seqs=8, max_num_batched_tokens=16, device="cpu"
    )


def run_all(runner: ModelRunner, requests: list[RunnerRequest]) -> dict[int, list[TokenUpdate]]:
    for request in requests:
        runner.add(request)
    updates: dict[int, list[TokenUpdate]] = {r.request_id: [] for r in requests}
    for _ in range(2000):
        if not runner.has_work():
            break
        for update in runner.step():
            updates[update.request_id].append(update)
    assert not runner.has_work()
    return updates


def tokens_of(updates: list[TokenUpdate]) -> list[int]:
    return [token for update in updates for token in update.tokens]


def reference_log_probs(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_top_logprobs_greedy_top1_is_the_sampled_token(runner: ModelRunner) -> None:
    params = SamplingParams(
        temperature=0.0,
        num_tokens_to_generate=8,
        return_log_probs=True,
        top_logprobs=5,
        ignore_eos=True,
    )
    updates = run_all(runner, [RunnerRequest(1, PROMPT, params)])[1]
    tokens = tokens_of(updates)
    logprobs = [lp for u in updates for lp in u.logprobs or []]
    top = [entry for u in updates for entry in u.top_logprobs or []]
    assert len(tokens) == len(logprobs) == len(top) == 8
    for token, logprob, alternatives in zip(tokens, logprobs, top, strict=True):
        assert len(alternatives) == 5
        assert alternatives[0][0] == token
        assert alternatives[0][1] == pytest.approx(logprob, abs=1e-6)
        values = [lp for _, lp in alternatives]
        assert values == sorted(values, reverse=True)


def test_top_logprobs_match_transformers(runner: ModelRunner, reference: Any) -> None:
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        num_tokens_to_generate=6,
        return_log_probs=True,
        top_logprobs=3,
        ignore_eos=True,
    )
    updates = run_all(runner, [RunnerRequest(2, PROMPT, params)])[2]
    tokens = tokens_of(updates)
    top = [entry for u in updates for entry in u.top_logprobs or []]
    expected = reference_log_probs(reference, PROMPT + tokens)
    for index, alternatives in enumerate(top):
        row = expected[len(PROMPT) - 1 + index]
        values, ids = row.topk(3)
        assert [t for t, _ in alternatives] == ids.tolist()
        assert [lp for _, lp in alternatives] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_equal_transformers(runner: ModelRunner, reference: Any) -> None:
    # 40 tokens over chunks of 16: the prompt's log-probs come from three prefill chunks,
    # batched with another request that wants none.
    prompt = [(7 * i + 3) % 380 for i in range(40)]
    wanted = SamplingParams(
        temperature=0.0,
        num_tokens_to_generate=1,
        return_log_probs=True,
        top_logprobs=2,
        prompt_logprobs=True,
    )
    other = SamplingParams(temperature=0.0, num_tokens_to_generate=4)
    updates = run_all(runner, [RunnerRequest(3, prompt, wanted), RunnerRequest(4, PROMPT, other)])
    first = updates[3][0]
    assert first.prompt_logprobs is not None and first.prompt_top_logprobs is not None
    assert all(u.prompt_logprobs is None for u in updates[3][1:] + updates[4])
    expected = reference_log_probs(reference, prompt)
    want = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert first.prompt_logprobs == pytest.approx(want, abs=1e-4)
    for i, alternatives in enumerate(first.prompt_top_logprobs):
        assert [t for t, _ in alternatives] == expected[i].topk(2).indices.tolist()


def test_penalties_change_the_choice_and_are_batch_independent(runner: ModelRunner) -> None:
    base = dict(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)
    plain = SamplingParams(**base)  # type: ignore[arg-type]
    penalized = SamplingParams(**base, frequency_penalty=2.0, presence_penalty=2.0)  # type: ignore[arg-type]
    repetition = SamplingParams(**base, repetition_penalty=1.8)  # type: ignore[arg-type]
    together = run_all(
        runner,
        [
            RunnerRequest(10, PROMPT, plain),
            RunnerRequest(11, PROMPT, penalized),
            RunnerRequest(12, PROMPT, repetition),
        ],
    )
    alone = run_all(runner, [RunnerRequest(13, PROMPT, penalized)])
    plain_tokens = tokens_of(together[10])
    penalized_tokens = tokens_of(together[11])
    assert penalized_tokens == tokens_of(alone[13])
    assert penalized_tokens != plain_tokens
    assert tokens_of(together[12]) != plain_tokens
    # A greedy random model repeats itself; strong penalties spread its choices.
    assert len(set(penalized_tokens)) > len(set(plain_tokens))


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def text_of(runner: ModelRunner, updates: list[TokenUpdate]) -> str:
    text: str = runner.tokenizer.decode(tokens_of(updates), skip_special_tokens=True)
    return text


def test_structured_output_kinds(runner: ModelRunner) -> None:
    common = dict(temperature=1.0, num_tokens_to_generate=120)
    requests = [
        RunnerRequest(
            20 + seed, PROMPT, SamplingParams(**common, seed=seed, guided_json=json.dumps(SCHEMA))
        )  # type: ignore[arg-type]
        for seed in range(4)
    ] + [
        RunnerRequest(
            30,
            PROMPT,
            SamplingParams(**common, seed=1, guided_regex="[0-9]{3}-[a-c]+"),  # type: ignore[arg-type]
        ),
        RunnerRequest(31, PROMPT, SamplingParams(**common, seed=1, guided_choice=("yes", "no"))),  # type: ignore[arg-type]
        RunnerRequest(
            32, PROMPT, SamplingParams(temperature=1.0, seed=5, num_tokens_to_generate=8)
        ),
    ]
    updates = run_all(runner, requests)
    for seed in range(4):
        assert updates[20 + seed][-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(runner, updates[20 + seed])), SCHEMA)
    import re

    assert re.fullmatch("[0-9]{3}-[a-c]+", text_of(runner, updates[30]))
    assert text_of(runner, updates[31]) in ("yes", "no")


def test_an_invalid_grammar_is_refused_with_its_reason(runner: ModelRunner) -> None:
    # Compiled off the step loop: the refusal comes out of a step, as the request's only update.
    params = SamplingParams(guided_regex="(unclosed")
    (update,) = run_all(runner, [RunnerRequest(40, PROMPT, params)])[40]
    assert update.finish_reason == "bad_request"
    assert update.error is not None and "does not compile" in update.error
    assert update.tokens == []


def test_overlapped_steps_give_the_same_outputs(runner: ModelRunner, tiny_model_path: Path) -> None:
    """With overlap (step N+1 prepared while step N runs), sequences whose sampling reads host
    state (penalties, grammars) or that record prompt log-probs are taken in before their next
    step: their outputs equal the sequential engine's."""
    overlapped = ModelRunner(
        str(tiny_model_path), max_num_seqs=8, max_num_batched_tokens=16, device="cpu",
        overlap=True,
    )  # fmt: skip
    requests = [
        (SamplingParams(temperature=0.0, num_tokens_to_generate=10, ignore_eos=True,
                        frequency_penalty=1.5, repetition_penalty=1.3)),
        (SamplingParams(temperature=1.0, seed=4, num_tokens_to_generate=60,
                        guided_json=json.dumps(SCHEMA))),
        (SamplingParams(temperature=0.0, num_tokens_to_generate=3, return_log_probs=True,
                        top_logprobs=2, prompt_logprobs=True)),
        (SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)),
    ]  # fmt: skip
    outputs = []
    for engine, base in ((runner, 50), (overlapped, 60)):
        updates = run_all(
            engine, [RunnerRequest(base + i, PROMPT, p) for i, p in enumerate(requests)]
        )
        outputs.append(
            [
                (tokens_of(updates[base + i]), updates[base + i][0].prompt_logprobs)
                for i in range(len(requests))
            ]
        )
    assert outputs[0] == outputs[1]


def test_stop_token_ids_end_a_request_as_eos_does_with_min_tokens_deferring_them(
    runner: ModelRunner,
) -> None:
    """A ``stop_token_ids`` token ends a request ("stop", the token reported as its stop token,
    not in its tokens) also with ``ignore_eos``; before ``min_tokens`` it is an ordinary
    token."""
    free = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)
    tokens = tokens_of(run_all(runner, [RunnerRequest(1, PROMPT, free)])[1])
    stop = tokens[6]
    first = tokens.index(stop)
    later = [i for i, token in enumerate(tokens) if token == stop and i > first]
    stopping = dataclasses.replace(free, stop_token_ids=(stop, 10**6))
    deferred = dataclasses.replace(stopping, min_tokens=first + 1)
    updates = run_all(
        runner, [RunnerRequest(2, PROMPT, stopping), RunnerRequest(3, PROMPT, deferred)]
    )
    assert tokens_of(updates[2]) == tokens[:first]
    assert (updates[2][-1].finish_reason, updates[2][-1].stop_token) == ("stop", stop)
    if later:  # greedy output repeats itself on a random model, often: stops at the next one
        assert tokens_of(updates[3]) == tokens[: later[0]]
        assert updates[3][-1].stop_token == stop
    else:
        assert tokens_of(updates[3]) == tokens
        assert updates[3][-1].finish_reason == "length"


def test_logit_bias_steers_the_tokens_and_a_token_outside_the_vocabulary_is_refused(
    runner: ModelRunner,
) -> None:
    """A +100 bias makes its token every greedy choice (on the paged path and against a batch
    mate without one); an id past the model's vocabulary is refused when the request arrives,
    never indexed by a step."""
    free = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
    tokens = tokens_of(run_all(runner, [RunnerRequest(1, PROMPT, free)])[1])
    favourite = next(t for t in range(1, 300) if t not in tokens)
    biased = dataclasses.replace(free, logit_bias=((favourite, 100.0),))
    updates = run_all(runner, [RunnerRequest(2, PROMPT, biased), RunnerRequest(3, PROMPT, free)])
    assert tokens_of(updates[2]) == [favourite] * 6
    assert tokens_of(updates[3]) == tokens
    vocab = runner.vocab_size
    outside = dataclasses.replace(free, logit_bias=((vocab, 1.0),))
    with pytest.raises(RequestRejected, match="logit_bias"):
        runner.add(RunnerRequest(4, PROMPT, outside))
    assert not runner.has_work()
