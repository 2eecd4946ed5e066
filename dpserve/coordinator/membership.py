"""``Membership``: clients connecting, engines registering, heartbeating, draining and leaving,
the liveness check that tells a dead engine from a busy one, and removing the peers a send
found gone. (The ``registry`` holds the records of who is known; this decides who joins and
who leaves.)"""

from __future__ import annotations

import logging
import time

from dpserve import protocol
from dpserve.coordinator.adapters import (
    AdapterRelay,
    MalformedAdapterReport,
    check_adapter_report,
    check_runtime_adapters,
)
from dpserve.coordinator.control import ControlRelay
from dpserve.coordinator.dispatch import Dispatcher
from dpserve.coordinator.engine_stats import MalformedEngineStats, check_engine_stats
from dpserve.coordinator.registry import Client, Engine
from dpserve.coordinator.shared import SharedState
from dpserve.protocol import (
    Connect,
    ConnectAck,
    Deregister,
    Drain,
    DrainAck,
    ErrorCode,
    HandOff,
    HandOffAck,
    Heartbeat,
    HeartbeatAck,
    ProtocolError,
    Register,
    RegisterAck,
)

log = logging.getLogger("dpserve.coordinator")

PROBE_INTERVAL = 1.0  # seconds between probes of an engine that is quiet past its heartbeats


