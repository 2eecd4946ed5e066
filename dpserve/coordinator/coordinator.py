"""``DataParallelInferenceCoordinator``: the ROUTER socket between clients and engines.

One thread, one socket. The loop waits once (poll), then drains every message already waiting
and handles them as a batch: submits are tokenized in one tokenizer call and finished results
detokenized in one call, and each client gets one RESULTS message per batch. That is what keeps
a Python loop at tens of thousands of messages per second.

Nothing a peer sends can stop the loop: every message is checked by ``protocol.decode`` and
handled inside one ``try``; bad input is logged (rate limited) and answered with an ERROR when
the sender is a known client.

With credentials the socket is a CURVE server (``dpserve.security``): only allowed keys connect,
and each message is checked against its connection's role before its handler runs. Without
them the loop is exactly the plain one: no per-message metadata is read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from dpserve import protocol, security
from dpserve.coordinator.control import (
    ControlOperation,
    ControlState,
    InvalidTransition,
    next_state,
)
from dpserve.coordinator.registry import Client, Engine, EngineRegistry
from dpserve.coordinator.requests import InflightRequest, RequestTable
from dpserve.coordinator.routing import RoutingPolicy, choose_engine
from dpserve.limits import DEFAULT_ADMISSION_LIMITS, DEFAULT_REQUEST_LIMITS
from dpserve.protocol import ErrorCode, Header, MessageTooLarge, ProtocolError
from dpserve.sampling import InvalidSamplingParams, SamplingParams
from dpserve.tokenizer import as_batch_tokenizer

log = logging.getLogger("dpserve.coordinator")

_MAX_BATCH = 4096  # messages handled per loop turn, so timers still run under a flood
_LOG_EVERY = 1000  # after the first few, log one bad message in this many
# libzmq reads messages up to this multiple of the message limit, so that the coordinator can
# refuse one in-band (an ERROR naming the request); a larger one makes libzmq drop the
# connection before buffering it, which bounds the memory one peer can make us allocate.
_TRANSPORT_CEILING_FACTOR = 4


class DataParallelInferenceCoordinator:
    """Registers data-parallel engines, accepts clients, routes requests and results, and
    relays control signals. Same constructor and methods as Megatron-Core's class."""

    def __init__(
        self,
        pipe_connection: Connection | None,
        data_parallel_size: int,
        tokenizer: Any,
        inference_coordinator_port: int | None = None,
        deterministic_mode: bool = False,
        *,
        host: str = "127.0.0.1",
        routing: RoutingPolicy | str | None = None,
        heartbeat_timeout: float = 5.0,
        engine_hung_timeout: float = 120.0,
        queue_timeout: float = DEFAULT_ADMISSION_LIMITS.queue_timeout,
        max_queued_requests: int = DEFAULT_ADMISSION_LIMITS.max_queued_requests,
        max_inflight_requests: int = DEFAULT_ADMISSION_LIMITS.max_inflight_requests,
        max_message_bytes: int = DEFAULT_REQUEST_LIMITS.max_message_bytes,
        engine_wait_timeout: float | None = None,
        max_inflight_per_client: int = DEFAULT_ADMISSION_LIMITS.max_inflight_per_client,
        max_prompt_tokens: int = DEFAULT_REQUEST_LIMITS.max_prompt_tokens,
        max_prompt_chars: int = DEFAULT_REQUEST_LIMITS.max_prompt_chars,
        max_dispatch_attempts: int = DEFAULT_ADMISSION_LIMITS.max_dispatch_attempts,
        credentials: security.ServerKeys | str | os.PathLike[str] | None = None,
    ) -> None:
        self.pipe_connection = pipe_connection
        self.data_parallel_size = data_parallel_size
        self.tokenizer = as_batch_tokenizer(tokenizer)
        self.deterministic_mode = deterministic_mode
        self.routing = RoutingPolicy(
            routing
            or (
                RoutingPolicy.ROUND_ROBIN if deterministic_mode else RoutingPolicy.LEAST_OUTSTANDING
            )
        )
        self.heartbeat_timeout = heartbeat_timeout
        self.engine_hung_timeout = engine_hung_timeout
        self.queue_timeout = queue_timeout
        self.max_queued_requests = max_queued_requests
        self.max_inflight_requests = max_inflight_requests
        self.max_message_bytes = max_message_bytes
        self.max_inflight_per_client = max_inflight_per_client
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_chars = max_prompt_chars
        self.max_dispatch_attempts = max_dispatch_attempts

        # Engines and clients tell a restarted coordinator from the old one by this id.
        self.instance_id = secrets.token_hex(8)
        self.registry = EngineRegistry()
        self.clients: dict[bytes, Client] = {}
        # Start ids at a random offset: replies an engine still sends for a previous
        # coordinator's requests can then never match one of ours.
        self.requests = RequestTable(first_id=secrets.randbits(40))
        self.state = ControlState.RUNNING
        self.control: ControlOperation | None = None
        self.counters: dict[str, int] = defaultdict(int)
        self._running = False
        self._closed = False

        keys = None if credentials is None else security.as_server_keys(credentials)
        self.context = zmq.Context()
        self.router_socket = self.context.socket(zmq.ROUTER)
        # Report unroutable sends (a client that vanished) instead of dropping them silently,
        # and never drop a reply at a high-water mark: admission control bounds memory.
        self.router_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router_socket.setsockopt(zmq.SNDHWM, 0)
        self.router_socket.setsockopt(zmq.RCVHWM, 0)
        self.router_socket.setsockopt(zmq.LINGER, 0)
        self.router_socket.setsockopt(zmq.MAXMSGSIZE, _TRANSPORT_CEILING_FACTOR * max_message_bytes)
        # libzmq's own heartbeats run in its I/O thread, so they keep the connection of an
        # engine that is merely busy (a long prefill holds its Python loop) and drop one whose
        # process froze or whose host vanished; sending to a dropped peer then fails
        # (ROUTER_MANDATORY), which is how _on_tick tells dead from busy.
        self.router_socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.router_socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        # How a drained batch is received and handled: plain, or with each message's role.
        self.authenticator: security.RoleAuthenticator | None = None
        self._receive: Callable[[], list] = self._drain
        if keys is not None:
            self._use_curve(keys)
        elif not security.is_loopback(host):
            log.warning(
                "coordinator bound to %s WITHOUT credentials: anyone who can reach the port "
                "can submit work, register as an engine and stop every engine",
                host,
            )
        try:
            if inference_coordinator_port:
                self.router_socket.bind(f"tcp://{host}:{inference_coordinator_port}")
                self.inference_coordinator_port = inference_coordinator_port
            else:
                self.inference_coordinator_port = self.router_socket.bind_to_random_port(
                    f"tcp://{host}"
                )
        except zmq.ZMQError:
            self.stop()  # the authenticator's thread and the context must not outlive us
            raise
        self.poller = zmq.Poller()
        self.poller.register(self.router_socket, zmq.POLLIN)
        if pipe_connection is not None:
            # The parent closing its end (or dying) stops us: no orphaned coordinator.
            self.poller.register(pipe_connection.fileno(), zmq.POLLIN)

        self._handlers: dict[Header, Callable[[bytes, list], None]] = {
            Header.CONNECT: self._on_connect,
            Header.REGISTER: self._on_register,
            Header.HEARTBEAT: self._on_heartbeat,
            Header.DRAIN: self._on_drain,
            Header.DEREGISTER: self._on_deregister,
            Header.SUBMIT_REQUEST: self._on_submit,
            Header.ENGINE_REPLY: self._on_engine_reply,
            Header.CANCEL: self._on_cancel,
            Header.CONTROL_ACK: self._on_control_ack,
            Header.STATUS: self._on_status,
        }
        for signal_header in protocol.CONTROL_SIGNALS:
            self._handlers[signal_header] = functools.partial(
                self._on_control_signal, signal_header
            )
        # Per-batch buffers, flushed after each drained batch.
        self._submits: list[InflightRequest] = []
        self._string_prompts: list[tuple[InflightRequest, str]] = []
        self._finished: list[InflightRequest] = []
        self._streaming: list[tuple[InflightRequest, bytes]] = []
        self._finish_info: dict[int, tuple[str, float | None, int]] = {}
        self._params_cache: dict[tuple, dict] = {}

        log.info(
            "coordinator %s listening on port %d (%s); waiting for %d engine(s)",
            self.instance_id,
            self.inference_coordinator_port,
            "CURVE" if self.authenticator else "plain ZMQ",
            data_parallel_size,
        )
        self._wait_for_engines(engine_wait_timeout)

    def _use_curve(self, keys: security.ServerKeys) -> None:
        """Admit only allowed keys (ZAP) and receive each message with its connection's role."""
        self.authenticator = security.secure_server(self.router_socket, keys)
        self._receive = functools.partial(
            security.receive_with_roles, self.router_socket, _MAX_BATCH
        )

    # ----------------------------------------------------------------- seed API

    @property
    def identities_of_data_parallel_ranks(self):
        """Routable engines in round-robin order (a deque of ZMQ identities)."""
        return self.registry.routable

    @property
    def request_id_to_client_id(self) -> dict[int, bytes]:
        return {rid: r.client for rid, r in self.requests.by_id.items()}

    @property
    def request_id_to_client_request_id(self) -> dict[int, int]:
        return {rid: r.client_request_id for rid, r in self.requests.by_id.items()}

    @property
    def next_request_id(self) -> int:
        return self.requests.next_request_id

    def get_next_data_parallel_rank(self) -> bytes | None:
        """The identity of the engine that gets the next request under the routing policy."""
        return choose_engine(self.registry, self.routing)

    def detokenize(self, finished_request_record: dict) -> dict:
        """Fill ``generated_text`` from ``generated_tokens`` in place (single-record form of
        the batched detokenization the loop uses)."""
        tokens = finished_request_record.get("generated_tokens") or []
        [finished_request_record["generated_text"]] = self.tokenizer.decode_batch([list(tokens)])
        return finished_request_record

    def start(self) -> None:
        """Serve until ``stop()``, SIGTERM, or the parent closing the pipe."""
        self._running = True
        try:
            while self._running:
                self._serve_once(self._poll_timeout_ms())
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the loop and release the socket and context (idempotent)."""
        self._running = False
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.router_socket.close(linger=0)
        if self.authenticator is not None:
            with contextlib.suppress(Exception):
                self.authenticator.stop()  # its sockets would keep context.term() waiting
        with contextlib.suppress(Exception):
            self.context.term()
        log.info("coordinator %s stopped", self.instance_id)

    @classmethod
    def entrypoint(
        cls,
        pipe_connection: Connection | None,
        ready_event: Any,
        data_parallel_size: int,
        tokenizer: Any,
        inference_coordinator_port: int | None = None,
        deterministic_mode: bool = False,
        **options: Any,
    ) -> None:
        """Run a coordinator in this (sub)process: construct, signal ``ready_event``, serve.
        When a pipe is given, the bound port is sent on it first."""
        coordinator = cls(
            pipe_connection,
            data_parallel_size,
            tokenizer,
            inference_coordinator_port,
            deterministic_mode,
            **options,
        )
        signal.signal(signal.SIGTERM, lambda *_: coordinator.request_stop())
        if pipe_connection is not None:
            pipe_connection.send(coordinator.inference_coordinator_port)
        if ready_event is not None:
            ready_event.set()
        coordinator.start()

    # ------------------------------------------------------------------- the loop

    def request_stop(self) -> None:
        """Ask the loop to stop after the current turn (safe from a signal handler)."""
        self._running = False

    def _wait_for_engines(self, timeout: float | None) -> None:
        """As the seed's constructor: block until ``data_parallel_size`` engines registered.
        Clients that connect meanwhile are served normally (their requests wait in the
        queue); only an explicit REGISTER counts as an engine."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._running = True
        while self._running and len(self.registry) < self.data_parallel_size:
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"only {len(self.registry)} of {self.data_parallel_size} engines "
                    f"registered within {timeout} s"
                )
            self._serve_once(self._poll_timeout_ms())

    def _poll_timeout_ms(self) -> int:
        # Wake up often enough for heartbeat expiry and queue timeouts; sleep long when idle.
        return 100 if (self.registry.engines or self.requests.queue) else 500

    def _serve_once(self, timeout_ms: int) -> None:
        events = dict(self.poller.poll(timeout_ms))
        if self.pipe_connection is not None and self.pipe_connection.fileno() in events:
            self._on_pipe()
        if self.router_socket in events:
            self._handle_batch(self._receive())
        self._on_tick(time.monotonic())

    def _on_pipe(self) -> None:
        try:
            message = self.pipe_connection.recv()  # type: ignore[union-attr]
        except (EOFError, OSError):
            message = "stop"
        if message == "stop":
            self._running = False

    def _drain(self) -> list[tuple[bytes, bytes | None, None]]:
        """Every message waiting on a plain socket, as ``(identity, payload, role=None)``;
        the payload is None when the message does not have exactly one frame after it."""
        batch = []
        recv = self.router_socket.recv_multipart
        try:
            while len(batch) < _MAX_BATCH:
                frames = recv(zmq.NOBLOCK)
                batch.append((frames[0], frames[1] if len(frames) == 2 else None, None))
        except zmq.Again:
            pass
        return batch

    def _handle_batch(self, batch: list[tuple[bytes, bytes | None, str | None]]) -> None:
        """Handle ``(identity, payload, role)`` messages. On a CURVE socket every message
        carries its connection's role, and one that role may not send is refused before any
        handler sees it; on a plain socket the role is None and nothing is checked."""
        decode, limit, permitted = protocol.decode, self.max_message_bytes, security.PERMITTED
        for identity, payload, role in batch:
            try:
                if payload is None:
                    raise ProtocolError("expected one frame after the identity")
                header, fields = decode(payload, limit)
                if role is None or header in permitted.get(role, ()):
                    self._handlers[header](identity, fields)
                else:
                    self._forbidden(identity, role, header, fields)
            except MessageTooLarge as exc:
                self._too_large(identity, exc)
            except ProtocolError as exc:
                self._bad_input(identity, str(exc))
            except Exception:  # a bug must not take the coordinator down with it
                log.exception("error handling a message from %r", identity)
        self._flush_submits()
        self._flush_results()

    def _forbidden(self, identity: bytes, role: str, header: Header, fields: list) -> None:
        ref, reason = security.forbidden(role, header, fields)
        count = self.counters["forbidden"] = self.counters["forbidden"] + 1
        if count <= 10 or count % _LOG_EVERY == 0:
            log.warning("refused message #%d from %r: %s", count, identity, reason)
        self._error(identity, ref, ErrorCode.FORBIDDEN, reason)

    def _on_tick(self, now: float) -> None:
        for engine in self.registry.silent_since(now - self.heartbeat_timeout):
            if now - engine.last_seen > self.engine_hung_timeout:
                log.warning(
                    "engine rank %d connected but silent for %.0f s: removing it as hung, "
                    "re-dispatching %d request(s)",
                    engine.rank,
                    now - engine.last_seen,
                    len(engine.outstanding),
                )
                self._remove_engine(engine, died=True)
            elif now - engine.last_probe >= 1.0:
                # Quiet past its heartbeats: dead, or busy in a long step. A send to a peer
                # whose connection libzmq dropped fails, and _send then removes it (and
                # re-dispatches its requests); a busy engine just ignores the probe.
                engine.last_probe = now
                self._send(engine.identity, protocol.encode(Header.HEARTBEAT_ACK, self.instance_id))
        queue = self.requests.queue
        if queue and self.registry.routable:
            self._dispatch_queued()
        while queue:
            request = self.requests.by_id.get(queue[0])
            if request is not None and request.engine is None:
                if now - request.received_at < self.queue_timeout:
                    break
                self._fail(
                    request,
                    ErrorCode.NO_ENGINE,
                    f"no engine became available within {self.queue_timeout:g} s",
                )
            queue.popleft()

    # ------------------------------------------------------------------- sending

    def _send(self, identity: bytes, payload: bytes) -> bool:
        """Send to one peer; a peer that vanished is forgotten, never fatal."""
        try:
            self.router_socket.send_multipart((identity, payload), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._peer_gone(identity)
                return False
            raise

    def _peer_gone(self, identity: bytes) -> None:
        engine = self.registry.get(identity)
        if engine is not None:
            log.warning("engine rank %d unreachable: removing it", engine.rank)
            self._remove_engine(engine, died=True)
        elif self.clients.pop(identity, None) is not None:
            self.counters["clients_vanished"] += 1
            dropped = self.requests.of_client(identity)
            log.info("client %r vanished; cancelling its %d request(s)", identity, len(dropped))
            for request in dropped:
                self._drop(request, cancel_on_engine=True)

    def _too_large(self, identity: bytes, exc: MessageTooLarge) -> None:
        """Refuse an oversized request by its id, so that its sender fails it at once."""
        if exc.header != Header.SUBMIT_REQUEST or identity not in self.clients:
            self._bad_input(identity, str(exc))
            return
        self.counters["too_large"] += 1
        self._error(
            identity,
            exc.reference,
            ErrorCode.MESSAGE_TOO_LARGE,
            f"the request's message has {exc.size} bytes; this coordinator accepts at most "
            f"{exc.limit} (--max-message-bytes)",
        )

    def _error(self, identity: bytes, ref: int | None, code: str, message: str) -> None:
        self._send(identity, protocol.encode(Header.ERROR, ref, code, message))

    def _bad_input(self, identity: bytes, reason: str) -> None:
        count = self.counters["bad_messages"] = self.counters["bad_messages"] + 1
        if count <= 10 or count % _LOG_EVERY == 0:
            log.warning("bad message #%d from %r: %s", count, identity, reason)
        if identity in self.clients:
            self._error(identity, None, ErrorCode.BAD_MESSAGE, reason)

    # -------------------------------------------------------- membership handlers

    def _on_connect(self, identity: bytes, fields: list) -> None:
        (version,) = fields
        if identity in self.registry:
            raise ProtocolError("an engine cannot connect as a client")
        if version != protocol.PROTOCOL_VERSION:
            self._send(
                identity,
                protocol.encode(
                    Header.ERROR,
                    None,
                    ErrorCode.BAD_MESSAGE,
                    f"protocol version {version} is not supported "
                    f"(this coordinator speaks {protocol.PROTOCOL_VERSION})",
                ),
            )
            return
        self.clients.setdefault(identity, Client(identity))
        self._send(
            identity,
            protocol.encode(Header.CONNECT_ACK, self.instance_id, protocol.PROTOCOL_VERSION),
        )

    def _on_register(self, identity: bytes, fields: list) -> None:
        rank, capacity, instance = fields
        if identity in self.clients:
            raise ProtocolError("a client cannot register as an engine")
        if capacity < 1:
            raise ProtocolError(f"engine capacity must be >= 1, got {capacity}")
        existing = self.registry.get(identity)
        if existing is not None:
            if existing.instance == instance:
                existing.last_seen = time.monotonic()  # a repeated REGISTER: just re-ack
                self._send(
                    identity, protocol.encode(Header.REGISTER_ACK, self.instance_id, self.state)
                )
                return
            # Same identity, new process: the old one died.
            self._remove_engine(existing, died=True)
        engine = Engine(identity, rank, capacity, instance, time.monotonic())
        self.registry.add(engine)
        log.info(
            "engine rank %d registered (capacity %d); %d engine(s)",
            rank,
            capacity,
            len(self.registry),
        )
        self._send(identity, protocol.encode(Header.REGISTER_ACK, self.instance_id, self.state))
        if self.control is not None:
            # It joined mid-operation: it must reach the same state before we answer.
            self.control.waiting_for.add(identity)
            self._send(identity, protocol.encode(self.control.signal, self.control.control_id))
        self._dispatch_queued()

    def _on_heartbeat(self, identity: bytes, fields: list) -> None:
        engine = self.registry.get(identity)
        if engine is not None:
            engine.last_seen = time.monotonic()
        elif identity not in self.clients:
            self._error(
                identity, None, ErrorCode.UNKNOWN_PEER, "unknown peer: connect or register first"
            )
            return
        self._send(identity, protocol.encode(Header.HEARTBEAT_ACK, self.instance_id))

    def _on_drain(self, identity: bytes, fields: list) -> None:
        engine = self._engine_or_reject(identity)
        self.registry.start_draining(engine)
        engine.last_seen = time.monotonic()
        log.info(
            "engine rank %d draining: no new work; %d request(s) left",
            engine.rank,
            len(engine.outstanding),
        )
        self._send(identity, protocol.encode(Header.DRAIN_ACK))

    def _on_deregister(self, identity: bytes, fields: list) -> None:
        engine = self._engine_or_reject(identity)
        log.info("engine rank %d left", engine.rank)
        self._remove_engine(engine, died=False)

    def _engine_or_reject(self, identity: bytes) -> Engine:
        engine = self.registry.get(identity)
        if engine is None:
            self._error(identity, None, ErrorCode.UNKNOWN_PEER, "unknown engine: register first")
            raise ProtocolError("message for registered engines from an unknown peer")
        return engine

    def _remove_engine(self, engine: Engine, died: bool) -> None:
        """Forget an engine; every request it held goes to the others, continuing after the
        tokens already streamed. When it ``died``, the death counts against each request it
        held that had not produced a token on it yet (one that had, survived its steps there),
        and a request with ``max_dispatch_attempts`` such deaths is failed instead: it is
        likely what kills them, and sending it on would take every engine down in turn."""
        self.registry.remove(engine.identity)
        if self.control is not None and engine.identity in self.control.waiting_for:
            self.control.waiting_for.discard(engine.identity)
            self._maybe_finish_control()
        orphans = [
            self.requests.by_id[rid] for rid in engine.outstanding if rid in self.requests.by_id
        ]
        engine.outstanding.clear()
        if orphans:
            self.counters["redispatched"] += len(orphans)
        for request in orphans:
            request.engine = None
            request.engines_died += died and not request.progressed
            if request.engines_died >= self.max_dispatch_attempts:
                self.counters["quarantined"] += 1
                log.warning(
                    "request %d was in flight on %d engines that died: failing it",
                    request.request_id,
                    request.engines_died,
                )
                self._fail(
                    request,
                    ErrorCode.QUARANTINED,
                    f"request was in flight on {request.engines_died} engines that died; "
                    "not retried",
                )
            else:
                self._dispatch(request)

    # ---------------------------------------------------------- request handlers

    def _on_submit(self, identity: bytes, fields: list) -> None:
        client_request_id, prompt, raw_params = fields
        client = self.clients.get(identity)
        if client is None:
            self._error(
                identity, client_request_id, ErrorCode.UNKNOWN_PEER, "connect before submitting"
            )
            return
        if self.requests.find(identity, client_request_id) is not None:
            return  # a resubmission (client reconnected) of a request we are already serving
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            self._error(
                identity,
                client_request_id,
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {len(prompt)} characters; this coordinator accepts at most "
                f"{self.max_prompt_chars}",
            )
            return
        if self.state is ControlState.STOPPED:
            self._error(identity, client_request_id, ErrorCode.STOPPED, "engines have been stopped")
            return
        if client.inflight >= self.max_inflight_per_client:
            self._error(
                identity,
                client_request_id,
                ErrorCode.OVERLOADED,
                f"this client has {client.inflight} requests in flight, the per-client cap "
                f"(--max-inflight-per-client {self.max_inflight_per_client})",
            )
            return
        if len(self.requests) >= self.max_inflight_requests:
            self._error(
                identity,
                client_request_id,
                ErrorCode.OVERLOADED,
                f"coordinator overloaded: {len(self.requests)} requests in flight "
                f"(--max-inflight-requests {self.max_inflight_requests})",
            )
            return
        try:
            params = self._validated_params(raw_params)
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                prompt = self.tokenizer.apply_chat_template(_chat_messages(prompt))
            prompt_tokens = self._prompt_bytes(prompt)
        except (InvalidSamplingParams, ProtocolError) as exc:
            self._error(identity, client_request_id, ErrorCode.BAD_REQUEST, str(exc))
            return
        request = InflightRequest(
            request_id=self.requests.new_id(),
            client=identity,
            client_request_id=client_request_id,
            prompt_tokens=prompt_tokens,
            params=params,
            stream=bool(params.get("stream")),
            received_at=time.monotonic(),
        )
        self.requests.add(request)
        client.inflight += 1
        if isinstance(prompt, str):
            self._string_prompts.append((request, prompt))
        self._submits.append(request)

    def _validated_params(self, raw: dict) -> dict:
        """Checked, normalized sampling parameters. Most clients send the same few parameter
        sets over and over, so results are memoized (validation dominated the submit path)."""
        try:
            key = tuple(raw.items())
            cached = self._params_cache.get(key)
        except TypeError:  # a list value (stop_strings) is not hashable: validate every time
            return SamplingParams.deserialize(raw).serialize()
        if cached is None:
            cached = SamplingParams.deserialize(raw).serialize()
            if len(self._params_cache) >= 1024:
                self._params_cache.clear()
            self._params_cache[key] = cached
        return cached

    @staticmethod
    def _prompt_bytes(prompt: str | bytes | list) -> bytes:
        if isinstance(prompt, str):
            return b""  # tokenized with the rest of the batch in _flush_submits
        if isinstance(prompt, list):
            if not all(type(t) is int and 0 <= t < 2**31 for t in prompt):
                raise ProtocolError("a token-list prompt must hold non-negative integers")
            prompt = protocol.pack_tokens(prompt)
        if not prompt or len(prompt) % 4:
            raise ProtocolError("a token prompt must be non-empty packed int32 tokens")
        return prompt

    def _flush_submits(self) -> None:
        if not self._submits:
            return
        if self._string_prompts:
            texts = [text for _, text in self._string_prompts]
            for (request, _), tokens in zip(
                self._string_prompts, self.tokenizer.encode_batch(texts), strict=True
            ):
                request.prompt_tokens = protocol.pack_tokens(tokens)
            self._string_prompts.clear()
        submits, self._submits = self._submits, []
        max_bytes = 4 * self.max_prompt_tokens  # packed int32 tokens
        for request in submits:
            if not request.prompt_tokens:
                self._fail(request, ErrorCode.BAD_REQUEST, "the prompt is empty after tokenization")
            elif len(request.prompt_tokens) > max_bytes:
                self._fail(
                    request,
                    ErrorCode.PROMPT_TOO_LONG,
                    f"the prompt has {len(request.prompt_tokens) // 4} tokens; this coordinator "
                    f"accepts at most {self.max_prompt_tokens} (--max-prompt-tokens)",
                )
            elif request.request_id in self.requests.by_id:
                self._dispatch(request)

    def _dispatch(self, request: InflightRequest) -> None:
        while True:
            identity = choose_engine(self.registry, self.routing)
            if identity is None:
                if len(self.requests.queue) >= self.max_queued_requests:
                    self._fail(
                        request,
                        ErrorCode.OVERLOADED,
                        "no engine available and the wait queue is full "
                        f"(--max-queued-requests {self.max_queued_requests})",
                    )
                else:
                    self.requests.queue.append(request.request_id)
                return
            payload = protocol.encode(
                Header.ENGINE_REQUEST,
                request.request_id,
                request.prompt_tokens,
                request.params,
                bytes(request.generated),
            )
            if not self._send(identity, payload):
                continue  # that engine vanished (_send removed it): the request never got there
            self.registry.engines[identity].outstanding.add(request.request_id)
            request.engine = identity
            request.progressed = False
            if request.dispatched_at is None:
                request.dispatched_at = time.monotonic()
            return

    def _dispatch_queued(self) -> None:
        queue = self.requests.queue
        while queue and self.registry.routable:
            request = self.requests.by_id.get(queue.popleft())
            if request is not None and request.engine is None:
                self._dispatch(request)

    def _on_engine_reply(self, identity: bytes, fields: list) -> None:
        engine = self._engine_or_reject(identity)
        engine.last_seen = time.monotonic()
        (updates,) = fields
        protocol.check_records("ENGINE_REPLY update", updates, protocol.ENGINE_UPDATE_FIELDS)
        by_id = self.requests.by_id
        for request_id, tokens, logprobs, finish_reason, error, ttft in updates:
            request = by_id.get(request_id)
            if request is None or request.engine != identity:
                self.counters["stale_replies"] += 1  # cancelled, or re-dispatched elsewhere
                continue
            if error is not None:
                engine.outstanding.discard(request_id)
                self._fail(request, finish_reason or ErrorCode.ENGINE_ERROR, error)
                continue
            if len(tokens) % 4:
                raise ProtocolError("packed tokens must be a multiple of 4 bytes")
            request.generated += tokens
            request.progressed = request.progressed or bool(tokens)
            if logprobs is not None:
                if request.logprobs is None:
                    request.logprobs = bytearray()
                request.logprobs += logprobs
            if finish_reason is not None:
                engine.outstanding.discard(request_id)
                queued_for = (request.dispatched_at or request.received_at) - request.received_at
                self._finish_info[request_id] = (
                    finish_reason,
                    None if ttft is None else queued_for + ttft,
                    engine.rank,
                )
                self._finished.append(request)
            elif request.stream and tokens:
                self._streaming.append((request, tokens))

    def _flush_results(self) -> None:
        if self._finished:
            self._flush_finished()
        if self._streaming:
            # After the finished ones: a request that finished in this batch gets its tokens
            # in RESULTS, and only live requests get STREAM chunks.
            self._flush_stream()

    def _flush_finished(self) -> None:
        finished, self._finished = self._finished, []
        texts = self.tokenizer.decode_batch([protocol.unpack_tokens(r.generated) for r in finished])
        per_client: dict[bytes, list] = defaultdict(list)
        for request, text in zip(finished, texts, strict=True):
            reason, ttft, rank = self._finish_info.pop(request.request_id)
            per_client[request.client].append(
                [
                    request.client_request_id,
                    request.prompt_tokens,
                    bytes(request.generated),
                    text,
                    reason,
                    None if request.logprobs is None else bytes(request.logprobs),
                    ttft,
                    rank,
                ]
            )
            self._forget(request)
        self.counters["completed"] += len(finished)
        for client, results in per_client.items():
            self._send(client, protocol.encode(Header.RESULTS, results))

    def _flush_stream(self) -> None:
        streaming, self._streaming = self._streaming, []
        live = [(r, t) for r, t in streaming if r.request_id in self.requests.by_id]
        texts = self.tokenizer.decode_batch([protocol.unpack_tokens(r.generated) for r, _ in live])
        per_client: dict[bytes, list] = defaultdict(list)
        for (request, tokens), text in zip(live, texts, strict=True):
            # Hold back a trailing replacement character: it is usually half a UTF-8 sequence
            # that the next tokens complete.
            stable = len(text.rstrip("\ufffd"))
            delta = text[request.text_sent : stable] if stable > request.text_sent else ""
            request.text_sent = max(request.text_sent, stable)
            per_client[request.client].append([request.client_request_id, tokens, delta])
        for client, chunks in per_client.items():
            self._send(client, protocol.encode(Header.STREAM, chunks))

    def _on_cancel(self, identity: bytes, fields: list) -> None:
        (client_request_id,) = fields
        request = self.requests.find(identity, client_request_id)
        if request is not None:
            self._drop(request, cancel_on_engine=True)

    def _fail(self, request: InflightRequest, code: str, message: str) -> None:
        self._forget(request)
        self.counters["failed"] += 1
        if request.client in self.clients:
            self._error(request.client, request.client_request_id, code, message)

    def _drop(self, request: InflightRequest, cancel_on_engine: bool) -> None:
        if cancel_on_engine and request.engine is not None and request.engine in self.registry:
            self.registry.engines[request.engine].outstanding.discard(request.request_id)
            self._send(request.engine, protocol.encode(Header.CANCEL, request.request_id))
        self._forget(request)

    def _forget(self, request: InflightRequest) -> None:
        if self.requests.pop(request.request_id) is None:
            return
        if request.engine is not None and (engine := self.registry.get(request.engine)):
            engine.outstanding.discard(request.request_id)
        client = self.clients.get(request.client)
        if client is not None:
            client.inflight -= 1

    # ----------------------------------------------------------- control signals

    def _on_control_signal(self, header: Header, identity: bytes, fields: list) -> None:
        (control_id,) = fields
        if identity not in self.clients:
            self._error(
                identity,
                control_id,
                ErrorCode.UNKNOWN_PEER,
                "connect before sending control signals",
            )
            return
        if self.control is not None:
            self._error(
                identity,
                control_id,
                ErrorCode.CONTROL_BUSY,
                f"{self.control.signal.name} is still waiting for engine acknowledgements",
            )
            return
        try:
            target = next_state(self.state, header)
        except InvalidTransition as exc:
            self._error(identity, control_id, ErrorCode.INVALID_TRANSITION, str(exc))
            return
        self.control = ControlOperation(
            header, control_id, identity, target, set(self.registry.engines)
        )
        payload = protocol.encode(header, control_id)
        for engine_identity in list(self.control.waiting_for):
            self._send(engine_identity, payload)
        self._maybe_finish_control()

    def _on_control_ack(self, identity: bytes, fields: list) -> None:
        engine = self._engine_or_reject(identity)
        engine.last_seen = time.monotonic()
        _signal, control_id = fields
        if self.control is None or control_id != self.control.control_id:
            return  # an acknowledgement that arrived after its engine was given up on
        self.control.waiting_for.discard(identity)
        self._maybe_finish_control()

    def _maybe_finish_control(self) -> None:
        control = self.control
        if control is None or not control.done:
            return
        self.control = None
        self.state = control.target
        log.info("engines %s", control.target.name)
        if control.target is ControlState.STOPPED:
            for request in list(self.requests.by_id.values()):
                self._fail(
                    request, ErrorCode.STOPPED, "engines were stopped before this request finished"
                )
        if control.requester in self.clients:
            self._send(
                control.requester,
                protocol.encode(Header.CONTROL_ACK, control.signal, control.control_id),
            )

    # --------------------------------------------------------------- introspection

    def status(self) -> dict[str, Any]:
        engines = self.registry.engines.values()
        counters = dict(self.counters)
        if self.authenticator is not None:
            counters["auth_denied"] = self.authenticator.denied
        return {
            "instance": self.instance_id,
            "state": self.state.name.lower(),
            "engines": len(self.registry),
            "draining": sum(1 for e in engines if e.draining),
            "engine_list": [
                {
                    "rank": e.rank,
                    "capacity": e.capacity,
                    "outstanding": len(e.outstanding),
                    "draining": e.draining,
                }
                for e in sorted(engines, key=lambda e: e.rank)
            ],
            "clients": len(self.clients),
            "inflight": len(self.requests),
            "queued": sum(1 for rid in self.requests.queue if rid in self.requests.by_id),
            "routing": self.routing.value,
            "pid": os.getpid(),
            "security": "curve" if self.authenticator is not None else "none",
            "limits": {
                "inflight_per_client": self.max_inflight_per_client,
                "inflight_requests": self.max_inflight_requests,
                "queued_requests": self.max_queued_requests,
                "message_bytes": self.max_message_bytes,
                "prompt_tokens": self.max_prompt_tokens,
                "prompt_chars": self.max_prompt_chars,
                "dispatch_attempts": self.max_dispatch_attempts,
            },
            "counters": counters,
        }

    def _on_status(self, identity: bytes, fields: list) -> None:
        (query_id,) = fields
        if identity not in self.clients:
            self._error(
                identity, query_id, ErrorCode.UNKNOWN_PEER, "connect before asking for status"
            )
            return
        self._send(identity, protocol.encode(Header.STATUS_REPLY, query_id, self.status()))


def _chat_messages(messages: list) -> list[dict[str, str]]:
    """Check a chat prompt: a list of ``{"role": str, "content": str}`` maps."""
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ProtocolError('a chat prompt is a list of {"role": str, "content": str} maps')
    return messages
