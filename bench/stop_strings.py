"""What a request's stop strings cost its engine: ``StopText``'s build and its time per token.

    python bench/stop_strings.py [--tokens 2000]

Each stop-string set streams ``--tokens`` one-character tokens through ``StopText`` as
``Sequence.accept`` does (add, scan, release what may go). The worst case is the request
limits' (16 stop strings of 1,000 characters) with every beginning ending in the character the
text repeats, so that a matcher comparing the text's end with each beginning does the most
work; "one short" is the baseline every other set is compared with, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import string
import time

from dpserve.engine.sequences import StopText
from dpserve.engine.stop_matcher import automaton
from dpserve.tokenizer import ByteTokenizer, IncrementalDetokenizer

SETS = {
    "one short": ["\n\n"],
    "16 x 1,000, random": [
        "".join(string.ascii_lowercase[(i * 7 + j * j) % 26] for j in range(1000))
        for i in range(16)
    ],
    "16 x 1,000, worst": [chr(ord("c") + i) + "a" * 998 + "b" for i in range(16)],
}


def per_token_us(stops: list[str], tokens: int) -> float:
    text = StopText(IncrementalDetokenizer(ByteTokenizer()), stops)
    started = time.perf_counter()
    for _ in range(tokens):
        text.add(ord("a"))
        releasable, matched = text.scan()
        text.release(releasable, final=False)
        assert not matched
    return (time.perf_counter() - started) / tokens * 1e6


def build_ms(stops: list[str]) -> float:
    automaton.cache_clear()  # a set no request sent before: built, not shared
    started = time.perf_counter()
    StopText(IncrementalDetokenizer(ByteTokenizer()), stops)
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results = {
        name: (
            statistics.median(build_ms(stops) for _ in range(args.repeat)),
            statistics.median(per_token_us(stops, args.tokens) for _ in range(args.repeat)),
        )
        for name, stops in SETS.items()
    }
    baseline = results["one short"][1]
    print("| stop strings | build ms | µs a token | vs one short |")
    print("|---|---:|---:|---:|")
    for name, (build, token) in results.items():
        print(f"| {name} | {build:.1f} | {token:.1f} | {token / baseline:.1f}x |")


if __name__ == "__main__":
    main()
