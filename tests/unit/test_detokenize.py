"""The incremental detokenizer the engines use for the text they send: its deltas, pushed a
few tokens at a time and resumed at any point, concatenate to the sequence's text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dpserve.engine.detokenize import RequestText
from dpserve.engine.fake import FakeRunner
from dpserve.tokenizer import (
    BatchTokenizer,
    ByteTokenizer,
    HuggingFaceTokenizer,
    IncrementalDetokenizer,
    push_batch,
    push_each,
)

TEXT = "héllo wörld: € 5, 🙂 done — naïve café\n\tend ☃☃ 日本語"


def stream_text(tokenizer: BatchTokenizer, tokens: list[int], resume_at: int, seed: int) -> str:
    """The text a client sees: what the first engine sent before ``resume_at`` (its held-back
    tail included in nothing), then a second engine's deltas resuming there."""
    rng = random.Random(seed)
    first = IncrementalDetokenizer(tokenizer)
    sent, position = [], 0
    while position < resume_at:
        step = min(rng.randint(1, 4), resume_at - position)
        sent.append(first.push(tokens[position : position + step]))
        position += step
    second = IncrementalDetokenizer(tokenizer, tokens[:resume_at])
    while position < len(tokens):
        step = rng.randint(1, 4)
        chunk = tokens[position : position + step]
        position += len(chunk)
        sent.append(second.push(chunk, final=position >= len(tokens)))
    return "".join(sent)


def test_byte_deltas_concatenate_to_the_text_at_every_resume_point() -> None:
    tokenizer = ByteTokenizer()
    tokens = list(TEXT.encode())
    for resume_at in range(len(tokens) + 1):
        assert stream_text(tokenizer, tokens, resume_at, seed=resume_at) == TEXT, resume_at


def test_half_a_character_is_held_back_until_it_is_complete() -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer())
    euro = list("€".encode())
    assert detokenizer.push([ord("a"), *euro[:2]]) == "a"
    assert detokenizer.push(euro[2:]) == "€"
    # A sequence that ends inside a character shows it replaced, as a full decode does.
    assert detokenizer.push(euro[:1], final=True) == "\ufffd"


def test_model_tokenizer_deltas_equal_its_full_decode(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = HuggingFaceTokenizer(AutoTokenizer.from_pretrained(tiny_model_path))
    [tokens] = tokenizer.encode_batch([TEXT * 3])
    [full] = tokenizer.decode_batch([tokens])
    for resume_at in range(0, len(tokens) + 1, 7):
        assert stream_text(tokenizer, tokens, resume_at, seed=resume_at) == full, resume_at


def test_batched_pushes_one_token_at_a_time_equal_each_full_decode(tiny_model_path: Path) -> None:
    # One decode_batch call a step for every sequence, windows that move up included (their
    # kept text is measured in that same call).
    from transformers import AutoTokenizer

    tokenizer = HuggingFaceTokenizer(AutoTokenizer.from_pretrained(tiny_model_path))
    texts = [TEXT[i:] + TEXT[:i] for i in range(0, len(TEXT), 5)]
    token_lists = tokenizer.encode_batch(texts)
    detokenizers = [IncrementalDetokenizer(tokenizer) for _ in token_lists]
    sent = [""] * len(token_lists)
    calls = 0
    decode_batch = tokenizer.decode_batch

    def counted(windows: list[list[int]]) -> list[str]:
        nonlocal calls
        calls += 1
        return decode_batch(windows)

    tokenizer.decode_batch = counted  # type: ignore[method-assign]
    longest = max(map(len, token_lists))
    for position in range(longest + 1):
        items = [
            (detokenizer, tokens[position : position + 1], position + 1 >= len(tokens))
            for detokenizer, tokens in zip(detokenizers, token_lists, strict=True)
            if position < len(tokens)
        ]
        for (detokenizer, _, _), delta in zip(items, push_batch(tokenizer, items), strict=True):
            sent[detokenizers.index(detokenizer)] += delta
    assert calls == longest
    assert sent == decode_batch(token_lists)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_push_each_gives_each_detokenizers_own_deltas(kind: str, tiny_model_path: Path) -> None:
    # A decode step's one-token-each pass: the same deltas, step after step, as pushing each
    # detokenizer alone (windows moving up, characters split over tokens, resumed ones).
    tokenizer: BatchTokenizer = ByteTokenizer()
    if kind == "bpe":
        from transformers import AutoTokenizer

        tokenizer = HuggingFaceTokenizer(AutoTokenizer.from_pretrained(tiny_model_path))
    token_lists = tokenizer.encode_batch([TEXT[i:] + TEXT[:i] for i in range(0, 40, 3)])
    resumed = [i % 3 for i in range(len(token_lists))]  # tokens generated elsewhere first
    starts = list(zip(token_lists, resumed, strict=True))
    batched = [IncrementalDetokenizer(tokenizer, t[:r]) for t, r in starts]
    alone = [IncrementalDetokenizer(tokenizer, t[:r]) for t, r in starts]
    steps = min(map(len, token_lists)) - max(resumed)
    decoded = 0
    decode_batch = tokenizer.decode_batch
    for step in range(steps):
        tokens = [t[r + step] for t, r in starts]
        expected = [d.push([token]) for d, token in zip(alone, tokens, strict=True)]

        def counted(windows: list[list[int]]) -> list[str]:
            nonlocal decoded
            decoded += len(windows)
            return decode_batch(windows)

        tokenizer.decode_batch = counted  # type: ignore[method-assign]
        assert push_each(tokenizer, batched, tokens) == expected, step
        tokenizer.decode_batch = decode_batch  # type: ignore[method-assign]
    assert steps > 20
    assert 0 < decoded < steps * len(batched)  # whole characters took the fast path
    # Tokens of whole characters after text that is all out add their own text: no decode.
    decoded = 0
    tokenizer.decode_batch = counted  # type: ignore[method-assign]
    [ascii_tokens] = tokenizer.encode_batch(["Plain words, 42 of them; and more.\n" * 3])
    fresh = IncrementalDetokenizer(tokenizer)
    pieces = [push_each(tokenizer, [fresh], [token])[0] for token in ascii_tokens]
    assert "".join(pieces) == "Plain words, 42 of them; and more.\n" * 3
    assert decoded == 0


def test_token_texts_only_where_a_text_is_its_tokens_texts(tiny_model_path: Path) -> None:
    from tokenizers import decoders
    from transformers import AutoTokenizer

    tokenizer = HuggingFaceTokenizer(AutoTokenizer.from_pretrained(tiny_model_path))
    texts = tokenizer.token_texts()
    assert texts is not None and len(texts) == tokenizer.vocab_size
    [tokens] = tokenizer.encode_batch(["plain ascii words, and more"])
    assert "".join(str(texts[t]) for t in tokens) == "plain ascii words, and more"
    assert any(text is None for text in texts)  # bytes of a multi-byte character
    other = HuggingFaceTokenizer(AutoTokenizer.from_pretrained(tiny_model_path))
    assert other._rust_decoder is not None
    other._rust_decoder.decoder = decoders.Metaspace()  # its text is no concatenation
    assert other.token_texts() is None


def test_an_engine_reads_the_fake_runners_tokens_as_bytes() -> None:
    text = RequestText(FakeRunner())
    assert isinstance(text.tokenizer, ByteTokenizer)
    assert text.start([104, 105]).push([33], final=True) == "!"


@pytest.mark.parametrize("final", [False, True])
def test_nothing_new_gives_no_text(final: bool) -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), list(b"abc"))
    assert detokenizer.push([], final=final) == ""
