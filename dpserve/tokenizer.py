"""Batch tokenizers for the coordinator, the engines and the HTTP front, and the incremental
detokenizer that turns a growing token sequence into text deltas.

The coordinator tokenizes whole batches (one call per drained batch of messages), so
everything here speaks ``encode_batch`` / ``decode_batch``. ``ByteTokenizer`` needs no files:
string prompts work with fake engines and in tests.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import weakref
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Final, Protocol, runtime_checkable

# Tokens before the first undecided one that are decoded with it: detokenizers need a little
# left context (a leading space, the start of a multi-byte character).
DETOKENIZE_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"
_MAX_UTF8_BYTES = 4


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRendering:
    """How a conversation becomes a prompt, besides its messages."""

    tools: Sequence[Mapping[str, Any]] | None = None  # the template shows them to the model
    add_generation_prompt: bool = True  # the assistant's turn opened after the messages
    continue_final_message: bool = False  # the final message left open, to be continued
    # More variables for the template (vLLM's chat_template_kwargs, e.g. enable_thinking).
    template_kwargs: Mapping[str, Any] | None = None


PLAIN_CHAT: Final = ChatRendering()


@runtime_checkable
class BatchTokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode_batch(self, token_lists: list[list[int]]) -> list[str]: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], rendering: ChatRendering = PLAIN_CHAT
    ) -> str:
        """The conversation as the model reads it (``ChatRendering``: how, besides the
        messages)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, plus an end-of-sequence token 256."""

    eos_token_id: int | None = 256
    vocab_size = 257

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode_batch(self, token_lists: list[list[int]]) -> list[str]:
        return [
            bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")
            for tokens in token_lists
        ]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], rendering: ChatRendering = PLAIN_CHAT
    ) -> str:
        tools = rendering.tools
        lines = [f"tools: {json.dumps(list(tools))}"] if tools else []
        for message in messages:
            line = f"{message.get('role', 'user')}: {message.get('content', '')}"
            calls = message.get("tool_calls")
            if calls:
                line += f" {json.dumps(calls)}"
            lines.append(line)
        opens = rendering.add_generation_prompt and not rendering.continue_final_message
        opened = ["assistant:"] if opens else []
        return "\n".join([*lines, *opened])

    def token_texts(self) -> Sequence[str | None]:
        """``token_texts`` of the protocol: ASCII bytes are characters of their own, the
        others halves of one; EOS decodes to nothing."""
        return _BYTE_TEXTS

    def token_bytes(self) -> Sequence[bytes]:
        """``token_bytes`` of ``HuggingFaceTokenizer``: each byte itself; EOS nothing."""
        return _BYTE_BYTES


_BYTE_TEXTS: tuple[str | None, ...] = (
    *(chr(byte) for byte in range(128)),
    *(None for _ in range(128, 256)),
    "",
)
_BYTE_BYTES: tuple[bytes, ...] = (*(bytes([byte]) for byte in range(256)), b"")


class HuggingFaceTokenizer:
    """Adapter over a transformers tokenizer (fast tokenizers batch in Rust)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        # transformers' batch_decode of a fast tokenizer is its Rust decode plus ~40 us of
        # Python per sequence; where it would not clean up spaces afterwards, the Rust one
        # alone gives the same text.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._rust_decoder = backend if backend is not None and not cleans_up else None
        self._token_texts: Sequence[str | None] | None = None
        self._token_bytes: Sequence[bytes] | None = None
        self._token_texts_known = False

    def token_texts(self) -> Sequence[str | None] | None:
        """Each token's text where a sequence's text is the concatenation of its tokens'
        (``IncrementalDetokenizer``'s fast path), None for a token whose bytes are no whole
        characters; None for a tokenizer whose decoding is not that. A byte-level BPE decoder
        (GPT-2's, Llama 3's, Qwen's, SmolLM's) maps each token to bytes on its own and decodes
        their concatenation as UTF-8: there, a token that decodes alone to whole characters
        adds exactly those characters to any text that ends on a whole character. Decoded
        once, on first use, in one batch of the whole vocabulary."""
        self._learn_tokens()
        return self._token_texts

    def token_bytes(self) -> Sequence[bytes] | None:
        """Each token's bytes where a sequence's text is the UTF-8 decoding (invalid bytes
        replaced) of its tokens' bytes concatenated, as a byte-level BPE decoder makes it; a
        special token has none (decoding skips them). None for other tokenizers, and where a
        token's bytes would not decode to what the tokenizer decodes it to alone. With them an
        ``IncrementalDetokenizer`` decodes nothing through the tokenizer."""
        self._learn_tokens()
        return self._token_bytes

    def _learn_tokens(self) -> None:
        if self._token_texts_known:
            return
        self._token_texts_known = True
        from tokenizers import decoders

        decoder = self._rust_decoder
        if decoder is None or not isinstance(decoder.decoder, decoders.ByteLevel):
            return
        ids = range(self.vocab_size)
        texts = decoder.decode_batch([[token] for token in ids], skip_special_tokens=True)
        self._token_texts = [None if _REPLACEMENT in text else text for text in texts]
        special = {
            token for token, added in decoder.get_added_tokens_decoder().items() if added.special
        }
        table = [
            b"" if token in special else _byte_level_bytes(decoder.id_to_token(token))
            for token in ids
        ]
        agrees = all(
            piece.decode("utf-8", "replace") == text
            for piece, text in zip(table, texts, strict=True)
        )
        self._token_bytes = table if agrees else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        # Chat templates and clients add special tokens themselves where they want them.
        token_lists: list[list[int]] = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return token_lists

    def decode_batch(self, token_lists: list[list[int]]) -> list[str]:
        if not token_lists:
            return []
        if self._rust_decoder is not None:
            decoded: list[str] = self._rust_decoder.decode_batch(
                token_lists, skip_special_tokens=True
            )
            return decoded
        texts: list[str] = self.tokenizer.batch_decode(token_lists, skip_special_tokens=True)
        return texts

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], rendering: ChatRendering = PLAIN_CHAT
    ) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            # tokenize=False makes it return the rendered prompt as one string. The template
            # decides how (and whether) the tools are shown to the model.
            prompt: str = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(rendering.tools) if rendering.tools else None,
                tokenize=False,
                add_generation_prompt=rendering.add_generation_prompt,
                continue_final_message=rendering.continue_final_message,
                **(rendering.template_kwargs or {}),
            )
            return prompt
        return ByteTokenizer().apply_chat_template(messages, rendering)


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    alphabet = {chr(byte): byte for byte in printable}
    alphabet.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return alphabet


