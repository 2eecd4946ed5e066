"""Stop strings found in a request's text one token at a time (``StopText``): text that was
released is never taken back, and the released text ends where the first stop string starts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.engine.sequences import StopText
from dpserve.tokenizer import ByteTokenizer, IncrementalDetokenizer


def expected_text(text: str, stops: list[str]) -> str:
    """Token-by-token reference: the first stop string to complete ends the text where it
    starts (the longest, when several complete at the same character)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(stop) for stop in stops if text[:end].endswith(stop)]
        if starts:
            return text[: min(starts)]
    return text


@settings(max_examples=500, deadline=None)
@given(
    text=st.text("abc", max_size=40),
    stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_released_text_is_never_taken_back_and_ends_before_the_stop(
    text: str, stops: list[str]
) -> None:
    stop_text = StopText(IncrementalDetokenizer(ByteTokenizer()), stops)
    released, unreleased = "", 0
    for token in text.encode():
        stop_text.add(token)
        unreleased += 1
        releasable, matched = stop_text.scan()
        # Everything that may go goes at once: an engine that streams every step.
        released += stop_text.release(releasable, final=False)
        unreleased -= releasable
        if matched:
            break
    else:
        released += stop_text.release(unreleased, final=True)
    assert released == expected_text(text, stops)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("abc\n", max_size=30),
    stops=st.lists(st.text("abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_scan_holds_back_exactly_the_longest_stop_beginning(text: str, stops: list[str]) -> None:
    # What may go after each token, against a brute-force reading of the whole text: all of
    # it but its longest tail that begins a stop string (none is held more, or less).
    stop_text = StopText(IncrementalDetokenizer(ByteTokenizer()), stops)
    for end, token in enumerate(text.encode(), start=1):
        stop_text.add(token)
        releasable, matched = stop_text.scan()
        if matched:
            assert expected_text(text[:end], stops) != text[:end]
            return
        held = max(
            (n for stop in stops for n in range(1, len(stop)) if text[:end].endswith(stop[:n])),
            default=0,
        )
        assert releasable == end - held


def brute_force_scan(
    text: str, newest_from: int, token_ends: list[int], stops: list[str], scanning: bool
) -> tuple[int, bool]:
    """What ``StopText`` answers after a token, read off the whole text: with ``scanning``, the
    earliest start of a stop string that ends in the newest token's text (from
    ``newest_from``) ends the request there; otherwise (or with none) every token may go but
    a tail that is a proper beginning of a stop string. As token counts, by the tokens'
    ``token_ends`` in ``text``."""
    if scanning:
        starts = [
            start
            for stop in stops
            for start in range(len(text) - len(stop) + 1)
            if text.startswith(stop, start) and start + len(stop) > newest_from
        ]
        if starts:
            return sum(end <= min(starts) for end in token_ends), True
    held = max(
        (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )
    return sum(end <= len(text) - held for end in token_ends), False


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(st.text("ab\u00e9\u65e5", max_size=4), max_size=14),
    stops=st.lists(st.text("ab\u00e9\u65e5", min_size=1, max_size=5), min_size=1, max_size=4),
    min_tokens=st.integers(0, 6),
)
def test_tokens_of_several_characters_match_a_brute_force_reading(
    chunks: list[str], stops: list[str], min_tokens: int
) -> None:
    """Tokens whose text is several characters (or none: bytes of an unfinished character),
    non-ASCII stop strings, and ``min_tokens`` (before it only ``releasable`` is asked, as
    ``Sequence.accept`` does): after every token, what may go and whether a stop string ends
    the request equal the brute-force answer over the whole text."""
    stop_text = StopText(IncrementalDetokenizer(ByteTokenizer()), stops)
    text, released_chars, released_tokens = "", 0, 0
    ends: list[int] = []
    for count, chunk in enumerate(chunks, start=1):
        stop_text._next_delta = chunk  # as ``decode_new_tokens`` decodes it ahead
        assert stop_text.add(0) == chunk
        newest_from, text = len(text), text + chunk
        ends.append(len(text))
        scanning = count > min_tokens
        answer = stop_text.scan() if scanning else (stop_text.releasable(), False)
        expected, matched = brute_force_scan(text, newest_from, ends, stops, scanning)
        assert (released_tokens + answer[0], answer[1]) == (expected, matched)
        released = stop_text.release(answer[0], final=False)
        assert released == text[released_chars : ends[expected - 1] if expected else 0]
        released_chars += len(released)
        released_tokens += answer[0]
        if matched:
            return


def test_a_stop_string_may_begin_in_the_resumed_text() -> None:
    """A request resumed after "xxab" (returned by the engine that died) with stop "abc":
    its first new token "c" completes it, and nothing of its own is returned."""
    tokenizer = ByteTokenizer()
    stop_text = StopText.start(tokenizer, list(b"xxab"), ["abc", "zz"])
    stop_text.add(ord("c"))
    assert stop_text.scan() == (0, True)


def test_the_limits_worst_stop_strings_hold_back_nothing_the_text_cannot_complete() -> None:
    """16 stop strings of 1,000 characters (the request limits) whose beginnings all end in
    the character the text repeats, but none of which starts with it: every token may go at
    once, and the automaton stays at its root (its cost: bench/stop_strings.py)."""
    stops = [chr(ord("c") + i) + "a" * 998 + "b" for i in range(16)]
    stop_text = StopText(IncrementalDetokenizer(ByteTokenizer()), stops)
    for _ in range(3000):
        stop_text.add(ord("a"))
        assert stop_text.scan() == (1, False)  # "a"s begin no stop string here: all may go
        stop_text.release(1, final=False)
    assert stop_text._state == 0
