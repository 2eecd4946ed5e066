"""A reasoning model's thought told from its answer (``openai.reasoning``): whole replies as
vLLM's ``deepseek_r1`` and ``qwen3`` parsers split them, streamed replies split the same
wherever their chunks end, and the shapes a client reads."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.openai.reasoning import Reasoning, ReasoningStream, Split, split_reply
from dpserve.openai.requests import parse_chat_request
from dpserve.openai.responses import ChatFormat, Choice, ResponseIds
from dpserve.reply_formats import DEEPSEEK_R1, QWEN3, ReplyParsers
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
