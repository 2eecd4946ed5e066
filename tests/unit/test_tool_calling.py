"""Tool calling at the HTTP front: the request side (``openai.tools``: tools, tool_choice,
the schema a forced choice constrains the reply to, messages that carry calls and results)
and the reply side (``openai.tool_calls``: calls read out of a whole reply, and out of a
streamed one as it comes)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.limits import DEFAULT_REQUEST_LIMITS
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.guided import check_constraint
from dpserve.openai.requests import parse_chat_request
from dpserve.openai.responses import ChatFormat, Choice, ResponseIds
from dpserve.openai.tool_calls import (
    CallStream,
    Reply,
    ToolCall,
    parse_reply,
    reply_finish_reason,
)
from dpserve.openai.tools import ToolChoice, parse_tool_calling
from dpserve.reply_formats import HERMES, LLAMA3_JSON, TOOL_CALL_PARSERS
from dpserve.tokenizer import ByteTokenizer, HuggingFaceTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]

# A template that shows the tools and renders calls and results, as Qwen's and Hermes' do.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    '{% for call in m.tool_calls or [] %}<tool_call>{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def calling(body: dict[str, Any], parser: str | None = HERMES) -> Any:
    return parse_tool_calling({"tools": [WEATHER, CLOCK], **body}, parser)


# ------------------------------------------------------------------------- request side


def test_no_tools_is_no_tool_calling_and_only_none_is_a_choice_then() -> None:
    assert parse_tool_calling({}, None) is None
    assert parse_tool_calling({"tools": [], "tool_choice": "none"}, None) is None
    with pytest.raises(InvalidRequest, match="needs tools") as caught:
        parse_tool_calling({"tool_choice": "required"}, None)
    assert caught.value.param == "tool_choice"


def test_auto_is_the_default_and_needs_a_parser_which_the_error_names() -> None:
    assert calling({}).choice == ToolChoice.AUTO
    assert calling({}).parser == HERMES
    with pytest.raises(InvalidRequest, match="--tool-call-parser") as caught:
        calling({}, parser=None)
    assert caught.value.param == "tool_choice"
    # The choices that need no parser work without one.
    for choice in ("none", "required", {"type": "function", "function": {"name": "now"}}):
        assert calling({"tool_choice": choice}, parser=None).choice != ToolChoice.AUTO


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [CLOCK, CLOCK]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
            "tools[0]",
        ),
        ({"tools": [CLOCK], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [CLOCK], "tool_choice": "required", "guided_regex": "a+"},
            "tool_choice",
        ),
        ({"tools": [CLOCK], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_tool_calling(body, HERMES)
    assert caught.value.param == param


def test_a_named_choice_constrains_the_reply_to_that_functions_arguments() -> None:
    named = calling({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    schema = json.loads(named.constraint())
    assert schema == WEATHER["function"]["parameters"]  # type: ignore[index]
    no_parameters = calling({"tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert json.loads(no_parameters.constraint()) == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_the_reply_to_a_list_of_calls_of_the_tools(parallel: bool) -> None:
    required = calling({"tool_choice": "required", "parallel_tool_calls": parallel})
    schema = json.loads(required.constraint())
    jsonschema_rs.meta.validate(schema)
    validator = jsonschema_rs.validator_for(schema)
    one = {"name": "get_weather", "parameters": {"city": "Paris"}}
    two = [one, {"name": "now", "parameters": {}}]
    assert validator.is_valid([one])
    assert validator.is_valid(two) == parallel
    assert not validator.is_valid([])  # at least one call
    assert not validator.is_valid([{"name": "rm", "parameters": {}}])  # only the tools
    assert not validator.is_valid([{**one, "extra": 1}])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"city": 1}}])


def test_none_and_auto_leave_the_reply_free() -> None:
    assert calling({"tool_choice": "none"}).constraint() is None
    assert calling({"tool_choice": "auto"}).constraint() is None
    assert not calling({"tool_choice": "none"}).parses_calls


async def test_a_tools_invalid_schema_is_refused_by_the_constraint_check() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}
    body = {"messages": MESSAGES, "tools": [bad], "tool_choice": "required"}
    request = parse_chat_request(body, ByteTokenizer())
    with pytest.raises(InvalidRequest, match="tools is not a valid JSON Schema") as caught:
        await check_constraint(request.params, request.schema_param, DEFAULT_REQUEST_LIMITS)
    assert caught.value.param == "tools"


def test_a_forced_choices_schema_counts_against_max_constraint_bytes() -> None:
    import dataclasses

    limits = dataclasses.replace(DEFAULT_REQUEST_LIMITS, max_constraint_bytes=64)
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}
    with pytest.raises(InvalidRequest, match="max_constraint_bytes") as caught:
        parse_chat_request(body, ByteTokenizer(), limits)
    assert caught.value.param == "tools"


def test_tools_count_against_max_prompt_chars_before_the_template_renders_them() -> None:
    import dataclasses

    limits = dataclasses.replace(DEFAULT_REQUEST_LIMITS, max_prompt_chars=1000)
    many = [
        {"type": "function", "function": {"name": f"f{i}", "description": "x" * 50}}
        for i in range(20)
    ]
    body = {"messages": MESSAGES, "tools": many, "tool_choice": "none"}
    with pytest.raises(InvalidRequest, match="messages' text and tools") as caught:
        parse_chat_request(body, ByteTokenizer(), limits)
    assert caught.value.code == "max_prompt_chars"
    assert parse_chat_request({**body, "tools": many[:5]}, ByteTokenizer(), limits).prompt


def test_messages_carry_calls_and_results_to_the_template() -> None:
    tokenizer = tiny_tokenizer_with(TOOL_TEMPLATE)
    arguments = '{"city": "Paris"}'
    body = {
        "messages": [
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        "tools": [WEATHER],
        "tool_choice": "none",
    }
    request = parse_chat_request(body, tokenizer)
    assert isinstance(request.prompt, str)
    assert 'Tools: [{"type": "function", "function": {"name": "get_weather"' in request.prompt
    # The call's arguments reach the template as an object (it writes them as JSON).
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in request.prompt
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in request.prompt
    assert request.params.guided_json is None and request.tool_calling is not None


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {"role": "user", "content": "x", "tool_calls": [{"function": {}}]},
            "messages[0].tool_calls",
        ),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
            "messages[0].tool_calls[0]",
        ),
        ({"role": "tool", "content": "r", "tool_call_id": 7}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "audio": {}}, "messages[0].audio"),
    ],
)
def test_bad_messages_are_a_400_naming_the_field(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request({"messages": [message]}, ByteTokenizer())
    assert caught.value.param == param


def tiny_tokenizer_with(template: str) -> HuggingFaceTokenizer:
    from tests.tiny_model import _train_tokenizer

    tokenizer = _train_tokenizer()
    tokenizer.chat_template = template
    return HuggingFaceTokenizer(tokenizer)


# --------------------------------------------------------------------------- reply side

HERMES_REPLY = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "now"}\n</tool_call>'
)


def test_hermes_calls_and_the_text_before_them() -> None:
    reply = parse_reply(calling({}), HERMES_REPLY)
    assert reply.content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("now", {}),
    ]
    assert len({c.id for c in reply.calls}) == 2 and reply.calls[0].id.startswith("call_")
    assert reply_finish_reason(calling({}), reply, "stop") == "tool_calls"
    assert reply_finish_reason(calling({}), reply, "length") == "length"


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny today.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
    ],
)
def test_a_reply_that_is_not_all_calls_is_content_as_it_came(text: str) -> None:
    reply = parse_reply(calling({}), text)
    assert reply.content == text and reply.calls == ()
    assert reply_finish_reason(calling({}), reply, "stop") == "stop"


def test_an_unterminated_last_call_is_still_a_call() -> None:
    reply = parse_reply(calling({}), '<tool_call>{"name": "now", "arguments": {}}')
    assert reply.content is None and [c.name for c in reply.calls] == ["now"]


def test_forced_replies() -> None:
    named = calling({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    reply = parse_reply(named, '{"city":"Paris"}')
    assert reply.content is None
    assert [(c.name, c.arguments) for c in reply.calls] == [("get_weather", '{"city":"Paris"}')]
    assert reply_finish_reason(named, reply, "stop") == "stop"  # OpenAI's for a forced function
    assert parse_reply(named, '{"city":"Pa').calls == ()  # cut short
    required = calling({"tool_choice": "required"})
    reply = parse_reply(required, '[{"name":"now","parameters":{}}]')
    assert [c.name for c in reply.calls] == ["now"]
    assert reply_finish_reason(required, reply, "stop") == "tool_calls"
    none = calling({"tool_choice": "none"})
    assert parse_reply(none, HERMES_REPLY).calls == ()


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


LLAMA3_REPLY = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}'
)
STREAMED_REPLIES = {
    HERMES: [
        HERMES_REPLY,
        "No call: a < b and <tool is not a tag.",
        "<tool_call>broken</tool_call> after",
        '<tool_call>{"name": "now"}</tool_call>',
        "ends with <tool_ca",
    ],
    LLAMA3_JSON: [
        LLAMA3_REPLY,
        '  \n {"name": "now", "arguments": {}}',
        "Sure: {not a call}",
        '{"name": "now", "parameters": {}} and then text',
        "   ",
    ],
}


@settings(max_examples=300, deadline=None)
@given(
    case=st.sampled_from([(f, text) for f, texts in STREAMED_REPLIES.items() for text in texts]),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_a_streamed_reply_splits_as_the_whole_one_wherever_its_chunks_end(
    case: tuple[str, str], cuts: list[int]
) -> None:
    parser, text = case
    auto = calling({}, parser)
    stream = CallStream(auto)
    sent = "".join(stream.feed(chunk) for chunk in split_at(text, cuts))
    last = stream.finish()
    whole = parse_reply(auto, text)
    assert sent + (last.content or "") == (whole.content or "")
    assert [(c.name, c.arguments) for c in last.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]
    if whole.calls:  # nothing of a call was sent as content
        assert "<tool_call>" not in sent and "{" not in sent


def test_llama3_json_calls_are_the_whole_reply() -> None:
    llama = calling({}, LLAMA3_JSON)
    reply = parse_reply(llama, LLAMA3_REPLY)
    assert reply.content is None
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert reply_finish_reason(llama, reply, "stop") == "tool_calls"
    # vLLM's parser also takes "arguments"; leading whitespace is allowed.
    spaced = parse_reply(llama, ' \n{"name": "now", "arguments": {"tz": "UTC"}}')
    assert [(c.name, json.loads(c.arguments)) for c in spaced.calls] == [("now", {"tz": "UTC"})]
    for text in (
        "The weather is fine.",
        '{"name": "now"}',  # neither parameters nor arguments
        '{"name": "now", "parameters": {}} trailing words',
        '{"name": "now", "parameters": {',  # cut short
        '{"name": "now", "parameters": []}',
    ):
        assert parse_reply(llama, text) == Reply(text), text


def test_a_forced_streamed_reply_sends_no_content_before_its_call() -> None:
    named = calling({"tool_choice": {"type": "function", "function": {"name": "now"}}})
    stream = CallStream(named)
    assert stream.feed("{") == "" and stream.feed("}") == ""
    assert [c.name for c in stream.finish().calls] == ["now"]


def test_chat_shapes_of_calls() -> None:
    ids = ResponseIds("chatcmpl-1", 0, "m")
    call = ToolCall("call_1", "now", "{}")
    response = ChatFormat().response(ids, [Choice(0, "", "tool_calls", tool_calls=(call,))], {})
    message = response["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        ],
    }
    chunk = ChatFormat().chunk(ids, Choice(0, "", None, tool_calls=(call,)))
    delta = chunk["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
    plain = ChatFormat().response(ids, [Choice(0, "hi", "stop")], {})
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_the_crd_offers_the_parsers_the_server_has() -> None:
    from dpserve_operator.crd import spec_field

    assert tuple(spec_field("coordinator.toolCallParser")["enum"]) == TOOL_CALL_PARSERS
