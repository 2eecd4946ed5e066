"""Tool calling, the reply side: a choice's generated text -> its text content and its calls
(pure, no I/O).

* A named function's reply is its arguments (the constraint made them the schema's JSON).
* ``required``'s reply is ``[{"name", "parameters"}, ...]``.
* ``auto``'s reply is in the model's own format, which ``--tool-call-parser`` names. ``hermes``
  (Hermes 2/3, Qwen2.5 and Qwen3 and most chat templates that render tools in ChatML):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, text around
  them being the content. As vLLM's parser of that name, a reply whose calls are not all JSON of
  that shape is returned whole as content, with no calls.

A reply cut short (``length``) may hold no complete call: then it is content, as it came.
A streamed choice (``CallStream``) sends its content as it comes, holding back only what may be
the start of a call, and each call whole when the choice ends.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Final

from dpserve.openai.tools import ToolCalling, ToolChoice
from dpserve.tool_call_formats import HERMES, TOOL_CALL_PARSERS

_HERMES_OPEN: Final = "<tool_call>"
_HERMES_CALL: Final = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    content: str | None  # None: the reply is only calls
    calls: tuple[ToolCall, ...] = ()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_reply(calling: ToolCalling, text: str) -> Reply:
    """A whole choice's text as content and calls."""
    if calling.choice == ToolChoice.NAMED:
        assert calling.named is not None
        if not _is_json(text):  # cut short: not a call
            return Reply(text)
        return Reply(None, (ToolCall(call_id(), calling.named, text.strip()),))
    if calling.choice == ToolChoice.REQUIRED:
        return _required(text)
    if calling.choice == ToolChoice.AUTO:
        assert calling.parser is not None  # tools.parse_tool_calling refuses auto without one
        return _READERS[calling.parser](text)
    return Reply(text)


def reply_finish_reason(calling: ToolCalling | None, reply: Reply, finish: str) -> str:
    """OpenAI's: ``tool_calls`` when the model chose to call (auto, required); a forced named
    call ends with ``stop``."""
    if calling is None or not reply.calls or finish != "stop":
        return finish
    return finish if calling.choice == ToolChoice.NAMED else "tool_calls"


def _required(text: str) -> Reply:
    try:
        calls = json.loads(text)
    except ValueError:
        return Reply(text)
    parsed = [_call(call, "parameters") for call in calls] if isinstance(calls, list) else []
    if not parsed or None in parsed:
        return Reply(text)
    return Reply(None, tuple(call for call in parsed if call is not None))


def _hermes(text: str) -> Reply:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return Reply(text)
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        try:
            call = _call(json.loads(body), "arguments")
        except ValueError:
            return Reply(text)
        if call is None:
            return Reply(text)
        calls.append(call)
    content = text[:start]
    return Reply(content if content.strip() else None, tuple(calls))


# Each --tool-call-parser's reader of a whole reply.
_READERS: Final = {HERMES: _hermes}
assert tuple(_READERS) == TOOL_CALL_PARSERS


def _call(value: object, key: str) -> ToolCall | None:
    """``{"name": ..., key: {...}}`` as a call (a function without parameters may leave its
    arguments out), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call_id(), value["name"], _compact(arguments))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


class CallStream:
    """One streamed choice's text, split as it comes: ``feed`` returns the content that can
    be sent now; ``finish`` the rest of the content and the calls. Each chunk is looked at
    once with the few characters held back before it (a long reply costs its length, not
    its length squared); the whole text is put together once, at the end."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._sent: list[str] = []  # content sent so far
        self._sent_chars = 0
        # Received, not sent: a tail that may begin a call, or everything from a call's start
        # (a constrained reply is a call from its first character).
        self._held: list[str] = []
        self._in_call = calling.constrained

    def feed(self, text: str) -> str:
        if self._in_call:
            self._held.append(text)
            return ""
        tail = "".join(self._held) + text  # the held part is shorter than ``<tool_call>``
        start = tail.find(_HERMES_OPEN)
        if start >= 0:
            self._in_call = True
            out, self._held = tail[:start], [tail[start:]]
        else:
            keep = _opening_kept(tail)
            out, self._held = tail[: len(tail) - keep], [tail[len(tail) - keep :]]
        self._sent.append(out)
        self._sent_chars += len(out)
        return out

    def finish(self) -> Reply:
        """The content not yet sent and the calls."""
        rest = "".join(self._held)
        reply = parse_reply(self.calling, "".join(self._sent) + rest)
        if not reply.calls:
            return Reply(rest)
        if reply.content is None or len(reply.content) <= self._sent_chars:
            return Reply(None, reply.calls)
        return Reply(reply.content[self._sent_chars :], reply.calls)


def _opening_kept(text: str) -> int:
    """How many of the last characters may be the start of ``<tool_call>`` (held back)."""
    for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
        if _HERMES_OPEN.startswith(text[-keep:]):
            return keep
    return 0
