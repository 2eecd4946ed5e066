"""``ResultRouter``: the reply half of the batch step — engine updates in, RESULTS and STREAM out
(one message per client per drained batch).

Engines send each update's text with its tokens (their incremental detokenizer), so this only
routes: tokens and text are appended and forwarded, never decoded here. An engine that sends
no text is still served: its requests get a detokenizer of their own (``_text_here``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import NamedTuple

from dpserve import protocol
from dpserve.coordinator.dispatch import Dispatcher
from dpserve.coordinator.registry import Engine
from dpserve.coordinator.requests import InflightRequest
from dpserve.coordinator.shared import SharedState
from dpserve.protocol import (
    ClientChunk,
    ClientResult,
    EngineReply,
    EngineUpdate,
    ErrorCode,
    ProtocolError,
    Results,
    Stream,
)
from dpserve.tokenizer import IncrementalDetokenizer


class _Finish(NamedTuple):
    """How a request finished, kept until its result is flushed."""

    reason: str
    ttft: float | None  # from the coordinator receiving it
    rank: int
    update: EngineUpdate  # the finishing update: cached tokens, the stop token and log-prob


class ResultRouter:
    def __init__(self, shared: SharedState, dispatcher: Dispatcher) -> None:
        self.shared = shared
        self.dispatcher = dispatcher
        self._finished: list[InflightRequest] = []
        self._streaming: list[tuple[InflightRequest, bytes, str, bytes | None]] = []
        # Told each finished request's cached prompt tokens (the router's accuracy numbers).
        self.on_cached_tokens: Callable[[InflightRequest, int | None], None] = lambda r, n: None
        self._finish_info: dict[int, _Finish] = {}

    def on_engine_reply(self, engine: Engine, reply: EngineReply) -> None:
        by_id, identity = self.shared.requests.by_id, engine.identity
        for update in reply.updates:
            request = by_id.get(update.request_id)
            if request is None or request.engine != identity:
                self.shared.counters["stale_replies"] += 1  # cancelled, or re-dispatched elsewhere
                continue
            if update.error is not None:
                engine.outstanding.discard(update.request_id)
                reason = update.finish_reason or ErrorCode.ENGINE_ERROR
                self.dispatcher.fail(request, reason, update.error)
                continue
            tokens, finish_reason = update.tokens, update.finish_reason
            if len(tokens) % 4:
                raise ProtocolError("packed tokens must be a multiple of 4 bytes")
            text = update.text
            if text is None:  # an engine that sends no text
                text = self._text_here(request, tokens, finish_reason is not None)
            request.text.append(text)
            request.generated += tokens
            if tokens and not request.progressed:
                request.progressed = True
                self.dispatcher.router.first_token(update.request_id)
            if update.logprobs is not None:
                if request.logprobs is None:
                    request.logprobs = bytearray()
                request.logprobs += update.logprobs
            if update.prompt_logprobs is not None:
                # A resumed request sends them again: the last engine's are kept.
                request.prompt_logprobs = update.prompt_logprobs
            if finish_reason is not None:
                engine.outstanding.discard(update.request_id)
                queued_for = (request.dispatched_at or request.received_at) - request.received_at
                self._finish_info[update.request_id] = _Finish(
                    finish_reason,
                    None if update.ttft is None else queued_for + update.ttft,
                    engine.rank,
                    update,
                )
                self.on_cached_tokens(request, update.cached_tokens)
                self._finished.append(request)
            elif request.stream and tokens:
                self._streaming.append((request, tokens, text, update.logprobs))

    def _text_here(self, request: InflightRequest, tokens: bytes, final: bool) -> str:
        """The text of an update from an engine that sent none."""
        if request.detokenizer is None:
            resume = protocol.unpack_tokens(request.generated)
            request.detokenizer = IncrementalDetokenizer(self.shared.tokenizer, resume)
        return request.detokenizer.push(protocol.unpack_tokens(tokens), final)

    def flush(self) -> None:
        if self._finished:
            self._flush_finished()
        if self._streaming:
            # After the finished ones: a request that finished in this batch gets its tokens
            # in RESULTS, and only live requests get STREAM chunks.
            self._flush_stream()

    def _flush_finished(self) -> None:
        finished, self._finished = self._finished, []
        per_client: dict[bytes, list[ClientResult]] = defaultdict(list)
        for request in finished:
            finish = self._finish_info.pop(request.request_id)
            last = finish.update
            per_client[request.client].append(
                ClientResult(
                    request.client_request_id,
                    request.prompt_tokens,
                    bytes(request.generated),
                    "".join(request.text),
                    finish.reason,
                    None if request.logprobs is None else bytes(request.logprobs),
                    finish.ttft,
                    finish.rank,
                    last.cached_tokens,
                    request.prompt_logprobs,
                    last.stop_token,
                    last.stop_logprob,
                )
            )
            self.dispatcher.forget(request)
        self.shared.counters["completed"] += len(finished)
        for client, results in per_client.items():
            self.shared.transport.send(client, protocol.encode(Results(results)))

    def _flush_stream(self) -> None:
        streaming, self._streaming = self._streaming, []
        by_id = self.shared.requests.by_id
        per_client: dict[bytes, list[ClientChunk]] = defaultdict(list)
        for request, tokens, text, logprobs in streaming:
            if request.request_id in by_id:
                chunk = ClientChunk(request.client_request_id, tokens, text, logprobs)
                per_client[request.client].append(chunk)
        for client, chunks in per_client.items():
            self.shared.transport.send(client, protocol.encode(Stream(chunks)))
