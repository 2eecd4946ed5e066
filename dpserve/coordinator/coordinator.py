"""``DataParallelInferenceCoordinator``: Megatron-Core's public face over the coordinator's parts.

One thread, one ROUTER socket. The loop waits once (poll), then drains every message already
waiting and handles them as a batch: one handler per message header (``_handlers``, the table
below; each gets the message's record from ``dpserve.protocol``), then the batch step: the
submits are tokenized in one call and sent, the finished results and stream chunks go out as
one RESULTS / STREAM message per client. That is what keeps a Python loop at tens of thousands
of messages per second.

The parts, one job each: ``config`` (settings and defaults), ``transport`` (socket, framing,
CURVE), ``admission`` (limits), ``requests`` (the request table), ``registry`` (the engines
and clients known), ``dispatch`` (routing, re-dispatch, quarantine), ``intake`` and
``results`` (the batch step), ``membership`` (handshakes, liveness, peers leaving),
``control`` (control signals) and ``status``. What they share (config, transport, the
registry, clients, requests, counters) is one ``SharedState``; a part that calls another gets
it at construction, in dependency order, so no callback is wired afterwards. A send that finds
a peer gone only notes it; the loop removes such peers after the turn's handlers returned.

Nothing a peer sends can stop the loop: every message is checked by ``protocol.decode`` and
handled inside one ``try``; bad input is logged (rate limited) and answered with an ERROR when
the sender is a known client. With credentials each message is checked against its
connection's role before its handler runs.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from dpserve import protocol
from dpserve.coordinator.adapters import AdapterRelay
from dpserve.coordinator.admission import Admission
from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.control import ControlRelay
from dpserve.coordinator.dispatch import Dispatcher
from dpserve.coordinator.intake import Intake
from dpserve.coordinator.membership import Membership
from dpserve.coordinator.refusals import Refusals
from dpserve.coordinator.registry import Engine
from dpserve.coordinator.requests import RequestTable
from dpserve.coordinator.results import ResultRouter
from dpserve.coordinator.routing import choose_engine
from dpserve.coordinator.shared import SharedState
from dpserve.coordinator.status import status_report
from dpserve.coordinator.transport import Received, Transport
from dpserve.protocol import ErrorCode, Header, MessageTooLarge, ProtocolError
from dpserve.security import roles
from dpserve.tokenizer import as_batch_tokenizer, with_chat_template

log = logging.getLogger("dpserve.coordinator")

Handler = Callable[[bytes, Any], None]
_Record = TypeVar("_Record")


class DataParallelInferenceCoordinator:
    """Registers data-parallel engines, accepts clients, routes requests and results, and
    relays control signals. Same constructor and methods as Megatron-Core's class; the
    settings beyond Megatron's are a ``CoordinatorConfig``, or its fields as keywords."""

    def __init__(
        self,
        pipe_connection: Connection | None,
        data_parallel_size: int,
        tokenizer: Any,
        inference_coordinator_port: int | None = None,
        deterministic_mode: bool = False,
        config: CoordinatorConfig | None = None,
        **options: Any,
    ) -> None:
        self.config = dataclasses.replace(config or CoordinatorConfig(), **options)
        self.pipe_connection = pipe_connection
        self.data_parallel_size = data_parallel_size
        self.tokenizer = with_chat_template(
            as_batch_tokenizer(tokenizer), self.config.chat_template
        )
        self.deterministic_mode = deterministic_mode
        self.routing = self.config.routing_policy(deterministic_mode)
        self.instance_id = secrets.token_hex(8)
        self._running = False
        self.shared = SharedState(
            config=self.config,
            routing=self.routing,
            instance_id=self.instance_id,
            tokenizer=self.tokenizer,
            transport=Transport(self.config, inference_coordinator_port, pipe_connection),
            # Start ids at a random offset: replies an engine still sends for a previous
            # coordinator's requests can then never match one of ours.
            requests=RequestTable(first_id=secrets.randbits(40)),
        )
        self.transport = self.shared.transport
        self.registry = self.shared.registry
        self.requests = self.shared.requests
        self.router_socket = self.transport.socket
        self.inference_coordinator_port = self.transport.port
        self._build_parts()
        # data_parallel_size is how many engines to wait for before serving, not how many
        # there will be: 0 (what the operator passes) starts at once and takes engines as
        # they register.
        log.info(
            "coordinator %s listening on port %d (%s); %s",
            self.instance_id,
            self.inference_coordinator_port,
            "CURVE" if self.transport.secured else "plain ZMQ",
            f"waiting for {data_parallel_size} engine(s) to register before serving"
            if data_parallel_size > 0
            else "serving now; engines join as they register",
        )
        self._wait_for_engines(self.config.engine_wait_timeout)

    def _build_parts(self) -> None:
        """Each part gets the shared state and the parts it calls, built before it."""
        shared = self.shared
        self.dispatcher = Dispatcher(shared)
        self.control = ControlRelay(shared, self.dispatcher)
        self.adapters = AdapterRelay(shared)
        self.membership = Membership(shared, self.dispatcher, self.control, self.adapters)
        self.refusals = Refusals(shared)
        self.intake = Intake(shared, Admission(self.config), self.dispatcher, self.control)
        self.results = ResultRouter(shared, self.dispatcher)
        self.results.on_cached_tokens = self.dispatcher.router.finished
        # The loop's table: one handler per message header, called as (identity, record).
        self._handlers: dict[Header, Handler] = {
            Header.CONNECT: self.membership.on_connect,
            Header.REGISTER: self.membership.on_register,
            Header.HEARTBEAT: self.membership.on_heartbeat,
            Header.DRAIN: self.membership.on_drain,
            Header.DEREGISTER: self.membership.on_deregister,
            Header.HAND_OFF: self.membership.on_hand_off,
            Header.SUBMIT_REQUEST: self.intake.on_submit,
            Header.SUBMIT_REQUESTS: self.intake.on_submits,
            Header.CANCEL: self.intake.on_cancel,
            Header.ENGINE_REPLY: self._from_engine(self.results.on_engine_reply),
            Header.CONTROL_ACK: self._from_engine(self.control.on_ack),
            Header.KV_EVENTS: self._from_engine(self.dispatcher.router.on_kv_events),
            Header.STATUS: self._on_status,
            **{signal: self.control.on_signal for signal in protocol.CONTROL_SIGNALS},
            Header.ADAPTER_ACK: self._from_engine(self.adapters.on_ack),
            **{signal: self.adapters.on_signal for signal in protocol.ADAPTER_SIGNALS},
        }

    def _from_engine(self, handler: Callable[[Engine, _Record], None]) -> Handler:
        """A handler for a message only registered engines may send."""
        engine_or_reject = self.membership.engine_or_reject
        return lambda identity, record: handler(engine_or_reject(identity), record)

    # --------------------------------------------------- Megatron-Core's interface

    @property
    def identities_of_data_parallel_ranks(self) -> deque[bytes]:
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

    @property
    def state(self) -> Any:
        """The engines' control state (``ControlState``)."""
        return self.control.state

    def get_next_data_parallel_rank(self) -> bytes | None:
        """The identity of the engine that gets the next request under the routing policy."""
        return choose_engine(self.registry, self.routing)

    def detokenize(self, finished_request_record: dict[str, Any]) -> dict[str, Any]:
        """Fill ``generated_text`` from ``generated_tokens`` in place."""
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
        if not self.transport.closed:
            self.transport.close()
            log.info("coordinator %s stopped", self.instance_id)

    def request_stop(self) -> None:
        """Ask the loop to stop after the current turn (safe from a signal handler)."""
        self._running = False

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

    def status(self) -> dict[str, Any]:
        return status_report(
            self.shared, self.control.state, prefix_routing=self.dispatcher.router.status()
        )

    # ------------------------------------------------------------------- the loop

    def _wait_for_engines(self, timeout: float | None) -> None:
        """As Megatron's constructor: block until ``data_parallel_size`` engines registered.
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
        stop, messages = self.transport.poll(timeout_ms)
        if stop:
            self._running = False
        if messages:
            self._handle_batch(self.transport.receive())
        now = time.monotonic()
        self.membership.check_engines(now)
        self.dispatcher.expire_queued(now)
        self.dispatcher.send_batched()
        # After every send of this turn: remove the peers a send found gone (their requests
        # are dispatched again, and sent).
        while self.transport.unreachable:
            self.membership.remove_unreachable()
            self.dispatcher.send_batched()

    def _handle_batch(self, batch: Sequence[Received]) -> None:
        """Handle ``(identity, payload, role)`` messages, then run the batch step. On a CURVE
        socket every message carries its connection's role, and one that role may not send is
        refused before any handler sees it; on a plain socket the role is None."""
        decode, header_of, limit = (
            protocol.decode,
            protocol.HEADER_OF,
            self.config.max_message_bytes,
        )
        handlers, permitted = self._handlers, roles.PERMITTED
        for identity, payload, role in batch:
            try:
                if payload is None:
                    raise ProtocolError("expected one frame after the identity")
                record = decode(payload, limit)
                header = header_of[type(record)]
                if role is None or header in permitted.get(role, ()):
                    handlers[header](identity, record)
                else:
                    self.refusals.forbidden(identity, role, record)
            except MessageTooLarge as exc:
                self.refusals.too_large(identity, exc)
            except ProtocolError as exc:
                self.refusals.bad_input(identity, str(exc))
            except Exception:  # a bug must not take the coordinator down with it
                log.exception("error handling a message from %r", identity)
        self.intake.flush()
        self.dispatcher.send_batched()  # the batch's new requests, before its results go out
        self.results.flush()

    def _on_status(self, identity: bytes, query: protocol.Status) -> None:
        if identity not in self.shared.clients:
            self.transport.error(
                identity, query.query_id, ErrorCode.UNKNOWN_PEER, "connect before asking for status"
            )
            return
        self.transport.send(
            identity, protocol.encode(protocol.StatusReply(query.query_id, self.status()))
        )
