"""A chat choice's generated text as the client gets it: its thought (``reasoning``), its
content and its tool calls (``tool_calls``), whole or as it streams (pure, no I/O).

The thought is taken off first; the answer after it is what is read for calls, so a thought
that mentions a call is not one. ``StreamedReply`` gives, chunk by chunk, what can be sent
now, and at the end what was held back with the calls; it ends with what ``read_reply`` reads
out of the whole text.
"""

from __future__ import annotations

import dataclasses

from dpserve.openai.reasoning import Reasoning, ReasoningStream, split_reply
from dpserve.openai.tool_calls import (
    CallStream,
    ToolCall,
    parse_reply,
    reply_finish_reason,
)
from dpserve.openai.tools import ToolCalling


@dataclasses.dataclass(frozen=True, slots=True)
class ReadReply:
    reasoning: str | None
    content: str
    calls: tuple[ToolCall, ...]
    finish_reason: str


def read_reply(
    reasoning: Reasoning | None, calling: ToolCalling | None, text: str, finish_reason: str
) -> ReadReply:
    """A whole choice's thought, content and calls, and its finish reason (``tool_calls``
    when the model chose to call)."""
    thought = None
    if reasoning is not None:
        split = split_reply(reasoning, text)
        thought, text = split.reasoning, split.content
    if calling is None or not calling.parses_calls:
        return ReadReply(thought, text, (), finish_reason)
    reply = parse_reply(calling, text)
    reason = reply_finish_reason(calling, reply, finish_reason)
    return ReadReply(thought, reply.content or "", reply.calls, reason)


class StreamedReply:
    """One streamed choice's text, read as it comes."""

    def __init__(self, reasoning: Reasoning | None, calling: ToolCalling | None) -> None:
        self._thought = ReasoningStream(reasoning) if reasoning is not None else None
        self._calls = CallStream(calling) if calling is not None and calling.parses_calls else None

    def feed(self, text: str) -> tuple[str, str]:
        """The (thought, content) a chunk's text lets through now."""
        thought = ""
        if self._thought is not None:
            thought, text = self._thought.feed(text)
        if self._calls is not None:
            text = self._calls.feed(text)
        return thought, text

    def close(self, finish_reason: str) -> ReadReply:
        """What was held back (thought, content), the calls, and the finish reason."""
        thought, text = "", ""
        if self._thought is not None:
            thought, text = self._thought.finish()
        if self._calls is None:
            return ReadReply(thought or None, text, (), finish_reason)
        text = self._calls.feed(text)
        reply = self._calls.finish()
        reason = reply_finish_reason(self._calls.calling, reply, finish_reason)
        return ReadReply(thought or None, text + (reply.content or ""), reply.calls, reason)