def _byte_level_bytes(piece: str | None) -> bytes:
    """A byte-level token's bytes; a token with a character outside the alphabet (an added
    token's plain text) stands for its own UTF-8, as the byte-level decoder has it."""
    if piece is None:
        return b""
    alphabet = _byte_level_alphabet()
    if all(char in alphabet for char in piece):
        return bytes(alphabet[char] for char in piece)
    return piece.encode("utf-8")


_ADAPTERS: weakref.WeakKeyDictionary[Any, HuggingFaceTokenizer] = weakref.WeakKeyDictionary()


def as_batch_tokenizer(tokenizer: Any) -> BatchTokenizer:
    """Accept ``None`` (bytes), a path or hub id, a transformers tokenizer, or one of ours."""
    if tokenizer is None or tokenizer == "bytes":
        return ByteTokenizer()
    if isinstance(tokenizer, ByteTokenizer | HuggingFaceTokenizer):
        return tokenizer
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    if hasattr(tokenizer, "batch_decode"):
        # One adapter per transformers tokenizer: the engine's server and its runner then
        # share the vocabulary tables (``prepare_detokenizing``), built once, not twice.
        try:
            adapter = _ADAPTERS.get(tokenizer)
            if adapter is None:
                adapter = _ADAPTERS[tokenizer] = HuggingFaceTokenizer(tokenizer)
        except TypeError:  # neither hashable nor weakly referable: an adapter of its own
            return HuggingFaceTokenizer(tokenizer)
        return adapter
    if isinstance(tokenizer, BatchTokenizer):
        return tokenizer
    raise TypeError(f"cannot use {type(tokenizer).__name__} as a tokenizer")


