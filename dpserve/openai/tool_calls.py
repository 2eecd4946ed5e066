"""Tool calling, the reply side: a choice's generated text -> its text content and its calls
(pure, no I/O).

* A named function's reply is its arguments (the constraint made them the schema's JSON).
* ``required``'s reply is ``[{"name", "parameters"}, ...]``.
* ``auto``'s reply is in the model's own format, which ``--tool-call-parser`` names
  (``reply_formats``), read as vLLM's parser of the same name reads it:

  - ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3 and most ChatML templates with tools):
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, the text
    before the first being the content;
  - ``llama3_json`` (Llama 3.1-3.3 with JSON tool calling): the reply is the calls alone,
    ``{"name": ..., "parameters": {...}}``, several separated by ``;``; a reply that does not
    begin with ``{`` is text.

  A reply whose calls are not all JSON of that shape comes back whole as content, with no calls.

A reply cut short (``length``) may hold no complete call: then it is content, as it came.
A streamed choice (``CallStream``) sends its content as it comes, holding back only what may be
the start of a call, and each call whole when the choice ends.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
from typing import Any, Final, Protocol

from dpserve.openai.tags import partial_tag
from dpserve.openai.tools import ToolCalling, ToolChoice
from dpserve.reply_formats import HERMES, LLAMA3_JSON, TOOL_CALL_PARSERS


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
        return _format_of(calling).read(text)
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


# ---------------------------------------------------------------------- auto's formats


class Scan(enum.Enum):
    """What a streamed reply's text so far says (``CallFormat.scan``)."""

    UNDECIDED = "undecided"  # text; a call may still begin
    CALL = "call"  # a call begins at the cut: everything from there is held
    TEXT = "text"  # no call can come any more: everything is content


class CallFormat(Protocol):
    def read(self, text: str) -> Reply:
        """A whole reply as content and calls."""
        ...

    def scan(self, tail: str, at_start: bool) -> tuple[int, Scan]:
        """How much of ``tail`` (the text not sent yet; ``at_start``: nothing was sent) can be
        sent as content now, and what follows the cut."""
        ...


class _Hermes:
    OPEN: Final = "<tool_call>"
    CALL: Final = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def read(self, text: str) -> Reply:
        start = text.find(self.OPEN)
        if start < 0:
            return Reply(text)
        calls = []
        for match in self.CALL.finditer(text, start):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            call = _call_of_json(body, "arguments")
            if call is None:
                return Reply(text)
            calls.append(call)
        content = text[:start]
        return Reply(content if content.strip() else None, tuple(calls))

    def scan(self, tail: str, at_start: bool) -> tuple[int, Scan]:
        start = tail.find(self.OPEN)
        if start >= 0:
            return start, Scan.CALL
        # Hold back the last characters that may be the start of ``<tool_call>``.
        return len(tail) - partial_tag(tail, self.OPEN), Scan.UNDECIDED


class _Llama3Json:
    # Llama 3's ``<|python_tag|>`` is a special token: decoded text does not carry it.
    SEPARATOR: Final = re.compile(r"\s*;?\s*")

    def read(self, text: str) -> Reply:
        body = text.strip()
        if not body.startswith("{"):
            return Reply(text)
        decoder = json.JSONDecoder()
        calls = []
        position = 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except ValueError:
                return Reply(text)
            if not isinstance(value, dict) or not ("parameters" in value or "arguments" in value):
                return Reply(text)
            call = _call(value, "arguments" if "arguments" in value else "parameters")
            if call is None:
                return Reply(text)
            calls.append(call)
            separator = self.SEPARATOR.match(body, position)
            position = separator.end() if separator else position
        return Reply(None, tuple(calls))

    def scan(self, tail: str, at_start: bool) -> tuple[int, Scan]:
        if not at_start:  # decided at the reply's start
            return len(tail), Scan.TEXT
        begun = tail.lstrip()
        if not begun:
            return 0, Scan.UNDECIDED  # only whitespace yet: hold it
        return (0, Scan.CALL) if begun.startswith("{") else (len(tail), Scan.TEXT)


# Each --tool-call-parser's format.
_FORMATS: Final[dict[str, CallFormat]] = {HERMES: _Hermes(), LLAMA3_JSON: _Llama3Json()}
assert tuple(_FORMATS) == TOOL_CALL_PARSERS


def _format_of(calling: ToolCalling) -> CallFormat:
    assert calling.parser is not None  # tools.parse_tool_calling refuses auto without one
    return _FORMATS[calling.parser]


def _call_of_json(text: str, key: str) -> ToolCall | None:
    try:
        return _call(json.loads(text), key)
    except ValueError:
        return None


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
        self._format = _format_of(calling) if calling.choice == ToolChoice.AUTO else None
        self._sent: list[str] = []  # content sent so far
        self._sent_chars = 0
        # Received, not sent: a tail that may begin a call, or everything from a call's start
        # (a constrained reply is a call from its first character).
        self._held: list[str] = []
        self._state = Scan.CALL if calling.constrained else Scan.UNDECIDED

    def feed(self, text: str) -> str:
        if self._state is Scan.CALL:
            self._held.append(text)
            return ""
        if self._state is Scan.TEXT or self._format is None:
            out = text
        else:
            tail = "".join(self._held) + text  # what is held is a few characters
            cut, self._state = self._format.scan(tail, at_start=not self._sent_chars)
            out, self._held = tail[:cut], [tail[cut:]]
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
