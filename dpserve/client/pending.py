"""The client's table of requests and control calls awaiting an answer: encoding a request
once, resolving it from RESULTS/STREAM/ERROR, and resubmitting it to a restarted coordinator.

Every request is kept until its result arrives, so when the coordinator restarts the client can
resubmit them all; the coordinator de-duplicates by (client, client request id). A streaming
request is resubmitted with the tokens the caller already has as resume tokens, so generation
continues after them and no text arrives twice.

A request is encoded when it is submitted: one that cannot be (text that is not valid Unicode,
token ids out of range) or whose message exceeds the message limit raises ``UnsendableRequest``
at once and is never sent. A message over the coordinator's transport limit would make ZMQ
drop the whole connection, with every other request on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeGuard, cast

from dpserve import protocol
from dpserve.client.records import (
    PendingRequest,
    Prompt,
    RequestFailed,
    RequestRecord,
    StreamChunk,
    UnsendableRequest,
    WirePrompt,
    cached_wire_params,
)
from dpserve.protocol import Cancel, Results, Stream, SubmitRequest, unpack_logprobs
from dpserve.sampling import SamplingParams

_RESULT_REQUIRED = protocol.required_fields(protocol.ClientResult)
# A SUBMIT_REQUEST's bytes beyond its packed entry's: the header (a one-byte int; the array
# header holding one more field is still one byte).
_SINGLE_OVERHEAD_BYTES = 1


def _is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    return not isinstance(prompt, str) and not (prompt and isinstance(prompt[0], dict))


class PendingTable:
    """Requests (by client request id) and control calls (by control id) in flight; ids come
    from one counter. ``send`` puts a message on the connection."""

    def __init__(
        self,
        send: Callable[[bytes], None],
        max_message_bytes: int,
        send_submit: Callable[[bytes, Callable[[], bytes]], None],
    ) -> None:
        self._send = send
        self._send_submit = send_submit  # ClientConnection.send_submit
        self.max_message_bytes = max_message_bytes
        self.requests: dict[int, PendingRequest] = {}
        # The same requests' futures: the seed's ``completion_futures``.
        self.futures: dict[int, asyncio.Future[RequestRecord]] = {}
        self.controls: dict[int, asyncio.Future[Any]] = {}
        self.next_id = 0
        self.closed = False  # no CANCEL for a request cancelled once the client stopped

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # ------------------------------------------------------------------- requests

    def submit(self, prompt: Prompt, params: SamplingParams) -> PendingRequest:
        """Encode and send a request (``UnsendableRequest`` if it cannot be) and keep it."""
        request_id = self.new_id()
        wire_prompt, wire_params, entry = self._encode_submit(request_id, prompt, params)
        future: asyncio.Future[RequestRecord] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda done: self._on_future_done(request_id, done))
        pending = PendingRequest(
            wire_prompt,
            wire_params,
            future,
            time.monotonic(),
            asyncio.Queue() if params.stream else None,
            received=bytearray() if params.stream else None,
        )
        self.requests[request_id] = pending
        self.futures[request_id] = future
        self._send_submit(
            entry, lambda: protocol.encode(SubmitRequest(request_id, wire_prompt, wire_params))
        )
        return pending

    def _encode_submit(
        self, request_id: int, prompt: Prompt, params: SamplingParams
    ) -> tuple[WirePrompt, dict[str, Any], bytes]:
        """The request's wire prompt, parameters and packed entry (``protocol.encode_entry``:
        a SUBMIT_REQUESTS entry, or the fields of its SUBMIT_REQUEST); raises
        ``UnsendableRequest`` for what could never be sent (so a resubmission cannot fail)."""
        try:
            if _is_token_ids(prompt):
                wire_prompt: WirePrompt = protocol.pack_tokens(prompt)
            else:  # text or chat messages: a TypeGuard does not narrow its negative case
                wire_prompt = cast("str | list[dict[str, str]]", prompt)
            wire_params = cached_wire_params(params)
            entry = protocol.encode_entry(SubmitRequest(request_id, wire_prompt, wire_params))
        except UnicodeEncodeError as exc:
            raise UnsendableRequest(
                f"the request holds text that is not valid Unicode ({exc.reason}: "
                f"{exc.object[exc.start : exc.end]!r}); it cannot be encoded as UTF-8"
            ) from None
        except (OverflowError, TypeError, ValueError) as exc:
            raise UnsendableRequest(f"the request cannot be encoded: {exc}") from None
        size = len(entry) + _SINGLE_OVERHEAD_BYTES  # as its own SUBMIT_REQUEST
        if size > self.max_message_bytes:
            raise UnsendableRequest(
                f"the request encodes to {size} bytes, over the message limit of "
                f"{self.max_message_bytes} bytes (max_message_bytes); send a shorter prompt"
            )
        return wire_prompt, wire_params, entry

    def resubmit_all(self) -> None:
        """Send every pending request again (to a restarted coordinator)."""
        for request_id, pending in list(self.requests.items()):
            self._resubmit(request_id, pending)

    def _resubmit(self, request_id: int, pending: PendingRequest) -> None:
        """Send a pending request again, with the tokens its stream already delivered as
        resume tokens."""
        resume = bytes(pending.received or b"")
        payload = protocol.encode(SubmitRequest(request_id, pending.prompt, pending.params, resume))
        if len(payload) > self.max_message_bytes:
            self._forget(request_id)
            fail_pending(
                pending,
                RequestFailed(
                    "coordinator_restarted",
                    "the coordinator restarted and this stream's prompt with the tokens it "
                    f"already produced exceeds the message limit of {self.max_message_bytes} "
                    "bytes: it cannot be resumed",
                ),
            )
            return
        self._send(payload)

    def _forget(self, request_id: int) -> PendingRequest | None:
        self.futures.pop(request_id, None)
        return self.requests.pop(request_id, None)

    def _on_future_done(self, request_id: int, future: asyncio.Future[RequestRecord]) -> None:
        # A caller that cancels its future no longer wants the work done.
        if future.cancelled() and self._forget(request_id) is not None and not self.closed:
            self._send(protocol.encode(Cancel(request_id)))

    def on_results(self, message: Results) -> None:
        now = time.monotonic()
        for result in message.results:
            pending = self._forget(result.client_request_id)
            if pending is None:
                continue  # a duplicate from a resubmission, or cancelled
            k = _alternatives(pending)
            log_probs, top = (
                (None, None) if result.logprobs is None else unpack_logprobs(result.logprobs, k)
            )
            prompt_log_probs, prompt_top = (
                (None, None)
                if result.prompt_logprobs is None
                else unpack_logprobs(result.prompt_logprobs, k)
            )
            stop_logprob, stop_top = (
                (None, None)
                if result.stop_logprob is None
                else unpack_logprobs(result.stop_logprob, k)
            )
            record = RequestRecord(
                request_id=result.client_request_id,
                prompt_tokens=protocol.unpack_tokens(result.prompt_tokens),
                generated_tokens=protocol.unpack_tokens(result.generated_tokens),
                generated_text=result.text,
                finish_reason=result.finish_reason,
                log_probs=log_probs,
                ttft=result.ttft
                if pending.first_token_at is None
                else pending.first_token_at - pending.submitted_at,
                latency=now - pending.submitted_at,
                engine_rank=result.engine_rank,
                cached_tokens=result.cached_tokens,
                top_logprobs=top,
                prompt_logprobs=prompt_log_probs,
                prompt_top_logprobs=prompt_top,
                stop_token=result.stop_token,
                stop_logprob=None if stop_logprob is None else stop_logprob[0],
                stop_top_logprobs=None if stop_top is None else stop_top[0],
            )
            if not pending.future.done():
                pending.future.set_result(record)

    def on_stream(self, message: Stream) -> None:
        for chunk in message.chunks:
            pending = self.requests.get(chunk.client_request_id)
            if pending is None or pending.chunks is None:
                continue
            log_probs, top = (
                (None, None)
                if chunk.logprobs is None
                else unpack_logprobs(chunk.logprobs, _alternatives(pending))
            )
            if pending.first_token_at is None:
                pending.first_token_at = time.monotonic()
            if pending.received is not None:
                pending.received += chunk.tokens
            tokens = protocol.unpack_tokens(chunk.tokens)
            pending.chunks.put_nowait(StreamChunk(tokens, chunk.text, log_probs, top))

    def fail(self, ref: int, error: RequestFailed) -> None:
        """Fail the request or control call ``ref``, if there is one."""
        pending = self._forget(ref)
        if pending is not None:
            fail_pending(pending, error)
            return
        control = self.controls.pop(ref, None)
        if control is not None and not control.done():
            control.set_exception(error)

    # -------------------------------------------------------------- control calls

    def add_control(self, message: Callable[[int], bytes]) -> asyncio.Future[Any]:
        """Send ``message(control_id)``; the future resolves with the answer to that id."""
        control_id = self.new_id()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.controls[control_id] = future
        self._send(message(control_id))
        return future

    def resolve_control(self, control_id: int, value: Any) -> None:
        future = self.controls.pop(control_id, None)
        if future is not None and not future.done():
            future.set_result(value)

    def fail_controls(self, error: Exception) -> None:
        for future in self.controls.values():
            if not future.done():
                future.set_exception(error)
        self.controls.clear()

    def fail_everything(self, error: Exception) -> None:
        for pending in self.requests.values():
            fail_pending(pending, error)
        self.requests.clear()
        self.futures.clear()
        self.fail_controls(error)


def _alternatives(pending: PendingRequest) -> int:
    """How many alternatives per token the request's packed log-probs carry."""
    k = pending.params.get("top_logprobs", 0)
    return k if isinstance(k, int) and not isinstance(k, bool) else 0


def fail_pending(pending: PendingRequest, error: Exception) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)
    # Nobody may be awaiting a failed future; mark it retrieved to keep asyncio quiet.
    with contextlib.suppress(BaseException):
        pending.future.exception()