class ChatTemplateError(ValueError):
    """A ``--chat-template`` that cannot be used: says why."""


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value as template text: a file's contents, or the template
    itself (vLLM's "the file path to the chat template, or the template in single-line form")."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as template_file:
            return template_file.read()
    if "{{" in value or "{%" in value:
        return value
    raise ChatTemplateError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def with_chat_template(tokenizer: BatchTokenizer, template: str | None) -> BatchTokenizer:
    """``tokenizer`` rendering chats with ``template`` (text) instead of the model's own;
    refused where it cannot: the byte tokenizer has no templates, and a template that does
    not render a one-message conversation is refused now rather than at every request."""
    if template is None:
        return tokenizer
    if not isinstance(tokenizer, HuggingFaceTokenizer):
        raise ChatTemplateError("--chat-template needs a model's tokenizer (--tokenizer/--model)")
    tokenizer.tokenizer.chat_template = template  # this process's own copy
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    except Exception as exc:  # a template may raise anything (jinja's raise_exception included)
        raise ChatTemplateError(f"--chat-template does not render a conversation: {exc}") from None
    return tokenizer


def load_tokenizer(path_or_id: str) -> BatchTokenizer:
    """Load a transformers tokenizer from a local directory or (where a network exists) a hub id.

    A directory with a ``tokenizer.json`` is read by the fast tokenizer class itself:
    ``AutoTokenizer`` reads the model's config first, and that imports torch (~330 MiB more
    resident memory in the coordinator and the HTTP front, which never run a model)."""
    if os.path.isfile(os.path.join(path_or_id, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return HuggingFaceTokenizer(PreTrainedTokenizerFast.from_pretrained(path_or_id))
    from transformers import AutoTokenizer  # heavy import, only where a real tokenizer is used

    return HuggingFaceTokenizer(AutoTokenizer.from_pretrained(path_or_id))


class IncrementalDetokenizer:
    """The text of a growing token sequence as deltas that concatenate to its text.

    With a tokenizer that has ``token_bytes`` (byte-level BPE), each token's bytes go through
    an incremental UTF-8 decoder, which holds back an incomplete character: nothing is decoded
    through the tokenizer. Otherwise each ``push`` decodes only a window: the tokens since the
    last point where all text was out, plus ``DETOKENIZE_CONTEXT_TOKENS`` of context, and a
    trailing replacement character is held back (usually half a UTF-8 sequence that the next
    tokens complete) until ``final``. Started with the tokens generated elsewhere already
    (``resume_tokens``), its deltas begin where the text of those tokens, so held back, ends."""

    __slots__ = (
        "_anchor",
        "_bytes",
        "_clean",
        "_resync_end",
        "_sent",
        "_texts",
        "_tokens",
        "_utf8",
        "tokenizer",
    )

    def __init__(self, tokenizer: BatchTokenizer, resume_tokens: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        table = getattr(tokenizer, "token_bytes", None)
        self._bytes: Sequence[bytes] | None = table() if table is not None else None
        self._utf8: codecs.IncrementalDecoder | None = None
        if self._bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._utf8.decode(self._joined(resume_tokens))  # held back: an incomplete tail
            self._tokens: list[int] = []
            self._anchor = self._sent = 0
            self._resync_end: int | None = None
            self._clean = False
            self._texts: Sequence[str | None] | None = None
            return
        self._tokens = list(resume_tokens)
        self._anchor = self._clean_anchor(len(self._tokens) - DETOKENIZE_CONTEXT_TOKENS)
        # What the text of ``resume_tokens`` held back is its trailing replacement characters:
        # the window starts on a whole character, so none of them is leading context.
        window = self._window() if self._tokens else ""
        self._sent = len(window.rstrip(_REPLACEMENT))
        # Set when the window moved up: ``_sent`` is then the length of the text of
        # ``_tokens[_anchor:_resync_end]``, decoded with the next window (``resync_window``).
        self._resync_end = None
        # All of the window's text is out and it ends on a whole character: with a tokenizer
        # that has ``token_texts``, a token with a text of its own adds just that (no decode).
        self._clean = self._sent == len(window)
        texts = getattr(tokenizer, "token_texts", None)
        self._texts = texts() if texts is not None else None

    def _joined(self, tokens: Sequence[int]) -> bytes:
        """The bytes of ``tokens`` (an id the table does not have adds none, as in decoding)."""
        table = self._bytes
        assert table is not None
        size = len(table)
        return b"".join([table[token] for token in tokens if 0 <= token < size])

    def _clean_anchor(self, anchor: int) -> int:
        """``anchor``, moved back (by at most a UTF-8 sequence) to a token that starts a whole
        character, so that the window's text does not start with replacement characters."""
        if anchor <= 0:
            return 0
        candidates = list(range(anchor, max(-1, anchor - _MAX_UTF8_BYTES), -1))
        single = self.tokenizer.decode_batch([[self._tokens[i]] for i in candidates])
        for index, text in zip(candidates, single, strict=True):
            if not text.startswith(_REPLACEMENT):
                return index
        return candidates[-1]

    def _window(self) -> str:
        [text] = self.tokenizer.decode_batch([self._tokens[self._anchor :]])
        return text

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """The new text that ``tokens`` complete; with ``final``, everything left."""
        if self._utf8 is not None:
            return self._utf8.decode(self._joined(tokens), final)
        return push_batch(self.tokenizer, [(self, tokens, final)])[0]

    def extend(self, tokens: Sequence[int], final: bool = False) -> list[int] | None:
        """``push`` in two halves, so that many detokenizers decode in one ``decode_batch``
        (``push_batch``): add ``tokens``, return the window to decode (None: nothing to do)."""
        if not tokens and not final:
            return None
        self._tokens.extend(tokens)
        return self._tokens[self._anchor :]

    def resync_window(self) -> list[int] | None:
        """After the window moved up: its tokens whose text is out already, to be decoded with
        the next window (``take``'s ``resynced``); None otherwise."""
        if self._resync_end is None:
            return None
        return self._tokens[self._anchor : self._resync_end]

    def take(self, text: str, final: bool = False, resynced: str | None = None) -> str:
        """The second half of ``push``: the delta, given the text of ``extend``'s window (and
        of ``resync_window``'s, when it had one)."""
        if resynced is not None:
            self._sent = len(resynced)
            self._resync_end = None
        stable = len(text) if final else len(text.rstrip(_REPLACEMENT))
        delta = text[self._sent : stable] if stable > self._sent else ""
        self._sent = max(self._sent, stable)
        self._clean = self._sent == len(text)
        if self._clean and len(self._tokens) - self._anchor > (2 * DETOKENIZE_CONTEXT_TOKENS):
            self._move_window()
        return delta

    def _move_window(self) -> None:
        """Everything is out: move the window up, keeping some context. The length of the text
        kept is the sum of its tokens' own texts where they all have one, else it is learned
        in the next push's decode (not with a decode of its own)."""
        self._anchor = anchor = len(self._tokens) - DETOKENIZE_CONTEXT_TOKENS
        texts = self._texts
        if texts is not None:
            kept = [texts[t] if 0 <= t < len(texts) else None for t in self._tokens[anchor:]]
            if None not in kept:
                self._sent = sum(map(len, kept))  # type: ignore[arg-type]
                return
        self._resync_end = len(self._tokens)
        self._clean = False


def push_batch(
    tokenizer: BatchTokenizer, items: Sequence[tuple[IncrementalDetokenizer, Sequence[int], bool]]
) -> list[str]:
    """``detokenizer.push(tokens, final)`` for every item, with one ``decode_batch`` call for
    all of them (they all use ``tokenizer``)."""
    windows: list[list[int]] = []
    resyncing: list[bool | None] = []  # per item: None (nothing to decode), or a resync first
    for detokenizer, tokens, final in items:
        window = None if detokenizer._utf8 is not None else detokenizer.extend(tokens, final)
        if window is None:
            resyncing.append(None)
            continue
        resync = detokenizer.resync_window()
        if resync is not None:
            windows.append(resync)
        windows.append(window)
        resyncing.append(resync is not None)
    texts = iter(tokenizer.decode_batch(windows) if windows else ())
    deltas = []
    for resyncs, (detokenizer, tokens, final) in zip(resyncing, items, strict=True):
        if resyncs is None:
            deltas.append(detokenizer.push(tokens, final) if detokenizer._utf8 else "")
            continue
        resynced = next(texts) if resyncs else None
        deltas.append(detokenizer.take(next(texts), final, resynced))
    return deltas


def prepare_detokenizing(tokenizer: BatchTokenizer) -> None:
    """Build the tokenizer's tables for detokenizing (``token_texts``, ``token_bytes``: one
    decode of the whole vocabulary) now, at start, not on a first request's path."""
    for table in ("token_texts", "token_bytes"):
        made = getattr(tokenizer, table, None)
        if made is not None:
            made()


def released_texts(tokenizer: BatchTokenizer, token_lists: Sequence[Sequence[int]]) -> list[str]:
    """The text a new ``IncrementalDetokenizer`` lets out for each token list (an unfinished
    character held back): what a client that streamed those tokens has, and where one resumed
    after them continues. At most one ``decode_batch`` call."""
    return push_batch(
        tokenizer, [(IncrementalDetokenizer(tokenizer), tokens, False) for tokens in token_lists]
    )


def push_each(
    tokenizer: BatchTokenizer, detokenizers: Sequence[IncrementalDetokenizer], tokens: Sequence[int]
) -> list[str]:
    """``detokenizer.push([token])`` for each pair, with at most one ``decode_batch`` call: what
    ``push_batch`` does for one new token each (a decode step), in one pass over them without
    its per-item calls. A token with a text of its own (``token_texts``) after a window whose
    text is all out adds that text, decoding nothing."""
    deltas: list[str] = []
    windows: list[list[int]] = []
    slow: list[tuple[int, IncrementalDetokenizer]] = []
    for detokenizer, token in zip(detokenizers, tokens, strict=True):
        utf8 = detokenizer._utf8
        if utf8 is not None:  # byte-level: the token's bytes, decoded as they complete
            table = detokenizer._bytes
            assert table is not None
            deltas.append(utf8.decode(table[token]) if 0 <= token < len(table) else "")
            continue
        window = detokenizer._tokens
        window.append(token)
        texts = detokenizer._texts
        if detokenizer._clean and texts is not None and 0 <= token < len(texts):
            text = texts[token]
            if text is not None:
                detokenizer._sent += len(text)
                if len(window) - detokenizer._anchor > 2 * DETOKENIZE_CONTEXT_TOKENS:
                    detokenizer._move_window()
                deltas.append(text)
                continue
        slow.append((len(deltas), detokenizer))
        deltas.append("")
        if detokenizer._resync_end is not None:
            windows.append(window[detokenizer._anchor : detokenizer._resync_end])
        windows.append(window[detokenizer._anchor :])
    if not slow:
        return deltas
    decoded = iter(tokenizer.decode_batch(windows))
    for index, detokenizer in slow:
        # ``take(text, final=False, resynced)``, inlined (a call per sequence costs as much as
        # its work). A moved window's resync text comes first (as it was appended).
        if detokenizer._resync_end is not None:
            detokenizer._sent = len(next(decoded))
            detokenizer._resync_end = None
        text = next(decoded)
        sent = detokenizer._sent
        stable = len(text.rstrip(_REPLACEMENT)) if text.endswith(_REPLACEMENT) else len(text)
        if stable > sent:
            deltas[index] = text[sent:stable]
            detokenizer._sent = sent = stable
        detokenizer._clean = sent == len(text)
        if detokenizer._clean and len(detokenizer._tokens) - detokenizer._anchor > (
            2 * DETOKENIZE_CONTEXT_TOKENS
        ):
            detokenizer._move_window()
    return deltas