class Membership:
    def __init__(
        self,
        shared: SharedState,
        dispatcher: Dispatcher,
        control: ControlRelay,
        adapters: AdapterRelay | None = None,
    ) -> None:
        self.shared = shared
        self.dispatcher = dispatcher
        self.control = control
        self.adapters = adapters if adapters is not None else AdapterRelay(shared)

    def engine_or_reject(self, identity: bytes) -> Engine:
        """The registered engine that sent a message only engines may send; anyone else is
        told to register and the message dropped."""
        engine = self.shared.registry.get(identity)
        if engine is None:
            self.shared.transport.error(
                identity, None, ErrorCode.UNKNOWN_PEER, "unknown engine: register first"
            )
            raise ProtocolError("message for registered engines from an unknown peer")
        engine.last_seen = time.monotonic()
        return engine

    def on_connect(self, identity: bytes, connect: Connect) -> None:
        version = connect.protocol_version
        if identity in self.shared.registry:
            raise ProtocolError("an engine cannot connect as a client")
        if version != protocol.PROTOCOL_VERSION:
            self.shared.transport.error(
                identity,
                None,
                ErrorCode.BAD_MESSAGE,
                f"protocol version {version} is not supported "
                f"(this coordinator speaks {protocol.PROTOCOL_VERSION})",
            )
            return
        self.shared.clients.setdefault(identity, Client(identity))
        self.shared.transport.send(
            identity,
            protocol.encode(
                ConnectAck(
                    self.shared.instance_id,
                    protocol.PROTOCOL_VERSION,
                    self.shared.config.max_message_bytes,  # SUBMIT_REQUESTS read, this large
                )
            ),
        )

    def on_register(self, identity: bytes, register: Register) -> None:
        rank, capacity, instance, batched_requests, runtime_adapters = register
        if identity in self.shared.clients:
            raise ProtocolError("a client cannot register as an engine")
        if capacity < 1:
            raise ProtocolError(f"engine capacity must be >= 1, got {capacity}")
        existing = self.shared.registry.get(identity)
        if existing is not None:
            if existing.instance == instance:
                existing.last_seen = time.monotonic()  # a repeated REGISTER: just re-ack
                self._ack_register(identity)
                return
            # Same identity, new process: the old one died.
            self.remove_engine(existing, died=True)
        engine = Engine(identity, rank, capacity, instance, time.monotonic())
        engine.batched_requests = batched_requests == 1
        self.shared.registry.add(engine)
        self.dispatcher.router.engine_added(engine)  # its snapshot follows the ack
        log.info(
            "engine rank %d registered (capacity %d); %d engine(s)",
            rank,
            capacity,
            len(self.shared.registry),
        )
        self._ack_register(identity)
        self.control.engine_joined(identity)
        self.adapters.engine_joined(engine, self._runtime_adapters(engine, runtime_adapters))
        self._probe_rank(engine)
        self.dispatcher.dispatch_queued()

    def _probe_rank(self, newcomer: Engine) -> None:
        """Probe every other engine registered with the newcomer's rank. An engine restarted
        under its rank (``dpserve serve``'s supervisor, a StatefulSet's replacement pod) comes
        back with a new identity while its dead predecessor is still registered: a send to the
        dead one fails as soon as libzmq dropped its connection (at once for a killed
        process), so it is removed now (``remove_unreachable``, after this message) instead of
        when its heartbeats time out, and the counts never show both. A live engine that shares
        the rank (two engines started with the same --rank) just gets a heartbeat ack."""
        probe = protocol.encode(HeartbeatAck(self.shared.instance_id))
        for engine in list(self.shared.registry.engines.values()):
            if engine.rank == newcomer.rank and engine is not newcomer:
                self.shared.transport.send(engine.identity, probe)

    def _ack_register(self, identity: bytes) -> None:
        self.shared.transport.send(
            identity, protocol.encode(RegisterAck(self.shared.instance_id, self.control.state))
        )

    def on_heartbeat(self, identity: bytes, heartbeat: Heartbeat) -> None:
        engine = self.shared.registry.get(identity)
        if engine is not None:
            engine.last_seen = time.monotonic()
            if heartbeat.stats is not None:
                self._keep_stats(engine, heartbeat.stats)
            self._keep_adapters(engine, heartbeat.adapters)
        elif identity not in self.shared.clients:
            self.shared.transport.error(
                identity, None, ErrorCode.UNKNOWN_PEER, "unknown peer: connect or register first"
            )
            return
        self.shared.transport.send(identity, protocol.encode(HeartbeatAck(self.shared.instance_id)))

    def _runtime_adapters(self, engine: Engine, raw: object) -> dict[str, str]:
        """The adapters a registering engine loaded at run time; a malformed report is dropped
        (the engine still registers: it is sent what this coordinator knows)."""
        try:
            return check_runtime_adapters(raw)
        except MalformedAdapterReport as exc:
            log.warning("engine rank %d: run-time adapters dropped: %s", engine.rank, exc)
            return {}

    def _keep_adapters(self, engine: Engine, raw: object) -> None:
        try:
            engine.adapters = {} if raw is None else check_adapter_report(raw)
        except MalformedAdapterReport as exc:
            engine.adapters = {}
            log.warning("engine rank %d: adapters dropped: %s", engine.rank, exc)

    def _keep_stats(self, engine: Engine, raw: object) -> None:
        """Keep an engine's reported numbers; a malformed report is dropped (absent beats
        wrong), counted and logged, and the heartbeat still counts as the engine alive."""
        try:
            engine.stats = check_engine_stats(raw)
        except MalformedEngineStats as exc:
            engine.stats = {}
            counters = self.shared.counters
            counters["bad_engine_stats"] += 1
            count = counters["bad_engine_stats"]
            if count <= 10 or count % 1000 == 0:  # an engine repeats itself every heartbeat
                log.warning(
                    "engine rank %d: stats dropped (%d so far): %s", engine.rank, count, exc
                )

    def on_drain(self, identity: bytes, drain: Drain) -> None:
        engine = self.engine_or_reject(identity)
        self.shared.registry.start_draining(engine)
        log.info(
            "engine rank %d draining: no new work; %d request(s) left",
            engine.rank,
            len(engine.outstanding),
        )
        self.shared.transport.send(identity, protocol.encode(DrainAck()))

    def on_deregister(self, identity: bytes, deregister: Deregister) -> None:
        engine = self.engine_or_reject(identity)
        log.info("engine rank %d left", engine.rank)
        self.remove_engine(engine, died=False)

    def on_hand_off(self, identity: bytes, hand_off: HandOff) -> None:
        """An engine leaving gives its requests back. With another engine to take them, they
        are re-dispatched at once (continuing after the tokens received, as when an engine
        dies, but no death is counted) and the engine may exit; with none, it drains."""
        engine = self.engine_or_reject(identity)
        if not any(other != identity for other in self.shared.registry.routable):
            log.info(
                "engine rank %d leaving, no other engine to take its %d request(s): it drains",
                engine.rank,
                len(engine.outstanding),
            )
            self.on_drain(identity, Drain())
            return
        handed = len(engine.outstanding)
        self.shared.counters["handed_off"] += handed
        log.info("engine rank %d left, handing %d request(s) to the others", engine.rank, handed)
        self.remove_engine(engine, died=False)
        self.shared.transport.send(identity, protocol.encode(HandOffAck(handed)))

    def check_engines(self, now: float) -> None:
        """Remove engines silent past ``engine_hung_timeout``; probe those quiet past their
        heartbeats. A send to a peer whose connection libzmq dropped fails, and the transport
        notes it (``remove_unreachable`` then removes the engine and re-dispatches its
        requests); a busy engine just ignores the probe."""
        config, transport = self.shared.config, self.shared.transport
        for engine in self.shared.registry.silent_since(now - config.heartbeat_timeout):
            if now - engine.last_seen > config.engine_hung_timeout:
                log.warning(
                    "engine rank %d connected but silent for %.0f s: removing it as hung, "
                    "re-dispatching %d request(s)",
                    engine.rank,
                    now - engine.last_seen,
                    len(engine.outstanding),
                )
                self.remove_engine(engine, died=True)
            elif now - engine.last_probe >= PROBE_INTERVAL:
                engine.last_probe = now
                probe = protocol.encode(HeartbeatAck(self.shared.instance_id))
                transport.send(engine.identity, probe)

    # ---------------------------------------------------------------- leaving

    def remove_engine(self, engine: Engine, died: bool) -> None:
        """Forget an engine: a control operation stops waiting for it, and every request it
        held goes to the others (``Dispatcher.reassign``)."""
        self.shared.registry.remove(engine.identity)
        self.dispatcher.router.engine_removed(engine)  # re-dispatch routes by the survivors
        self.control.engine_left(engine)
        self.adapters.engine_left(engine)
        self.dispatcher.reassign(engine, died)

    def remove_unreachable(self) -> None:
        """Remove the peers sends found gone (``Transport.unreachable``), after the sends
        returned. Removing one may send again (re-dispatch, CANCEL), and find more."""
        unreachable = self.shared.transport.unreachable
        while unreachable:
            self._peer_gone(unreachable.popleft())

    def _peer_gone(self, identity: bytes) -> None:
        shared = self.shared
        engine = shared.registry.get(identity)
        if engine is not None:
            log.warning("engine rank %d unreachable: removing it", engine.rank)
            self.remove_engine(engine, died=True)
        elif shared.clients.pop(identity, None) is not None:
            shared.counters["clients_vanished"] += 1
            dropped = shared.requests.of_client(identity)
            log.info("client %r vanished; cancelling its %d request(s)", identity, len(dropped))
            for request in dropped:
                self.dispatcher.cancel(request)
