"""The OpenAI SDK suite (``test_openai_sdk``) and the lm-evaluation-harness test
(``test_lm_eval``: every choice's log-likelihood equal to transformers') against ``dpserve serve
--backend vllm``: the same tests, on the tiny Llama vLLM's CPU build runs (head size 64), its
engine vLLM's core. Their fixtures ``tiny_model_path`` and ``tiny_serve_url`` are this
module's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import serving
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
