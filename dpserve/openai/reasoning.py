"""A reasoning model's thought, apart from its answer (``--reasoning-parser``; pure, no I/O).

A thinking model writes ``<think>`` (or its template already did, in the prompt), its thought,
``</think>``, then its answer. As vLLM's parsers of the same names read it:

* ``deepseek_r1``: everything up to ``</think>`` is the thought (a leading ``<think>`` is
  dropped); a reply without ``</think>`` is all thought (cut short while thinking);
* ``qwen3``: the same, a ``<tool_call>`` also ending the thought (it stays in the answer, for
  the tool-call parser); with ``chat_template_kwargs.enable_thinking`` false the template made
  no thought, and the whole reply is the answer.

The thought comes back as ``message.reasoning`` (vLLM's name) and ``reasoning_content`` (its
earlier name, and DeepSeek's API's, which LangChain and Open WebUI read); tool calls are read
out of the answer only. ``ReasoningStream`` splits a streamed reply as it comes, holding back
only what may be the start of a tag.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from dpserve.openai.tags import partial_tag
from dpserve.reply_formats import DEEPSEEK_R1, QWEN3, REASONING_PARSERS

_OPEN: Final = "<think>"
_CLOSE: Final = "</think>"
_TOOL_CALL: Final = "<tool_call>"
assert set(REASONING_PARSERS) == {DEEPSEEK_R1, QWEN3}


@dataclasses.dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's replies are split (its server's parser, its thinking switch)."""

    parser: str
    thinking: bool = True  # chat_template_kwargs.enable_thinking (qwen3 reads it)

    @property
    def splits(self) -> bool:
        return self.thinking or self.parser != QWEN3

    @property
    def ends(self) -> tuple[tuple[str, bool], ...]:
        """What ends a thought, and whether the marker itself belongs to the answer."""
        if self.parser == QWEN3:
            return ((_CLOSE, False), (_TOOL_CALL, True))
        return ((_CLOSE, False),)


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    reasoning: str | None  # None: no thought (or an empty one)
    content: str


def split_reply(reasoning: Reasoning, text: str) -> Split:
    """A whole reply's thought and answer."""
    if not reasoning.splits:
        return Split(None, text)
    body = _without_opening(text)
    end = _first_end(reasoning, body)
    if end is None:
        return Split(body or None, "")
    at, marker, kept = end
    answer_from = at if kept else at + len(marker)
    return Split(body[:at] or None, body[answer_from:])


def _without_opening(text: str) -> str:
    stripped = text.lstrip()
    return stripped[len(_OPEN) :] if stripped.startswith(_OPEN) else text


def _first_end(reasoning: Reasoning, text: str) -> tuple[int, str, bool] | None:
    found = [(text.find(marker), marker, kept) for marker, kept in reasoning.ends]
    found = [entry for entry in found if entry[0] >= 0]
    return min(found) if found else None


class ReasoningStream:
    """One streamed choice's text as thought and answer deltas: ``feed`` returns what can be
    sent now, ``finish`` the rest. Each chunk is looked at once with the few characters held
    back before it."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.reasoning = reasoning
        self._thinking = reasoning.splits
        self._opened = False  # a leading <think> was dropped, or the reply began otherwise
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(thought, answer) to send now."""
        if not self._thinking:
            return "", text
        text = self._held + text
        self._held = ""
        if not self._opened:
            begun = text.lstrip()
            if len(begun) < len(_OPEN) and _OPEN.startswith(begun):
                self._held = text  # whitespace, or the start of <think>: not yet decided
                return "", ""
            self._opened = True
            text = _without_opening(text)
        end = _first_end(self.reasoning, text)
        if end is not None:
            at, marker, kept = end
            self._thinking = False
            return text[:at], text[at if kept else at + len(marker) :]
        keep = max(partial_tag(text, marker) for marker, _ in self.reasoning.ends)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back: a reply that ended while thinking ends its thought."""
        held, self._held = self._held, ""
        if not self._thinking:
            return "", held
        if not self._opened:
            held = _without_opening(held)
        return held, ""
