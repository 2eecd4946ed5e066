"""Tags in a streamed reply's text (``<think>``, ``<tool_call>``): what a stream holds back
because the next chunk may complete a tag (pure)."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """How many of ``text``'s last characters may be the start of ``tag`` (0: none)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
