"""What ``InferenceClient`` hands out and takes: errors, records, streams, addresses."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from dpserve.sampling import SamplingParams

Prompt = str | list[int] | list[dict[str, str]]
# What SUBMIT_REQUEST carries: text, packed token ids, or chat messages.
WirePrompt = str | bytes | list[dict[str, str]]


class ClientError(RuntimeError):
    """Base of the client's errors."""


class CoordinatorUnavailable(ClientError):
    """The coordinator did not answer the handshake in time."""


class CoordinatorRefused(CoordinatorUnavailable):
    """The coordinator refused this client's CURVE handshake (no keys, or a key it does not
    allow); the message says which."""


class UnsendableRequest(ClientError, ValueError):
    """The client refused a request before sending it; the message says why."""


class ClientStopped(ClientError):
    """The client was stopped before the request finished."""


class RequestFailed(ClientError):
    """The coordinator or an engine answered the request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(slots=True)
class RequestRecord:
    """A finished request."""

    request_id: int
    prompt_tokens: list[int]
    generated_tokens: list[int]
    generated_text: str
    finish_reason: str
    # One per generated token; a stream resumed after a coordinator restart has them only
    # for the tokens generated after the restart (the last ones).
    log_probs: list[float] | None
    ttft: float | None  # seconds from the coordinator receiving it to the first token
    latency: float  # seconds from add_request to the result, on this client
    engine_rank: int
    # Prompt tokens the engine served from its prefix cache (None: not reported).
    cached_tokens: int | None = None
    # With top_logprobs: per generated token its most likely alternatives (token, log-prob),
    # most likely first; aligned like log_probs.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With prompt_logprobs: the prompt's tokens after the first (the first has no context);
    # with top_logprobs also their alternatives.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # The EOS / termination_id token that ended it (finish_reason "stop"): generated, counted
    # in usage, not in generated_tokens or the text. None for stop strings and "length".
    stop_token: int | None = None
    # With log_probs: the stop token's log-prob (and with top_logprobs its alternatives).
    stop_logprob: float | None = None
    stop_top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class StreamChunk:
    tokens: list[int]
    text: str
    # When the request asked for them: one per token, and with top_logprobs the alternatives.
    log_probs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True, eq=False)
class PendingRequest:
    prompt: WirePrompt
    params: dict[str, Any]
    future: asyncio.Future[RequestRecord]
    submitted_at: float
    chunks: asyncio.Queue[StreamChunk] | None = None  # set for streaming requests
    first_token_at: float | None = None
    # Packed tokens the caller already received (streams): a resubmission resumes after them.
    received: bytearray | None = None


@functools.lru_cache(maxsize=256)
def cached_wire_params(params: SamplingParams) -> dict[str, Any]:
    # Clients reuse a few parameter objects for many requests; serialize each once.
    return params.serialize()


class RequestStream:
    """One streaming request: its chunks as they arrive, then its ``RequestRecord``.
    Leaving the iteration early (or ``cancel()``) cancels the request on its engine."""

    def __init__(self, pending: PendingRequest) -> None:
        assert pending.chunks is not None
        self.future: asyncio.Future[RequestRecord] = pending.future
        self._chunks: asyncio.Queue[StreamChunk] = pending.chunks

    def cancel(self) -> None:
        """Stop the work (a no-op once finished): the client sends CANCEL to the coordinator."""
        if not self.future.done():
            self.future.cancel()

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._chunks_only()

    async def _chunks_only(self) -> AsyncGenerator[StreamChunk, None]:
        async for event in self.events():
            if isinstance(event, StreamChunk):
                yield event

    async def events(self) -> AsyncGenerator[StreamChunk | RequestRecord, None]:
        """Chunks as they arrive, a last chunk with whatever the result adds, then the record.
        Raises ``RequestFailed`` (or ``ClientStopped``) when the request fails."""
        try:
            sent_tokens = sent_text = 0
            while (chunk := await self._next_chunk()) is not None:
                sent_tokens += len(chunk.tokens)
                sent_text += len(chunk.text)
                yield chunk
            record = self.future.result()
            rest_tokens = record.generated_tokens[sent_tokens:]
            rest_text = record.generated_text[sent_text:]
            if rest_tokens or rest_text:
                yield StreamChunk(rest_tokens, rest_text, *_last(record, len(rest_tokens)))
            yield record
        finally:
            self.cancel()  # the consumer left early (or was cancelled): stop the engine's work

    async def _next_chunk(self) -> StreamChunk | None:
        """The next chunk, or None once the request is done and every chunk was taken."""
        while True:
            if not self._chunks.empty():
                return self._chunks.get_nowait()
            if self.future.done():
                return None
            getter = asyncio.ensure_future(self._chunks.get())
            try:
                await asyncio.wait((getter, self.future), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    # A woken-but-cancelled get() leaves its item in the queue: nothing is lost.
                    getter.cancel()
            if getter.done() and not getter.cancelled():
                return getter.result()


def _last(
    record: RequestRecord, count: int
) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """The log-probs (and alternatives) of the record's last ``count`` tokens."""
    if record.log_probs is None:
        return None, None
    start = max(0, len(record.log_probs) - count)
    top = None if record.top_logprobs is None else record.top_logprobs[start:]
    return record.log_probs[start:], top


def coordinator_address(address: int | str) -> str:
    """A port, ``host:port``, ``host`` (default port 5555) or a full ``tcp://`` address."""
    if isinstance(address, int):
        return f"tcp://127.0.0.1:{address}"
    if "://" in address:
        return address
    if address.isdigit():
        return f"tcp://127.0.0.1:{address}"
    host, _, port = address.rpartition(":") if ":" in address else (address, "", "5555")
    return f"tcp://{host}:{port}"
