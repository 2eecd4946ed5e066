"""How a chat request's messages become the prompt beyond the messages themselves: vLLM's
``chat_template_kwargs`` (variables a template reads, such as Qwen3's ``enable_thinking``),
checked at the edge so that none can change how transformers renders; and ``--chat-template``
(a template of the server's instead of the model's)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from dpserve.limits import DEFAULT_REQUEST_LIMITS
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.prompts import RESERVED_TEMPLATE_NAMES
from dpserve.openai.requests import parse_chat_request
from dpserve.tokenizer import (
    ByteTokenizer,
    ChatTemplateError,
    HuggingFaceTokenizer,
    read_chat_template,
    with_chat_template,
)

# Qwen3's way: with enable_thinking false, an empty thought opens the assistant's turn.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    from tests.tiny_model import _train_tokenizer

    wrapped = _train_tokenizer()  # type: ignore[no-untyped-call]
    wrapped.chat_template = THINKING_TEMPLATE
    return HuggingFaceTokenizer(wrapped)


def prompt_of(tokenizer: HuggingFaceTokenizer, **body: Any) -> str:
    request = parse_chat_request({"messages": MESSAGES, **body}, tokenizer)
    assert isinstance(request.prompt, str)
    return request.prompt


def test_a_template_variable_reaches_the_template(tokenizer: HuggingFaceTokenizer) -> None:
    thinking = prompt_of(tokenizer)
    assert thinking.endswith("<|im_start|>assistant\n")
    off = prompt_of(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert off == thinking + "<think>\n\n</think>\n\n"
    # One the template does not read renders as without it (as vLLM, whose clients send
    # enable_thinking to every model).
    assert prompt_of(tokenizer, chat_template_kwargs={"unused": 1}) == thinking


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ([1], "chat_template_kwargs"),
        ({"tokenize": True}, "chat_template_kwargs.tokenize"),
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"chat_template": "{{ 1 }}"}, "chat_template_kwargs.chat_template"),
        ({"not a name": 1}, "chat_template_kwargs.not a name"),
    ],
)
def test_what_cannot_be_a_template_variable_is_a_400(
    tokenizer: HuggingFaceTokenizer, kwargs: Any, param: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        prompt_of(tokenizer, chat_template_kwargs=kwargs)
    assert caught.value.param == param


def test_the_reserved_names_cover_every_parameter_of_transformers_renderer() -> None:
    from transformers import PreTrainedTokenizerFast

    parameters = inspect.signature(PreTrainedTokenizerFast.apply_chat_template).parameters
    named = {name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD} - {"self"}
    assert named <= RESERVED_TEMPLATE_NAMES, named - RESERVED_TEMPLATE_NAMES


def test_template_variables_count_against_max_prompt_chars(
    tokenizer: HuggingFaceTokenizer,
) -> None:
    limits = dataclasses.replace(DEFAULT_REQUEST_LIMITS, max_prompt_chars=100)
    body = {"messages": MESSAGES, "chat_template_kwargs": {"note": "x" * 200}}
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(body, tokenizer, limits)
    assert caught.value.code == "max_prompt_chars"


# ------------------------------------------------------------------- --chat-template


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path: Any) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(THINKING_TEMPLATE)
    assert read_chat_template(str(path)) == THINKING_TEMPLATE
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ChatTemplateError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_a_chat_template_replaces_the_models_own() -> None:
    from tests.tiny_model import _train_tokenizer

    tokenizer = HuggingFaceTokenizer(_train_tokenizer())  # type: ignore[no-untyped-call]
    plain = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert with_chat_template(tokenizer, plain).apply_chat_template(MESSAGES) == "[user] hi\n"
    with pytest.raises(ChatTemplateError, match="does not render a conversation"):
        with_chat_template(tokenizer, "{{ messages[5].content.upper() }}")
    with pytest.raises(ChatTemplateError, match="needs a model's tokenizer"):
        with_chat_template(ByteTokenizer(), plain)
    assert with_chat_template(ByteTokenizer(), None).apply_chat_template(MESSAGES)


def test_the_coordinator_flag_reaches_its_config(tmp_path: Any) -> None:
    from dpserve.cli import build_parser
    from dpserve.cli.coordinator import coordinator_config

    path = tmp_path / "chat.jinja"
    path.write_text(THINKING_TEMPLATE)
    args = build_parser().parse_args(["coordinator", "--chat-template", str(path)])
    assert coordinator_config(args).chat_template == THINKING_TEMPLATE
