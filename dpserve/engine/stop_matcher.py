"""Stop strings found in text that streams in a few characters at a time: an Aho-Corasick
automaton over one request's stop strings.

Its state after any text is the longest end of that text that begins a stop string, so each
character costs a few dictionary lookups on average (a failure link's walk back is paid for by
the characters that went down), however many and however long the stop strings are. The matcher
it replaced kept every proper beginning of every stop string and compared the text's end with
each of those ending in its last character, every token: with 16 stop strings of 1,000
characters (the request limits) that held ~9 MB a request and cost up to 2.6 ms a token of the
engine's step loop, which every request on the engine waits for: one request could slow all the
others (bench/stop_strings.py; BENCHMARKS.md).

``automaton(stops)`` is built once per distinct set of stop strings (clients send the same few)
and shared: it is immutable. A request's position in it is one int, kept by its ``StopText``.
"""

from __future__ import annotations

import functools
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Final

# Distinct sets of stop strings whose automata are kept: ~4 MB each at the request limits'
# worst (16 stop strings of 1,000 characters, all different), so at most ~60 MB.
_KEPT_AUTOMATA: Final = 16


class StopAutomaton:
    """The trie of the stop strings, with failure links. A state is a node: the longest end of
    the text so far that begins some stop string."""

    __slots__ = ("_alphabet", "_fail", "_goto", "_hold", "_longest_match", "longest")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty, and at least one given")
        self.longest = max(map(len, stops))
        # A character in no stop string leads every state back to the root, where no stop
        # string ends: text made only of such characters is decided by one set operation.
        self._alphabet = frozenset("".join(stops))
        # Edges as one dict keyed by (node, character): ``_key``.
        goto: dict[int, int] = {}
        depth = [0]
        ends = [0]  # the length of the stop string that is exactly this node's text (0: none)
        edges: list[list[tuple[str, int]]] = [[]]  # each node's children, for the walk below
        for stop in stops:
            node = 0
            for char in stop:
                key = node << 21 | ord(char)
                child = goto.get(key)
                if child is None:
                    child = goto[key] = len(depth)
                    edges[node].append((char, child))
                    edges.append([])
                    depth.append(depth[node] + 1)
                    ends.append(0)
                node = child
            ends[node] = len(stop)
        self._goto = goto
        count = len(depth)
        fails = self._fail = array("l", bytes(8 * count))
        # The longest stop string that ends this node's text (0: none).
        longest_match = self._longest_match = array("l", bytes(8 * count))
        # The longest end of this node's text that is a proper beginning of a stop string
        # (a node with children): what must be held back while it may still complete.
        hold = self._hold = array("l", bytes(8 * count))
        queue = deque([0])
        while queue:  # breadth first: a node's failure link is shallower, so settled before it
            node = queue.popleft()
            fail = fails[node]
            longest_match[node] = ends[node] or longest_match[fail]
            hold[node] = depth[node] if edges[node] else hold[fail]
            for char, child in edges[node]:
                fails[child] = 0 if node == 0 else self._next(fail, char)
                queue.append(child)

    def _next(self, state: int, char: str) -> int:
        goto, fail = self._goto, self._fail
        while True:
            child = goto.get(_key(state, char))
            if child is not None:
                return child
            if state == 0:
                return 0
            state = fail[state]

    def advance(self, state: int, text: str) -> tuple[int, int | None]:
        """Feed ``text`` from ``state``: the state after it, and where the earliest stop string
        that ends inside ``text`` starts, counted back from the text's end (``None``: none ends
        there). Runs for every token of every request with stop strings, in the step loop that
        all requests on the engine wait for: ``_next`` and ``_key`` are written out here, and
        a tuple is returned, which halved its cost (bench/engine_host.py)."""
        if self._alphabet.isdisjoint(text):  # most tokens, for the usual few short stops
            return (0 if text else state), None  # no text (a character's first bytes): as was
        goto = self._goto.get
        fail = self._fail
        longest_match = self._longest_match
        match_back: int | None = None
        remaining = len(text)
        for char in text:
            code = ord(char)
            while True:  # ``_next``
                child = goto(state << 21 | code)
                if child is not None:
                    state = child
                    break
                if state == 0:
                    break
                state = fail[state]
            remaining -= 1
            found = longest_match[state]
            if found:
                back = remaining + found  # its start, counted back from the text's end
                if match_back is None or back > match_back:
                    match_back = back
        return state, match_back

    def hold(self, state: int) -> int:
        """How many characters at the end of the text must be held back in ``state``: the
        longest that begin a stop string and may still complete it."""
        return self._hold[state]


def _key(node: int, char: str) -> int:
    return node << 21 | ord(char)  # a code point takes 21 bits


@functools.lru_cache(maxsize=_KEPT_AUTOMATA)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stops`` (shared: one per distinct tuple, kept while in use often)."""
    return StopAutomaton(stops)
