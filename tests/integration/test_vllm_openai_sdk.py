"""The OpenAI SDK suite (``test_openai_sdk``) and the lm-evaluation-harness test
(``test_lm_eval``: every choice's log-likelihood equal to transformers') against ``dpserve serve
--backend vllm``: the same tests, on the tiny Llama vLLM's CPU build runs (head size 64), its
engine vLLM's core. Their fixtures ``tiny_model_path`` and ``tiny_serve_url`` are this
module's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpserve.limits import DEFAULT_PREFIX_CACHE_LIMITS, DEFAULT_REQUEST_LIMITS
from dpserve.sampling import MAX_TEMPERATURE
from tests.integration.conftest import serving
from tests.integration.test_http_fuzz import fuzz_the_front
from tests.integration.test_lm_eval import (  # collected here again, against vLLM
    test_lm_eval_scores_a_local_multiple_choice_task_with_exact_loglikelihoods,
)
from tests.integration.test_openai_sdk import (  # the suite, collected here again
    client,
    test_a_streamed_choice_has_the_stop_tokens_logprob_last,
    test_an_invalid_schema_is_a_400_naming_the_problem,
    test_best_of_and_penalties,
    test_completions_echo_prompt_logprobs_and_prompt_lists,
    test_continue_final_message_continues_the_assistants_text,
    test_guided_choice_counts_the_stop_token,
    test_n_choices_each_with_its_index_and_greedy_choice_0_equals_one_request,
    test_parse_returns_a_pydantic_object,
    test_streamed_logprobs,
    test_tools_without_a_parser_work_except_auto_which_names_the_flag,
    test_top_logprobs_in_chat_and_greedy_top_1_is_the_token,
)
from tests.integration.vllm_support import VLLM_ENGINE_FLAGS, build_vllm_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

__all__ = [
    "client",
    "test_a_streamed_choice_has_the_stop_tokens_logprob_last",
    "test_an_invalid_schema_is_a_400_naming_the_problem",
    "test_best_of_and_penalties",
    "test_completions_echo_prompt_logprobs_and_prompt_lists",
    "test_continue_final_message_continues_the_assistants_text",
    "test_guided_choice_counts_the_stop_token",
    "test_lm_eval_scores_a_local_multiple_choice_task_with_exact_loglikelihoods",
    "test_n_choices_each_with_its_index_and_greedy_choice_0_equals_one_request",
    "test_parse_returns_a_pydantic_object",
    "test_streamed_logprobs",
    "test_tools_without_a_parser_work_except_auto_which_names_the_flag",
    "test_top_logprobs_in_chat_and_greedy_top_1_is_the_token",
]


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_llama(tmp_path_factory.mktemp("vllm-sdk-llama"))


@pytest.fixture(scope="module")
def tiny_serve_url(
    tiny_model_path: Path, vllm_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vllm-sdk") / "serve.log"
    flags = ("--backend", "vllm", "--engine-python", vllm_python, *VLLM_ENGINE_FLAGS)
    with serving(tiny_model_path, log, *flags) as url:
        yield url


def test_fuzzed_bodies_get_2xx_or_4xx_from_vllm_engines(tiny_serve_url: str) -> None:
    """The front's fuzz (``test_http_fuzz``) against a vLLM engine: what the front accepts
    is served, what vLLM refuses is the request's 4xx, and the front ends idle."""
    fuzz_the_front(tiny_serve_url.removesuffix("/v1"), examples=80)


LIMITS = DEFAULT_REQUEST_LIMITS
# Each sampling field at the edges of what dpserve's edge accepts (a body of its own each).
EDGES: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 5e-324},
    {"temperature": MAX_TEMPERATURE, "seed": 2**63 - 1},
    {"temperature": 1, "seed": 0, "top_p": 5e-324},
    {"temperature": 1, "top_k": 2**62, "min_p": 1.0},
    {"temperature": 1, "top_k": -1, "min_p": 5e-324},
    {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 100},
    {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 5e-324},
    {"logit_bias": {str(i): -100 + i % 201 for i in range(LIMITS.max_logit_bias_tokens)}},
    {"logprobs": LIMITS.max_top_logprobs},
    {"logprobs": LIMITS.max_top_logprobs, "echo": True, "max_tokens": 0},
    {"n": LIMITS.max_choices, "temperature": 1},
    {"best_of": LIMITS.max_choices, "n": 1},
    {"stop": ["x" * LIMITS.max_stop_string_chars] * LIMITS.max_stop_strings},
    {"stop_token_ids": list(range(LIMITS.max_stop_token_ids))},
    {"min_tokens": 4, "max_tokens": 4},
    {"cache_salt": "s" * DEFAULT_PREFIX_CACHE_LIMITS.max_cache_salt_chars},
    {"guided_choice": ["a" * 200, "b"]},
    {"ignore_eos": True, "include_stop_str_in_output": True, "stop": ["a"]},
]


@pytest.mark.parametrize("edge", EDGES, ids=[",".join(edge) for edge in EDGES])
def test_values_at_the_edges_of_the_fronts_ranges_are_taken_by_vllm(
    tiny_serve_url: str, edge: dict[str, Any]
) -> None:
    """Whatever dpserve's edge accepts, vLLM's engine serves: no value that passed the front
    comes back as vLLM's refusal (a temperature above 2 did, as a 502, before the edge held
    temperatures to OpenAI's [0, 2])."""
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 4, **edge}
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(
        f"{tiny_serve_url}/completions", json.dumps(body).encode(), headers
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.load(reply)
    except urllib.error.HTTPError as error:
        raise AssertionError(f"{error.code}: {error.read()[:500]!r}") from None
    assert answer["choices"], answer
