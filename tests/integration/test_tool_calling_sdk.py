"""Tool calling through ``dpserve serve --tool-call-parser hermes`` (and ``llama3_json`` with
``--reasoning-parser qwen3``) on the tiny model, called with the real OpenAI SDK:

* a named function and ``required`` give calls whose arguments follow the tool's schema (the
  reply is constrained to it), whole and streamed;
* ``auto`` on a model that calls nothing gives the same text as ``none``;
* ``auto`` reads the calls out of a reply in each format (the random model is steered into the
  format by a structured-output constraint, which ``auto`` leaves the client free to send);
* a conversation carrying a call and its result is served;
* a thought comes back apart (all of a reply that never ends it), not from a constrained reply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema_rs
import openai
import pytest

from tests.integration.conftest import serving

pytestmark = pytest.mark.timeout(300)

FORECAST_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": "The weather for the next days",
            "parameters": FORECAST_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]
FORECAST_CHOICE: Any = {"type": "function", "function": {"name": "forecast"}}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(tiny_model_path, log, "--tool-call-parser", "hermes") as url:
        yield openai.OpenAI(api_key="unused", base_url=url, max_retries=0, timeout=120)


def forecast_arguments_are_valid(arguments: str) -> bool:
    return bool(jsonschema_rs.validator_for(FORECAST_PARAMETERS).is_valid(json.loads(arguments)))


def test_a_named_function_is_called_with_arguments_of_its_schema(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=FORECAST_CHOICE,
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=100,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"  # OpenAI's for a forced function
        assert choice.message.content is None
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "forecast"
        assert forecast_arguments_are_valid(call.function.arguments)


def streamed(client: openai.OpenAI, **request: Any) -> tuple[str, dict[int, dict[str, str]], str]:
    """The content, the calls (by index, their deltas joined as a client does) and the
    finish reason of a one-choice stream."""
    content, finish = "", ""
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(model="m", stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_streamed_named_call_equals_the_whole_one(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": FORECAST_CHOICE,
        "temperature": 0.0,
        "max_tokens": 100,
    }
    whole = client.chat.completions.create(model="m", **request)
    content, calls, finish = streamed(client, **request)
    [call] = whole.choices[0].message.tool_calls or []
    assert content == "" and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("forecast", call.function.arguments)
    ]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_one_call_of_a_tool_when_calls_are_not_parallel(
    client: openai.OpenAI, stream: bool
) -> None:
    request: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 120,
    }
    if stream:
        content, by_index, finish = streamed(client, **request)
        calls = [(c["name"], c["arguments"]) for c in by_index.values()]
    else:
        response = client.chat.completions.create(model="m", **request)
        message, finish = response.choices[0].message, response.choices[0].finish_reason
        content = message.content or ""
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert finish == "tool_calls" and content == ""
    [(name, arguments)] = calls
    assert name in ("forecast", "now")
    if name == "forecast":
        assert forecast_arguments_are_valid(arguments)
    else:
        assert json.loads(arguments) == {}


def test_auto_on_a_model_that_calls_nothing_gives_the_text_of_none(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": 24,
    }
    plain = client.chat.completions.create(model="m", tool_choice="none", **request)
    auto = client.chat.completions.create(model="m", **request)  # auto: OpenAI's default
    text = plain.choices[0].message.content
    assert text and "<tool_call>" not in text
    assert auto.choices[0].message.content == text and auto.choices[0].message.tool_calls is None
    assert auto.choices[0].finish_reason == plain.choices[0].finish_reason
    content, calls, _ = streamed(client, **request)
    assert content == text and calls == {}


def test_auto_reads_hermes_calls_and_the_text_before_them(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 100,
        "extra_body": {
            "guided_regex": r'Checking\.<tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'
        },
    }
    response = client.chat.completions.create(model="m", **request)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        ("now", "{}")
    ]
    content, calls, finish = streamed(client, **request)
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("now", "{}")]


LLAMA3_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"enum": ["forecast"]}, "parameters": FORECAST_PARAMETERS},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}


# The server's own template (--chat-template), which shows the model its tools.
SERVER_TEMPLATE = (
    # Names only: the tiny model's context is 256 tokens.
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def llama(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server reading Llama 3's calls and Qwen3's thoughts, with a template of its own."""
    directory = tmp_path_factory.mktemp("serve-llama3")
    (directory / "chat.jinja").write_text(SERVER_TEMPLATE)
    flags = (
        "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3",
        "--chat-template", str(directory / "chat.jinja"),
    )  # fmt: skip
    with serving(tiny_model_path, directory / "serve.log", *flags) as url:
        yield openai.OpenAI(api_key="unused", base_url=url, max_retries=0, timeout=120)


def test_auto_reads_llama3_json_calls(llama: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 100,
        "temperature": 1.0,
        "seed": 3,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "call", "schema": LLAMA3_CALL_SCHEMA},
        },
        # Qwen3's switch: no thought, so the whole reply is the answer.
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    response = llama.chat.completions.create(model="m", **request)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.content is None
    assert getattr(message, "reasoning", None) is None
    [call] = message.tool_calls or []
    assert call.function.name == "forecast"
    assert forecast_arguments_are_valid(call.function.arguments)
    content, calls, finish = streamed(llama, **request)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("forecast", call.function.arguments)
    ]


def test_a_reply_that_never_ends_its_thought_is_all_thought_unless_thinking_is_off(
    llama: openai.OpenAI,
) -> None:
    # The random model writes no </think>: under qwen3 the whole reply is its thought, the
    # same text it gives as its answer with thinking off (the tiny template ignores the
    # switch, so the prompt is the same).
    request: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0.0}
    off = llama.chat.completions.create(
        model="m", extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **request
    )
    text = off.choices[0].message.content
    assert text and getattr(off.choices[0].message, "reasoning", None) is None
    thinking = llama.chat.completions.create(model="m", **request)
    message = thinking.choices[0].message
    assert getattr(message, "reasoning", None) == text
    assert getattr(message, "reasoning_content", None) == text
    assert message.content == ""
    thought, content = "", ""
    for chunk in llama.chat.completions.create(model="m", stream=True, **request):
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    assert (thought, content) == (text, "")


def test_a_constrained_reply_is_not_split(llama: openai.OpenAI) -> None:
    # The constraint holds from the first token: no thought, whatever the text says.
    regex = r"<think>Hmm\.</think>Paris\."
    response = llama.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=40, extra_body={"guided_regex": regex}
    )
    message = response.choices[0].message
    assert message.content == "<think>Hmm.</think>Paris."
    assert getattr(message, "reasoning", None) is None


def test_the_servers_chat_template_renders_the_tools(
    llama: openai.OpenAI, tiny_model_path: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rendered = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, chat_template=SERVER_TEMPLATE, tokenize=False
    )
    assert rendered.startswith("<|im_start|>system\nTools: forecast now<|im_end|>")
    expected = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    response = llama.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert response.usage is not None and response.usage.prompt_tokens == expected


def test_a_conversation_with_a_call_and_its_result(client: openai.OpenAI) -> None:
    conversation: list[Any] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"unit": "c", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, then rain"},
    ]
    response = client.chat.completions.create(
        model="m", messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert response.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="m",
            messages=[
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "forecast", "arguments": "{not json"},
                        }
                    ],
                },
            ],
            max_tokens=8,
        )
    assert "arguments is not JSON" in str(refused.value)
