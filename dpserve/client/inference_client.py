"""``InferenceClient``: an asyncio DEALER client for the coordinator (Megatron-Core's API).

It holds a ``ClientConnection`` (the socket, its handshake watch), a ``PendingTable``
(requests and control calls awaiting answers) and a ``CoordinatorSession`` (handshake,
heartbeats, restarts), and dispatches the coordinator's messages between them. After a restart
it fails the control calls the old coordinator had and resubmits every pending request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from dpserve import protocol
from dpserve.client.connection import ClientConnection
from dpserve.client.pending import PendingTable
from dpserve.client.records import (
    ClientError,
    ClientStopped,
    CoordinatorRefused,
    PendingRequest,
    Prompt,
    RequestFailed,
    RequestRecord,
    RequestStream,
    coordinator_address,
)
from dpserve.client.session import CoordinatorSession
from dpserve.limits import DEFAULT_REQUEST_LIMITS
from dpserve.protocol import (
    AdapterAck,
    ConnectAck,
    ControlAck,
    Error,
    ErrorCode,
    Header,
    HeartbeatAck,
    LoadAdapter,
    ProtocolError,
    Status,
    StatusReply,
    UnloadAdapter,
)
from dpserve.sampling import SamplingParams, check_lora_name
from dpserve.security import key_files

log = logging.getLogger("dpserve.client")


class InferenceClient:
    def __init__(
        self,
        inference_coordinator_port: int | str,
        *,
        handshake_timeout: float = 10.0,
        startup_timeout: float = 120.0,
        heartbeat_interval: float = 0.5,
        credentials: key_files.PeerKeys | str | os.PathLike[str] | None = None,
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
        # Loaded before any socket exists: a bad directory raises without leaking a context.
        self.keys = None if credentials is None else key_files.as_peer_keys(credentials, None)
        self.handshake_timeout = handshake_timeout
        self.startup_timeout = startup_timeout
        self.heartbeat_interval = heartbeat_interval
        self._connection = ClientConnection(self.address, self.keys, self._handle, self._on_refused)
        self.context = self._connection.context
        self.socket = self._connection.socket
        self._send = self._connection.send
        self._table = PendingTable(self._send, max_message_bytes, self._connection.send_submit)
        self.completion_futures = self._table.futures
        self._session = CoordinatorSession(self._send, self._on_restarted)
        self.listener_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._stopped = False
        # One handler per message header, called with the message's record.
        self._handlers: dict[Header, Callable[[Any], None]] = {
            Header.RESULTS: self._table.on_results,
            Header.STREAM: self._table.on_stream,
            Header.ERROR: self._on_error,
            Header.CONTROL_ACK: self._on_control_ack,
            Header.ADAPTER_ACK: self._on_adapter_ack,
            Header.STATUS_REPLY: self._on_status_reply,
            Header.HEARTBEAT_ACK: self._on_heartbeat_ack,
            Header.CONNECT_ACK: self._on_connect_ack,
        }

    @property
    def max_message_bytes(self) -> int:
        return self._table.max_message_bytes

    @property
    def coordinator_instance(self) -> str | None:
        """The coordinator's instance id, once it answered the handshake."""
        return self._session.instance

    @property
    def next_request_id(self) -> int:
        """The last id handed to a request or control call."""
        return self._table.next_id

    # ------------------------------------------------------------------ lifecycle

    async def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Connect, complete the handshake (or raise ``CoordinatorUnavailable``, or
        ``CoordinatorRefused`` at once for refused credentials) and start the listener."""
        del loop  # accepted for Megatron compatibility; the running loop is used
        self.listener_task = self._connection.connect()
        try:
            await self._connection.wait_for_handshake(
                self._session.connect(),
                self.startup_timeout,
                self.handshake_timeout,
            )
        except BaseException:
            self.stop()
            raise
        self._heartbeat_task = asyncio.create_task(
            self._session.heartbeat(self.heartbeat_interval), name="dpserve-client-heartbeat"
        )

    def _on_refused(self, refusal: CoordinatorRefused) -> None:
        # A refusal fails everything now (and new requests at once) instead of leaving them
        # to wait for an answer; before the first handshake, start() raises it.
        if self.coordinator_instance is not None:  # refused after a restart
            log.error("%s", refusal)
            self._table.fail_everything(RequestFailed("refused", str(refusal)))

    def stop(self) -> None:
        """Close everything; every pending request and control call fails with ClientStopped."""
        if self._stopped:
            return
        self._stopped = True
        self._table.closed = self._session.closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        self._table.fail_everything(ClientStopped("the client was stopped"))
        self._connection.close()

    async def __aenter__(self) -> InferenceClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------- requests

    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> asyncio.Future[RequestRecord]:
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
        if self._connection.refusal is not None:
            raise self._connection.refusal
        if self.listener_task is None:
            raise ClientError("call await client.start() before submitting requests")
        if stream != params.stream:
            params = dataclasses.replace(params, stream=stream)
        return self._table.submit(prompt, params)

    # ------------------------------------------------------------ control signals

    def _send_signal_to_engines(self, signal: Header) -> asyncio.Future[None]:
        """Send a control signal; the future resolves when every engine acknowledged it."""
        return self._control_call(protocol.RECORDS[signal])

    def _control_call(self, record: Callable[[int], Any]) -> asyncio.Future[Any]:
        """Send ``record(control_id)`` with a new control id; the future resolves with its
        answer."""
        if self._stopped:
            raise ClientStopped("the client was stopped")
        return self._table.add_control(lambda control_id: protocol.encode(record(control_id)))

    def pause_engines(self) -> asyncio.Future[None]:
        return self._send_signal_to_engines(Header.PAUSE)

    def unpause_engines(self) -> asyncio.Future[None]:
        return self._send_signal_to_engines(Header.UNPAUSE)

    def suspend_engines(self) -> asyncio.Future[None]:
        """Pause-and-release: engines free the model's and KV cache's memory."""
        return self._send_signal_to_engines(Header.SUSPEND)

    def resume_engines(self) -> asyncio.Future[None]:
        """Reload what ``suspend_engines`` released; engines stay paused until unpaused."""
        return self._send_signal_to_engines(Header.RESUME)

    def stop_engines(self) -> asyncio.Future[None]:
        return self._send_signal_to_engines(Header.STOP)

    def get_status(self) -> asyncio.Future[dict[str, Any]]:
        """The coordinator's status: engines, their load, queue, state, counters."""
        return self._control_call(Status)

    # ----------------------------------------------------------- LoRA adapters

    def load_lora_adapter(self, name: str, path: str) -> asyncio.Future[str | None]:
        """Load LoRA adapter ``name`` from the PEFT directory ``path`` (as the engines see it)
        on every engine, and on engines that register later; requests then run with it when
        their ``SamplingParams.lora_name`` is ``name``. The future resolves to None when every
        engine loaded it, else to the engines' errors (each naming its rank)."""
        check_lora_name(name)
        return self._control_call(lambda control_id: LoadAdapter(control_id, name, path))

    def unload_lora_adapter(self, name: str) -> asyncio.Future[str | None]:
        """Unload adapter ``name`` from every engine; resolves as ``load_lora_adapter``."""
        check_lora_name(name)
        return self._control_call(lambda control_id: UnloadAdapter(control_id, name))

    # ------------------------------------------------------------------- listener

    def _handle(self, payload: bytes) -> None:
        """Run the handler of a message's header with its record."""
        record = protocol.decode(payload)
        handler = self._handlers.get(protocol.header_of(record))
        if handler is None:
            raise ProtocolError(f"unexpected {protocol.header_of(record).name} for a client")
        handler(record)

    def _on_control_ack(self, ack: ControlAck) -> None:
        self._table.resolve_control(ack.control_id, None)

    def _on_adapter_ack(self, ack: AdapterAck) -> None:
        self._table.resolve_control(ack.control_id, ack.error)

    def _on_status_reply(self, reply: StatusReply) -> None:
        self._table.resolve_control(reply.query_id, reply.status)

    def _on_heartbeat_ack(self, ack: HeartbeatAck) -> None:
        self._session.on_heartbeat_ack(ack.instance)

    def _on_connect_ack(self, ack: ConnectAck) -> None:
        self._connection.submit_batch_bytes = min(ack.submit_batch_bytes, self.max_message_bytes)
        self._session.on_connect_ack(ack.instance)

    def _on_restarted(self, instance: str) -> None:
        # The new coordinator knows nothing of signals or queries sent to the old one.
        self._table.fail_controls(
            RequestFailed("coordinator_restarted", "the coordinator restarted; retry")
        )
        log.info(
            "reconnected to coordinator %s; resubmitting %d request(s)",
            instance,
            len(self._table.requests),
        )
        self._table.resubmit_all()

    def _on_error(self, error: Error) -> None:
        ref, code, message = error.ref, error.code, error.message
        if code == ErrorCode.UNKNOWN_PEER:
            # The coordinator does not know us: it restarted. Our requests are resubmitted
            # once the new handshake completes, so nothing fails here.
            self._session.reconnect("the coordinator does not know this client")
            return
        if ref is None:
            log.warning("coordinator error: %s: %s", code, message)
            return
        self._table.fail(ref, RequestFailed(code, message))
