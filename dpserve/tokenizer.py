"""Batch tokenizers for the coordinator and the HTTP front.

The coordinator tokenizes and detokenizes whole batches (one call per drained batch of
messages), so everything here speaks ``encode_batch`` / ``decode_batch``. ``ByteTokenizer``
needs no files: string prompts work with fake engines and in tests.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class BatchTokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode_batch(self, token_lists: list[list[int]]) -> list[str]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


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

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
        return "\n".join([*lines, "assistant:"])


class HuggingFaceTokenizer:
    """Adapter over a transformers tokenizer (fast tokenizers batch in Rust)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        # Chat templates and clients add special tokens themselves where they want them.
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def decode_batch(self, token_lists: list[list[int]]) -> list[str]:
        if not token_lists:
            return []
        return self.tokenizer.batch_decode(token_lists, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        return ByteTokenizer().apply_chat_template(messages)


def as_batch_tokenizer(tokenizer: Any) -> BatchTokenizer:
    """Accept ``None`` (bytes), a path or hub id, a transformers tokenizer, or one of ours."""
    if tokenizer is None or tokenizer == "bytes":
        return ByteTokenizer()
    if isinstance(tokenizer, ByteTokenizer | HuggingFaceTokenizer):
        return tokenizer
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    if hasattr(tokenizer, "batch_decode"):
        return HuggingFaceTokenizer(tokenizer)
    if isinstance(tokenizer, BatchTokenizer):
        return tokenizer
    raise TypeError(f"cannot use {type(tokenizer).__name__} as a tokenizer")


def load_tokenizer(path_or_id: str) -> BatchTokenizer:
    """Load a transformers tokenizer from a local directory or (where a network exists) a hub id."""
    from transformers import AutoTokenizer  # heavy import, only where a real tokenizer is used

    return HuggingFaceTokenizer(AutoTokenizer.from_pretrained(path_or_id))
