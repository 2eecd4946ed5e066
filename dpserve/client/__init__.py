"""``InferenceClient``: an asyncio DEALER client for the coordinator (Megatron-Core's API).

The listener awaits the socket in the event loop (zmq.asyncio) and then drains every waiting
message without blocking: no sleep-polling. Every request is kept until its result arrives, so
when the coordinator restarts (a new instance id, or an UNKNOWN_PEER error) the client connects
again and resubmits them all; the coordinator de-duplicates by (client, client request id). A
streaming request is resubmitted with the tokens the caller already has as resume tokens, so
generation continues after them and no text arrives twice.

A request is encoded when it is submitted: one that cannot be (text that is not valid Unicode,
token ids out of range) or whose message exceeds the message limit raises ``InvalidRequest``
at once and is never sent. A message over the coordinator's transport limit would make ZMQ
drop the whole connection, with every other request on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dpserve import protocol, security
from dpserve.client.records import (
    ClientError,
    ClientStopped,
    CoordinatorRefused,
    CoordinatorUnavailable,
    InvalidRequest,
    PendingRequest,
    Prompt,
    RequestFailed,
    RequestRecord,
    RequestStream,
    StreamChunk,
    cached_wire_params,
    coordinator_address,
)
from dpserve.handshake import WATCHED_EVENTS, HandshakeWatch
from dpserve.limits import DEFAULT_REQUEST_LIMITS
from dpserve.protocol import ErrorCode, Header, ProtocolError
from dpserve.sampling import SamplingParams

log = logging.getLogger("dpserve.client")

_WAITING_NOTE_EVERY = 10.0  # seconds between log lines while nothing listens yet


class InferenceClient:
    def __init__(
        self,
        inference_coordinator_port: int | str,
        *,
        handshake_timeout: float = 10.0,
        startup_timeout: float = 120.0,
        heartbeat_interval: float = 0.5,
        credentials: security.PeerKeys | str | os.PathLike[str] | None = None,
        max_message_bytes: int = DEFAULT_REQUEST_LIMITS.max_message_bytes,
    ) -> None:
        """``credentials``: a client's keys, or a credentials directory (its admin key if it
        holds one, else its client key), for a coordinator that requires CURVE.
        ``handshake_timeout``: seconds for the coordinator to answer once connected;
        ``startup_timeout``: seconds to wait for a coordinator that is not listening yet (still
        starting), with a log line now and then. A refused handshake fails at once.
        ``max_message_bytes``: requests whose message is larger are refused before sending
        (the coordinator's ``--max-message-bytes``)."""
        self.address = coordinator_address(inference_coordinator_port)
        self.max_message_bytes = max_message_bytes
        # Loaded before any socket exists: a bad directory raises without leaking a context.
        self.keys = None if credentials is None else security.as_peer_keys(credentials, None)
        self.handshake_timeout = handshake_timeout
        self.startup_timeout = startup_timeout
        self.heartbeat_interval = heartbeat_interval
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        # A fixed identity lets a restarted coordinator (and ZMQ reconnects) see the same peer.
        self.socket.setsockopt(zmq.IDENTITY, b"c-" + uuid.uuid4().bytes)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if self.keys is not None:
            security.secure_peer(self.socket, self.keys)
        self._watch = HandshakeWatch(
            self.address,
            "client",
            self.keys is not None,
            f"allowed/{self.keys.role}/" if self.keys is not None else "allowed/",
        )
        self._monitor = self.socket.get_monitor_socket(WATCHED_EVENTS)
        self._monitor_task: asyncio.Task | None = None
        self._handshake_news = asyncio.Event()  # set by every monitor event
        self._refusal: CoordinatorRefused | None = None
        # Sends and drains go through a plain-socket view of the same socket: no Future per
        # message. Only the wait for input goes through the event loop (see _send).
        self._sync_socket = zmq.Socket.shadow(self.socket.underlying)
        self._recheck_scheduled = False
        self.completion_futures: dict[int, asyncio.Future] = {}
        self.next_request_id = 0
        self.listener_task: asyncio.Task | None = None
        self.coordinator_instance: str | None = None
        self._pending: dict[int, PendingRequest] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self._handshake: asyncio.Future | None = None
        self._reconnecting = False
        self._heartbeat_task: asyncio.Task | None = None
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Connect, complete the handshake (or raise ``CoordinatorUnavailable``, or
        ``CoordinatorRefused`` at once for refused credentials) and start the listener."""
        del loop  # accepted for Megatron compatibility; the running loop is used
        self._monitor_task = asyncio.create_task(
            self._watch_monitor(), name="dpserve-client-monitor"
        )
        self.socket.connect(self.address)
        self.listener_task = asyncio.create_task(self._recv_task(), name="dpserve-client-listener")
        try:
            await self._complete_handshake()
        except BaseException:
            self.stop()
            raise
        self._heartbeat_task = asyncio.create_task(
            self._heartbeat(), name="dpserve-client-heartbeat"
        )

    async def _complete_handshake(self) -> None:
        """Wait for CONNECT_ACK: patiently while nothing listens at the address yet, for
        ``handshake_timeout`` once connected, not at all once the handshake was refused."""
        loop = asyncio.get_running_loop()
        handshake = self._connect_with_inference_coordinator()
        started = loop.time()
        connected_since: float | None = None
        next_note = started + min(self.handshake_timeout, _WAITING_NOTE_EVERY)
        while not handshake.done():
            if self._refusal is not None:
                raise self._refusal
            now = loop.time()
            if not self._watch.connected:
                connected_since = None
                if now - started >= self.startup_timeout:
                    raise CoordinatorUnavailable(
                        f"nothing is listening at {self.address} after "
                        f"{self.startup_timeout:g} s (is the coordinator running?)"
                    )
                if now >= next_note:
                    log.warning(
                        "waiting for the coordinator at %s: nothing listening yet after %.0f s "
                        "(still starting?)",
                        self.address,
                        now - started,
                    )
                    next_note = now + _WAITING_NOTE_EVERY
                wake = min(next_note, started + self.startup_timeout)
            else:
                connected_since = connected_since or now
                if now - connected_since >= self.handshake_timeout:
                    raise CoordinatorUnavailable(
                        f"connected to {self.address}, but no answer to the handshake within "
                        f"{self.handshake_timeout:g} s (is it a dpserve coordinator?)"
                    )
                wake = connected_since + self.handshake_timeout
            self._handshake_news.clear()
            news = asyncio.ensure_future(self._handshake_news.wait())
            try:
                await asyncio.wait(
                    {handshake, news},
                    timeout=max(0.0, wake - now),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                news.cancel()

    async def _watch_monitor(self) -> None:
        """Follow the socket's connection events; a refused handshake fails everything now
        (and new requests at once) instead of leaving them to wait for an answer."""
        while True:
            frames = await self._monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
                refusal = self._watch.observe(event["event"], event["value"])
            except Exception:  # a surprise here must not leave start() waiting blind
                log.exception("cannot interpret a socket monitor event")
                continue
            if self._watch.succeeded:
                self._refusal = None
            self._handshake_news.set()
            if refusal is not None and self._refusal is None:
                self._refusal = CoordinatorRefused(refusal)
                if self.coordinator_instance is not None:  # refused after a restart
                    log.error("%s", refusal)
                    self._fail_everything(RequestFailed("refused", refusal))

    def _connect_with_inference_coordinator(self) -> asyncio.Future:
        """Send CONNECT; the returned future resolves on CONNECT_ACK."""
        self._handshake = asyncio.get_running_loop().create_future()
        self._send(protocol.encode(Header.CONNECT, protocol.PROTOCOL_VERSION))
        return self._handshake

    def stop(self) -> None:
        """Close everything; every pending request and control call fails with ClientStopped."""
        if self._stopped:
            return
        self._stopped = True
        for task in (self.listener_task, self._heartbeat_task, self._monitor_task):
            if task is not None:
                task.cancel()
        self._fail_everything(ClientStopped("the client was stopped"))
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)
        self.context.term()

    def _fail_everything(self, error: Exception) -> None:
        for pending in self._pending.values():
            self._fail_pending(pending, error)
        self._pending.clear()
        self.completion_futures.clear()
        for future in self._controls.values():
            if not future.done():
                future.set_exception(error)
        self._controls.clear()

    async def __aenter__(self) -> InferenceClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------- requests

    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> asyncio.Future:
        """Submit a request; the future resolves to a ``RequestRecord`` or raises
        ``RequestFailed``. A prompt is text, token ids, or chat messages
        (``[{"role": ..., "content": ...}]``, rendered with the model's chat template)."""
        return self._submit(prompt, sampling_params or SamplingParams(), stream=False).future

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> RequestStream:
        """Submit a streaming request: ``async for chunk in client.stream(...)`` yields tokens
        and text as the engine produces them; ``.future`` resolves to the ``RequestRecord``."""
        return RequestStream(self._submit(prompt, sampling_params or SamplingParams(), True))

    def _submit(self, prompt: Prompt, params: SamplingParams, stream: bool) -> PendingRequest:
        if self._stopped:
            raise ClientStopped("the client was stopped")
        if self._refusal is not None:
            raise self._refusal
        if self.listener_task is None:
            raise ClientError("call await client.start() before submitting requests")
        if stream != params.stream:
            params = dataclasses.replace(params, stream=stream)
        request_id = self._new_id()
        wire_prompt, wire_params, payload = self._encode_submit(request_id, prompt, params)
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f, rid=request_id: self._on_future_done(rid, f))
        pending = PendingRequest(
            wire_prompt,
            wire_params,
            future,
            time.monotonic(),
            asyncio.Queue() if stream else None,
            received=bytearray() if stream else None,
        )
        self._pending[request_id] = pending
        self.completion_futures[request_id] = future
        self._send(payload)
        return pending

    def _encode_submit(
        self, request_id: int, prompt: Prompt, params: SamplingParams
    ) -> tuple[str | bytes | list, dict, bytes]:
        """The request's wire prompt, parameters and SUBMIT_REQUEST message; raises
        ``InvalidRequest`` for what could never be sent (so a resubmission cannot fail)."""
        try:
            if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
                wire_prompt: str | bytes | list = prompt
            else:
                wire_prompt = protocol.pack_tokens(prompt)
            wire_params = cached_wire_params(params)
            payload = protocol.encode(Header.SUBMIT_REQUEST, request_id, wire_prompt, wire_params)
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                f"the request holds text that is not valid Unicode ({exc.reason}: "
                f"{exc.object[exc.start : exc.end]!r}); it cannot be encoded as UTF-8"
            ) from None
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"the request cannot be encoded: {exc}") from None
        if len(payload) > self.max_message_bytes:
            raise InvalidRequest(
                f"the request encodes to {len(payload)} bytes, over the message limit of "
                f"{self.max_message_bytes} bytes (max_message_bytes); send a shorter prompt"
            )
        return wire_prompt, wire_params, payload

    def _resubmit(self, request_id: int, pending: PendingRequest) -> None:
        """Send a pending request again (to a restarted coordinator), with the tokens its
        stream already delivered as resume tokens."""
        fields: list[Any] = [request_id, pending.prompt, pending.params]
        if pending.received:
            fields.append(bytes(pending.received))
        payload = protocol.encode(Header.SUBMIT_REQUEST, *fields)
        if len(payload) > self.max_message_bytes:
            self._pending.pop(request_id, None)
            self.completion_futures.pop(request_id, None)
            self._fail_pending(
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

    def _on_future_done(self, request_id: int, future: asyncio.Future) -> None:
        # A caller that cancels its future no longer wants the work done.
        if future.cancelled() and self._pending.pop(request_id, None) is not None:
            self.completion_futures.pop(request_id, None)
            if not self._stopped:
                self._send(protocol.encode(Header.CANCEL, request_id))

    def _new_id(self) -> int:
        self.next_request_id += 1
        return self.next_request_id

    def _send(self, payload: bytes) -> None:
        self._sync_socket.send(payload, zmq.NOBLOCK)  # never waits: no send high-water mark
        # ZMQ's descriptor is edge-triggered: a send can consume the wake-up for input that
        # arrived meanwhile. Look for such input once per loop turn, after a burst of sends.
        if not self._recheck_scheduled:
            self._recheck_scheduled = True
            asyncio.get_running_loop().call_soon(self._recheck_input)

    def _recheck_input(self) -> None:
        self._recheck_scheduled = False
        if not self._stopped and self._sync_socket.get(zmq.EVENTS) & zmq.POLLIN:
            self._drain()

    # ------------------------------------------------------------ control signals

    def _send_signal_to_engines(self, signal: Header) -> asyncio.Future:
        """Send a control signal; the future resolves when every engine acknowledged it."""
        if self._stopped:
            raise ClientStopped("the client was stopped")
        control_id = self._new_id()
        future = asyncio.get_running_loop().create_future()
        self._controls[control_id] = future
        self._send(protocol.encode(signal, control_id))
        return future

    def pause_engines(self) -> asyncio.Future:
        return self._send_signal_to_engines(Header.PAUSE)

    def unpause_engines(self) -> asyncio.Future:
        return self._send_signal_to_engines(Header.UNPAUSE)

    def suspend_engines(self) -> asyncio.Future:
        """Pause-and-release: engines free the model's and KV cache's memory."""
        return self._send_signal_to_engines(Header.SUSPEND)

    def resume_engines(self) -> asyncio.Future:
        """Reload what ``suspend_engines`` released; engines stay paused until unpaused."""
        return self._send_signal_to_engines(Header.RESUME)

    def stop_engines(self) -> asyncio.Future:
        return self._send_signal_to_engines(Header.STOP)

    def get_status(self) -> asyncio.Future:
        """The coordinator's status: engines, their load, queue, state, counters."""
        if self._stopped:
            raise ClientStopped("the client was stopped")
        query_id = self._new_id()
        future = asyncio.get_running_loop().create_future()
        self._controls[query_id] = future
        self._send(protocol.encode(Header.STATUS, query_id))
        return future

    # ------------------------------------------------------------------- listener

    async def _recv_task(self) -> None:
        """Wait for input in the event loop, then handle everything already waiting."""
        while True:
            await self.socket.poll(flags=zmq.POLLIN)
            self._drain()

    def _drain(self) -> None:
        recv = self._sync_socket.recv
        try:
            while True:
                payload = recv(zmq.NOBLOCK)
                try:
                    self._handle(payload)
                except ProtocolError as exc:
                    log.warning("ignoring a malformed message from the coordinator: %s", exc)
        except zmq.Again:
            pass

    def _handle(self, payload: bytes) -> None:
        header, fields = protocol.decode(payload)
        if header is Header.RESULTS:
            self._on_results(fields[0])
        elif header is Header.STREAM:
            self._on_stream(fields[0])
        elif header is Header.ERROR:
            self._on_error(*fields)
        elif header is Header.CONTROL_ACK:
            _signal, control_id = fields
            self._resolve_control(control_id, None)
        elif header is Header.STATUS_REPLY:
            query_id, status = fields
            self._resolve_control(query_id, status)
        elif header is Header.HEARTBEAT_ACK:
            if self.coordinator_instance not in (None, fields[0]):
                self._reconnect("the coordinator restarted")
        elif header is Header.CONNECT_ACK:
            self._on_connect_ack(fields[0])
        else:
            raise ProtocolError(f"unexpected {header.name} for a client")

    def _on_connect_ack(self, instance: str) -> None:
        restarted = self.coordinator_instance is not None and instance != self.coordinator_instance
        self.coordinator_instance = instance
        if self._handshake is not None and not self._handshake.done():
            self._handshake.set_result(instance)
        if self._reconnecting or restarted:
            self._reconnecting = False
            # The new coordinator knows nothing of signals or queries sent to the old one.
            for future in self._controls.values():
                if not future.done():
                    future.set_exception(
                        RequestFailed("coordinator_restarted", "the coordinator restarted; retry")
                    )
            self._controls.clear()
            log.info(
                "reconnected to coordinator %s; resubmitting %d request(s)",
                instance,
                len(self._pending),
            )
            for request_id, pending in list(self._pending.items()):
                self._resubmit(request_id, pending)

    def _reconnect(self, why: str) -> None:
        if self._reconnecting or self._stopped:
            return
        log.warning("%s: connecting again", why)
        self._reconnecting = True
        self._send(protocol.encode(Header.CONNECT, protocol.PROTOCOL_VERSION))

    async def _heartbeat(self) -> None:
        # Lets the client notice a restarted coordinator even while it is only waiting.
        payload = protocol.encode(Header.HEARTBEAT, 0)
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self._reconnecting:
                self._send(protocol.encode(Header.CONNECT, protocol.PROTOCOL_VERSION))
            else:
                self._send(payload)

    def _on_results(self, results: list) -> None:
        protocol.check_records("RESULTS record", results, protocol.CLIENT_RESULT_FIELDS)
        now = time.monotonic()
        for request_id, prompt, tokens, text, reason, logprobs, ttft, rank in results:
            pending = self._pending.pop(request_id, None)
            if pending is None:
                continue  # a duplicate from a resubmission, or cancelled
            self.completion_futures.pop(request_id, None)
            record = RequestRecord(
                request_id=request_id,
                prompt_tokens=protocol.unpack_tokens(prompt),
                generated_tokens=protocol.unpack_tokens(tokens),
                generated_text=text,
                finish_reason=reason,
                log_probs=None if logprobs is None else protocol.unpack_floats(logprobs),
                ttft=ttft
                if pending.first_token_at is None
                else pending.first_token_at - pending.submitted_at,
                latency=now - pending.submitted_at,
                engine_rank=rank,
            )
            if not pending.future.done():
                pending.future.set_result(record)

    def _on_stream(self, chunks: list) -> None:
        protocol.check_records("STREAM chunk", chunks, protocol.STREAM_CHUNK_FIELDS)
        for request_id, tokens, text in chunks:
            pending = self._pending.get(request_id)
            if pending is None or pending.chunks is None:
                continue
            if pending.first_token_at is None:
                pending.first_token_at = time.monotonic()
            if pending.received is not None:
                pending.received += tokens
            pending.chunks.put_nowait(StreamChunk(protocol.unpack_tokens(tokens), text))

    def _on_error(self, ref: int | None, code: str, message: str) -> None:
        if code == ErrorCode.UNKNOWN_PEER:
            # The coordinator does not know us: it restarted. Our requests are resubmitted
            # once the new handshake completes, so nothing fails here.
            self._reconnect("the coordinator does not know this client")
            return
        if ref is None:
            log.warning("coordinator error: %s: %s", code, message)
            return
        pending = self._pending.pop(ref, None)
        if pending is not None:
            self.completion_futures.pop(ref, None)
            self._fail_pending(pending, RequestFailed(code, message))
            return
        control = self._controls.pop(ref, None)
        if control is not None and not control.done():
            control.set_exception(RequestFailed(code, message))

    def _resolve_control(self, control_id: int, value: Any) -> None:
        future = self._controls.pop(control_id, None)
        if future is not None and not future.done():
            future.set_result(value)

    @staticmethod
    def _fail_pending(pending: PendingRequest, error: Exception) -> None:
        if not pending.future.done():
            pending.future.set_exception(error)
        # Nobody may be awaiting a failed future; mark it retrieved to keep asyncio quiet.
        with contextlib.suppress(BaseException):
            pending.future.exception()


__all__ = [
    "ClientError",
    "ClientStopped",
    "CoordinatorRefused",
    "CoordinatorUnavailable",
    "InferenceClient",
    "InvalidRequest",
    "Prompt",
    "RequestFailed",
    "RequestRecord",
    "RequestStream",
    "StreamChunk",
    "coordinator_address",
]
