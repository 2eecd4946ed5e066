"""A reasoning model's thought told from its answer (``openai.reasoning``): whole replies as
vLLM's ``deepseek_r1`` and ``qwen3`` parsers split them, streamed replies split the same
wherever their chunks end, the shapes a client reads; and with tool calls read out of the
answer (``openai.replies``), streamed choices read as whole ones."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.openai.reasoning import Reasoning, ReasoningStream, Split, split_reply
from dpserve.openai.replies import StreamedReply, read_reply
from dpserve.openai.requests import parse_chat_request
from dpserve.openai.responses import ChatFormat, Choice, ResponseIds
from dpserve.openai.tools import ToolCalling, parse_tool_calling
from dpserve.reply_formats import DEEPSEEK_R1, HERMES, LLAMA3_JSON, QWEN3, ReplyParsers
from dpserve.tokenizer import ByteTokenizer

R1 = Reasoning(DEEPSEEK_R1)
QWEN = Reasoning(QWEN3)
QWEN_NOT_THINKING = Reasoning(QWEN3, thinking=False)


@pytest.mark.parametrize(
    ("reasoning", "text", "expected"),
    [
        (R1, "<think>Plan.</think>Answer.", Split("Plan.", "Answer.")),
        (R1, "Plan.</think>Answer.", Split("Plan.", "Answer.")),  # <think> in the prompt
        (R1, "\n<think>\nPlan.\n</think>\n\nAnswer.", Split("\nPlan.\n", "\n\nAnswer.")),
        (R1, "<think>Still thinking", Split("Still thinking", "")),  # cut short
        (R1, "<think></think>Answer.", Split(None, "Answer.")),
        (R1, "Plan.<tool_call>x</tool_call>", Split("Plan.<tool_call>x</tool_call>", "")),
        (QWEN, "Plan.<tool_call>x</tool_call>", Split("Plan.", "<tool_call>x</tool_call>")),
        (QWEN, "<think>Plan.</think>Answer.", Split("Plan.", "Answer.")),
        (
            QWEN_NOT_THINKING,
            "<think>Plan.</think>Answer.",
            Split(None, "<think>Plan.</think>Answer."),
        ),
    ],
)
def test_whole_replies(reasoning: Reasoning, text: str, expected: Split) -> None:
    assert split_reply(reasoning, text) == expected


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=400, deadline=None)
@given(
    reasoning=st.sampled_from([R1, QWEN, QWEN_NOT_THINKING]),
    text=st.sampled_from(
        [
            "<think>Plan: a < b.</think>Answer </thin and more.",
            "  <think>\nPlan.\n</think>\n\nAnswer.",
            "Plan without an opening tag.</think>Answer.",
            "<thi",
            "  ",
            "<think>cut short </th",
            "Plan.<tool_call>{}</tool_call>",
            "No tags at all.",
        ]
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=10),
)
def test_a_streamed_reply_splits_as_the_whole_one(
    reasoning: Reasoning, text: str, cuts: list[int]
) -> None:
    stream = ReasoningStream(reasoning)
    thought, answer = "", ""
    for chunk in split_at(text, cuts):
        piece, rest = stream.feed(chunk)
        thought, answer = thought + piece, answer + rest
    piece, rest = stream.finish()
    whole = split_reply(reasoning, text)
    assert (thought + piece, answer + rest) == (whole.reasoning or "", whole.content)


def test_a_requests_thinking_switch_reaches_qwen3s_split() -> None:
    parsers = ReplyParsers(reasoning=QWEN3)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(body, ByteTokenizer(), parsers=parsers).reasoning == QWEN
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert parse_chat_request(off, ByteTokenizer(), parsers=parsers).reasoning == QWEN_NOT_THINKING
    assert parse_chat_request(body, ByteTokenizer()).reasoning is None


def test_chat_shapes_of_a_thought() -> None:
    ids = ResponseIds("chatcmpl-1", 0, "m")
    response = ChatFormat().response(ids, [Choice(0, "Answer.", "stop", reasoning="Plan.")], {})
    assert response["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Answer.",
        "reasoning": "Plan.",
        "reasoning_content": "Plan.",
    }
    delta = ChatFormat().chunk(ids, Choice(0, "", None, reasoning="Pl"))["choices"][0]["delta"]
    assert delta == {"reasoning": "Pl", "reasoning_content": "Pl"}


# ------------------------------------------------- thought and calls together (openai.replies)


def calling_of(parser: str | None) -> ToolCalling | None:
    tools = [{"type": "function", "function": {"name": "now"}}]
    return None if parser is None else parse_tool_calling({"tools": tools}, parser)


REPLIES = [
    '<think>I could call <tool_call>{"name": "x"}</tool_call>.</think>Sure.'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    "<think>Plan.</think>" + '{"name": "now", "parameters": {}}',
    "Plan.</think>Just text.",
    "<think>cut short",
    '<tool_call>{"name": "now"}</tool_call>',
]


@settings(max_examples=400, deadline=None)
@given(
    reasoning=st.sampled_from([R1, QWEN, QWEN_NOT_THINKING, None]),
    parser=st.sampled_from([HERMES, LLAMA3_JSON, None]),
    text=st.sampled_from(REPLIES),
    cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=10),
)
def test_a_streamed_choice_reads_as_the_whole_one(
    reasoning: Reasoning | None, parser: str | None, text: str, cuts: list[int]
) -> None:
    calling = calling_of(parser)
    stream = StreamedReply(reasoning, calling)
    thought, content = "", ""
    for chunk in split_at(text, cuts):
        piece, rest = stream.feed(chunk)
        thought, content = thought + piece, content + rest
    last = stream.close("stop")
    whole = read_reply(reasoning, calling, text, "stop")
    assert thought + (last.reasoning or "") == (whole.reasoning or "")
    assert content + last.content == whole.content
    assert [(c.name, c.arguments) for c in last.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]
    assert last.finish_reason == whole.finish_reason


def test_a_thought_that_mentions_a_call_is_not_one() -> None:
    whole = read_reply(R1, calling_of(HERMES), REPLIES[0], "stop")
    assert whole.reasoning == 'I could call <tool_call>{"name": "x"}</tool_call>.'
    assert whole.content == "Sure."
    assert [c.name for c in whole.calls] == ["now"] and whole.finish_reason == "tool_calls"


def test_a_constrained_reply_has_no_thought() -> None:
    parsers = ReplyParsers(reasoning=DEEPSEEK_R1)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(body, ByteTokenizer(), parsers=parsers).reasoning == R1
    for constraint in (
        {"response_format": {"type": "json_object"}},
        {"guided_regex": "a+"},
        {"tools": [{"type": "function", "function": {"name": "now"}}], "tool_choice": "required"},
    ):
        request = parse_chat_request({**body, **constraint}, ByteTokenizer(), parsers=parsers)
        assert request.reasoning is None, constraint
