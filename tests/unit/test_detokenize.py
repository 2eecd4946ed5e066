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
    as_batch_tokenizer,
    push_batch,
    push_each,
    released_texts,
)

TEXT = "héllo wörld: € 5, 🙂 done — naïve café\n\tend ☃☃ 日本語"


class WindowBytes(ByteTokenizer):
    """Bytes decoded through windows, as a tokenizer without ``token_bytes`` is (SentencePiece's
    Metaspace decoder, a decoder that cleans up spaces)."""

    def token_bytes(self) -> None:
        return None


class WindowBPE(HuggingFaceTokenizer):
    """The tiny byte-level BPE decoded through windows (see ``WindowBytes``)."""

    def token_bytes(self) -> None:
        return None


def tiny_bpe(path: Path, windows: bool = False) -> HuggingFaceTokenizer:
    from transformers import AutoTokenizer

    kind = WindowBPE if windows else HuggingFaceTokenizer
    return kind(AutoTokenizer.from_pretrained(path))


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
    if resume_at >= len(tokens):  # the request ended where it was resumed
        sent.append(second.push([], final=True))
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


@pytest.mark.parametrize("windows", [False, True])
def test_batched_pushes_one_token_at_a_time_equal_each_full_decode(
    windows: bool, tiny_model_path: Path
) -> None:
    # Through windows: one decode_batch call a step for every sequence, windows that move up
    # included (their kept text is measured in that same call). Byte-level: none.
    tokenizer = tiny_bpe(tiny_model_path, windows)
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
    assert calls == (longest if windows else 0)
    assert sent == decode_batch(token_lists)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_push_each_gives_each_detokenizers_own_deltas(kind: str, tiny_model_path: Path) -> None:
    # A decode step's one-token-each pass through windows: the same deltas, step after step,
    # as pushing each detokenizer alone (windows moving up, characters split over tokens,
    # resumed ones).
    tokenizer: BatchTokenizer = WindowBytes()
    if kind == "bpe":
        tokenizer = tiny_bpe(tiny_model_path, windows=True)
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


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_byte_level_deltas_equal_the_tokenizers_decode_of_any_tokens(
    kind: str, tiny_model_path: Path
) -> None:
    """Random token ids (lone bytes of multi-byte characters, invalid UTF-8, special tokens,
    ids past the vocabulary): the byte-level detokenizer's deltas, one token or a few at a
    time, resumed anywhere and batched, concatenate to what the tokenizer decodes, and equal
    the window-decoding detokenizer's text; the tokenizer decodes nothing for them."""
    tokenizer: BatchTokenizer = ByteTokenizer() if kind == "bytes" else tiny_bpe(tiny_model_path)
    windows: BatchTokenizer = WindowBytes() if kind == "bytes" else tiny_bpe(tiny_model_path, True)
    rng = random.Random(7)
    vocabulary = tokenizer.vocab_size
    token_lists = [
        [rng.randrange(vocabulary + 3) for _ in range(rng.randint(1, 60))] for _ in range(40)
    ]
    full = tokenizer.decode_batch(token_lists)
    decode_batch = tokenizer.decode_batch

    def refuse(windows: list[list[int]]) -> list[str]:
        raise AssertionError("decoded through the tokenizer")

    tokenizer.decode_batch = refuse  # type: ignore[method-assign]
    for index, tokens in enumerate(token_lists):
        resume_at = rng.randrange(len(tokens) + 1)
        assert stream_text(tokenizer, tokens, resume_at, seed=index) == full[index], index
        tokenizer.decode_batch = decode_batch  # type: ignore[method-assign]
        assert stream_text(windows, tokens, resume_at, seed=index) == full[index], index
        tokenizer.decode_batch = refuse  # type: ignore[method-assign]
    # A client that resubmits with the tokens it has: the coordinator starts its text with
    # what a detokenizer let out for them, and the resumed engine continues from there.
    for kind_of in (tokenizer, windows):
        cuts = [rng.randrange(len(tokens) + 1) for tokens in token_lists]
        had = released_texts(kind_of, [t[:cut] for t, cut in zip(token_lists, cuts, strict=True)])
        for index, (tokens, cut) in enumerate(zip(token_lists, cuts, strict=True)):
            rest = IncrementalDetokenizer(kind_of, tokens[:cut]).push(tokens[cut:], final=True)
            assert had[index] + rest == full[index], (index, cut)
    detokenizers = [IncrementalDetokenizer(tokenizer) for _ in token_lists]
    sent = [""] * len(token_lists)
    for position in range(max(map(len, token_lists))):
        live = [i for i, tokens in enumerate(token_lists) if position < len(tokens)]
        pushed = [token_lists[i][position] for i in live]
        deltas = push_each(tokenizer, [detokenizers[i] for i in live], pushed)
        for i, delta in zip(live, deltas, strict=True):
            sent[i] += delta
    sent = [
        text + detokenizer.push([], final=True)
        for text, detokenizer in zip(sent, detokenizers, strict=True)
    ]
    assert sent == full


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
    assert other.token_texts() is None and other.token_bytes() is None
    table = tokenizer.token_bytes()
    assert table is not None and len(table) == tokenizer.vocab_size
    assert b"".join(table[t] for t in tokens) == b"plain ascii words, and more"
    eos = tokenizer.eos_token_id
    assert eos is not None and table[eos] == b""  # a special token: decoding skips it


def test_an_engine_reads_the_fake_runners_tokens_as_bytes() -> None:
    text = RequestText(FakeRunner())
    assert isinstance(text.tokenizer, ByteTokenizer)
    assert text.start([104, 105]).push([33], final=True) == "!"


def test_an_engine_and_its_runner_share_one_tokenizer_adapter(tiny_model_path: Path) -> None:
    """The vocabulary tables (``prepare_detokenizing``: one decode of the whole vocabulary)
    are built once per engine, not once for the server's text and once for the runner's."""
    from transformers import PreTrainedTokenizerFast

    from dpserve.engine.model_runner import ModelRunner

    runner = ModelRunner(str(tiny_model_path), max_num_seqs=2)
    adapter = RequestText(runner).tokenizer
    assert adapter is runner._text_tokenizer
    assert isinstance(adapter, HuggingFaceTokenizer) and adapter.tokenizer is runner.tokenizer
    other = PreTrainedTokenizerFast.from_pretrained(tiny_model_path)
    assert as_batch_tokenizer(other) is not adapter  # one per tokenizer object
    assert as_batch_tokenizer(other) is as_batch_tokenizer(other)


@pytest.mark.parametrize("final", [False, True])
def test_nothing_new_gives_no_text(final: bool) -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), list(b"abc"))
    assert detokenizer.push([], final=final) == ""
