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
