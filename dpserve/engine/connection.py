"""The engine's side of the wire: a DEALER socket to the coordinator and the engine messages."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from dpserve import protocol
from dpserve.handshake import WATCHED_EVENTS, HandshakeWatch
from dpserve.protocol import ProtocolError, Register
from dpserve.security import key_files, roles

log = logging.getLogger("dpserve.engine")

# A REGISTER that got no answer on a live connection is sent again after this many seconds (a
# coordinator that was busy answers both; the engine logs the first acknowledgement only).
REGISTER_RESEND_AFTER = 10.0


class EngineRefused(RuntimeError):
    """The coordinator refused this engine's handshake (no keys, or a key it does not
    allow): the engine could only wait forever."""


class EngineConnection:
    def __init__(
        self,
        address: str,
        rank: int,
        capacity: int,
        *,
        credentials: key_files.PeerKeys | str | os.PathLike[str] | None = None,
    ) -> None:
        """``credentials``: the engine's keys, or a credentials directory (its engine key),
        for a coordinator that requires CURVE."""
        self.address = address
        self.rank = rank
        self.capacity = capacity
        keys = (
            None if credentials is None else key_files.as_peer_keys(credentials, key_files.ENGINE)
        )
        # A new instance id per process: the coordinator tells a restarted engine from a
        # repeated REGISTER of the same one.
        self.instance = uuid.uuid4().hex
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, b"e-" + uuid.uuid4().bytes)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let the last replies and DEREGISTER out
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:
            roles.secure_peer(self.socket, keys)
        # A refused CURVE handshake shows only as a monitor event (see dpserve.handshake).
        self.handshake = HandshakeWatch(address, "engine", keys is not None, "allowed/engine/")
        self._monitor = self.socket.get_monitor_socket(WATCHED_EVENTS)
        # Connections that completed their handshake so far, and the one the last REGISTER
        # went out on: one REGISTER per connection, none while nothing is connected.
        self._connections = 0
        self._live = False
        self._registered_on = 0
        self._register_sent = 0.0
        self.socket.connect(address)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def receive_all(self) -> list[Any]:
        """Every message already waiting, as its ``dpserve.protocol`` record; malformed ones
        are logged and skipped."""
        messages = []
        try:
            while True:
                payload = self.socket.recv(zmq.NOBLOCK)
                try:
                    messages.append(protocol.decode(payload))
                except ProtocolError as exc:
                    log.warning("ignoring a malformed message from the coordinator: %s", exc)
        except zmq.Again:
            pass
        return messages

    def send(self, record: Any) -> None:
        """Send one ``dpserve.protocol`` record."""
        self.socket.send(protocol.encode(record), zmq.NOBLOCK)

    def register(self, adapters: Mapping[str, str] | None = None) -> bool:
        """Send REGISTER if one is due; True when one went out. Call it as often as you like
        until registered: it sends once per connection to the coordinator, and never while
        nothing is connected (a DEALER queues what it cannot send, and the coordinator would
        get, and answer, every REGISTER queued while it was down). ``register_again`` makes
        the next call send on the same connection. ``adapters``: the LoRA adapters loaded at
        run time (name -> directory), for REGISTER. Raises ``EngineRefused`` once the
        coordinator refused the handshake: the engine could only wait forever, so it had
        better exit and show why."""
        self.check_handshake()
        if not self._live:
            return False
        now = time.monotonic()
        if (
            self._registered_on == self._connections
            and now - self._register_sent < REGISTER_RESEND_AFTER
        ):
            return False
        self._registered_on = self._connections
        self._register_sent = now
        self.send(
            Register(
                self.rank,
                self.capacity,
                self.instance,
                batched_requests=1,
                adapters=dict(adapters) if adapters else None,
            )
        )
        return True

    def register_again(self) -> None:
        """The coordinator forgot this engine (a restart, ``unknown_peer``, silence): the next
        ``register`` sends on the current connection too."""
        self._registered_on = 0

    def check_handshake(self) -> None:
        """Read the socket's connection events; raise ``EngineRefused`` for a refusal."""
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connections += 1
                self._live = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._live = False
            refusal = self.handshake.observe(event["event"], event["value"])
            if refusal is not None:
                raise EngineRefused(refusal)

    def close(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close()
        self.context.term()
