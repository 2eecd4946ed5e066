"""Log-probs as OpenAI returns them: one entry per generated token whose strings concatenate
to the returned text, multi-byte characters split across tokens included."""

from __future__ import annotations

from collections.abc import Sequence

from dpserve.tokenizer import BatchTokenizer

_REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with


def token_pieces(tokenizer: BatchTokenizer, tokens: Sequence[int], text: str) -> list[str]:
    """The part of ``text`` each token added. A token that ends inside a character adds "";
    the token that completes it carries the whole character. Decoding works on a short window
    (as incremental detokenizers do), so the cost is linear in the number of tokens; the pieces
    are then cut from ``text`` itself, so they always concatenate to it exactly (a stop string
    cut inside a token shortens the last piece)."""
    lengths = _piece_lengths(tokenizer, tokens)
    pieces, position = [], 0
    for index, length in enumerate(lengths):
        end = len(text) if index == len(lengths) - 1 else min(len(text), position + length)
        pieces.append(text[position:end])
        position = end
    return pieces


def _piece_lengths(tokenizer: BatchTokenizer, tokens: Sequence[int]) -> list[int]:
    lengths = []
    prefix_start = read_start = 0  # window: tokens[prefix_start:read_start] already emitted
    for index in range(len(tokens)):
        before, after = tokenizer.decode_batch(
            [list(tokens[prefix_start:read_start]), list(tokens[prefix_start : index + 1])]
        )
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            lengths.append(len(after) - len(before))
            prefix_start, read_start = read_start, index + 1
        else:
            lengths.append(0)
    return lengths


def token_logprob_pairs(
    token_texts: list[str], logprobs: list[float]
) -> list[tuple[str, float | None]]:
    """Pair every token with its log-prob. Tokens generated before a request moved to another
    engine may have none; they come first, so the log-probs align with the end."""
    count = len(token_texts)
    aligned: list[float | None] = list(logprobs[max(0, len(logprobs) - count) :] if count else [])
    return list(zip(token_texts, [None] * (count - len(aligned)) + aligned, strict=True))
