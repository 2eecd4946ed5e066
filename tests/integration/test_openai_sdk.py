"""The real OpenAI Python SDK against ``dpserve serve`` on the tiny model: several choices,
top log-probs (also streamed), echo with prompt log-probs, prompt lists, best_of, penalties and
structured output parsed into a pydantic model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest
import torch

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(tiny_serve_url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=tiny_serve_url, max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_n_choices_each_with_its_index_and_greedy_choice_0_equals_one_request(
    client: openai.OpenAI,
) -> None:
    many = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        n=3,
        max_tokens=12,
        temperature=0.0,  # type: ignore[arg-type]
    )
    one = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].message.content == one.choices[0].message.content
    # Sampled with a seed: each choice its own stream, reproducible.
    sampled = [
        client.completions.create(
            model="m", prompt="Once upon a time", n=3, max_tokens=12, seed=7, temperature=1.0
        )
        for _ in range(2)
    ]
    texts = [c.text for c in sampled[0].choices]
    assert texts == [c.text for c in sampled[1].choices]
    assert len(set(texts)) > 1
    assert sampled[0].usage is not None
    assert sampled[0].usage.completion_tokens >= 3


def test_top_logprobs_in_chat_and_greedy_top_1_is_the_token(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.0,
        logprobs=True,  # type: ignore[arg-type]
        top_logprobs=5,
    )
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(t.token for t in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        logprobs = [top.logprob for top in entry.top_logprobs]
        assert logprobs == sorted(logprobs, reverse=True)


def test_streamed_logprobs(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0.0,
        logprobs=True,  # type: ignore[arg-type]
        top_logprobs=2,
        stream=True,
        n=2,
    )
    texts = {0: "", 1: ""}
    tokens = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                for entry in choice.logprobs.content:
                    assert len(entry.top_logprobs) == 2
                    tokens[choice.index] += entry.token
    assert texts[0] and texts[0] == texts[1]  # greedy: both choices alike
    assert tokens == texts


def test_completions_echo_prompt_logprobs_and_prompt_lists(
    client: openai.OpenAI, tiny_model_path: Path
) -> None:
    prompts = [[5, 17, 42, 99, 7, 63], [120, 33, 8, 250]]
    response = client.completions.create(
        model="m",
        prompt=prompts,
        echo=True,
        logprobs=1,
        max_tokens=0,  # type: ignore[arg-type]
    )
    assert [c.index for c in response.choices] == [0, 1]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for choice, prompt in zip(response.choices, prompts, strict=True):
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == len(prompt)
        assert logprobs.token_logprobs[0] is None
        assert "".join(logprobs.tokens or []) == choice.text  # the prompt only: max_tokens 0
        with torch.inference_mode():
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
        want = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
        assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])  # type: ignore[arg-type]
    assert response.usage is not None and response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == sum(map(len, prompts))


def test_best_of_and_penalties(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="m",
        prompt="Hello",
        n=2,
        best_of=4,
        max_tokens=6,
        seed=1,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3},
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.logprobs is None for c in response.choices)  # not asked for


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10_000)
    capital: bool


def test_parse_returns_a_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.beta.chat.completions.parse(
        model="m",
        messages=MESSAGES,
        response_format=City,
        max_tokens=100,
        seed=3,  # type: ignore[arg-type]
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)


# A sampled yes/no choice with log-probs: the grammar's end forces the stop token.
YES_OR_NO: dict[str, Any] = {
    "model": "m",
    "prompt": "Yes or no?",
    "max_tokens": 20,
    "logprobs": 0,
    "temperature": 1.0,
    "seed": 2,
    "extra_body": {"guided_choice": ["yes", "no"]},
}


def test_guided_choice_counts_the_stop_token(client: openai.OpenAI) -> None:
    response = client.completions.create(**YES_OR_NO)
    choice = response.choices[0]
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    # The grammar's end forces EOS, which is generated and counted (as vLLM and llama.cpp),
    # and has the last log-prob entry, with no text.
    assert response.usage is not None
    assert response.usage.completion_tokens == len(choice.logprobs.tokens)
    assert choice.logprobs.tokens[-1] == "" and "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[-1] is not None


def test_a_streamed_choice_has_the_stop_tokens_logprob_last(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        **YES_OR_NO, stream=True, stream_options={"include_usage": True}
    )
    text, tokens, logprobs, used = "", [], [], None
    for chunk in stream:
        used = chunk.usage or used
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs or []
    assert text in ("yes", "no") and "".join(tokens) == text
    assert used is not None and used.completion_tokens == len(tokens) == len(logprobs)
    assert tokens[-1] == "" and logprobs[-1] is not None


def test_an_invalid_schema_is_a_400_naming_the_problem(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": -1}},
            },
        )
    assert "minProperties" in str(refused.value)


def test_tools_without_a_parser_work_except_auto_which_names_the_flag(
    client: openai.OpenAI,
) -> None:
    tools: Any = [{"type": "function", "function": {"name": "now"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=MESSAGES, tools=tools)  # type: ignore[arg-type]
    assert "--tool-call-parser" in str(refused.value)
    forced = client.chat.completions.create(
        model="m",
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "now"}},
        max_tokens=40,
    )
    [call] = forced.choices[0].message.tool_calls or []
    assert call.function.name == "now"  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]


def test_continue_final_message_continues_the_assistants_text(
    client: openai.OpenAI, tiny_model_path: Path
) -> None:
    from transformers import AutoTokenizer

    conversation: Any = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    continued = client.chat.completions.create(
        model="m",
        messages=conversation,
        max_tokens=8,
        temperature=0.0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    # The same prompt as text: the final message left open, nothing after it.
    prompt = AutoTokenizer.from_pretrained(tiny_model_path).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt.endswith("The capital is")
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0.0)
    assert continued.choices[0].message.content == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="m",
            messages=conversation,
            extra_body={"continue_final_message": True},  # add_generation_prompt defaults true
        )
    assert "add_generation_prompt false" in str(refused.value)
