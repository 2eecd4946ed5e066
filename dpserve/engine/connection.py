"""The engine's side of the wire: a DEALER socket to the coordinator and the engine messages."""

from __future__ import annotations

import logging
import os
import uuid

import zmq
from zmq.utils.monitor import parse_monitor_message

from dpserve import protocol, security
from dpserve.protocol import Header, ProtocolError

log = logging.getLogger("dpserve.engine")

# A CURVE handshake the coordinator refused (a key it does not allow, a wrong coordinator key,
# CURVE on one side only). ZMQ reports it only as a monitor event, and does not reconnect.
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class CoordinatorRefused(RuntimeError):
    """The coordinator refused this engine's handshake; ZMQ will not try again."""


class CoordinatorConnection:
    def __init__(
        self,
        address: str,
        rank: int,
        capacity: int,
        *,
        credentials: security.PeerKeys | str | os.PathLike[str] | None = None,
    ) -> None:
        """``credentials``: the engine's keys, or a credentials directory (its engine key),
        for a coordinator that requires CURVE."""
        self.address = address
        self.rank = rank
        self.capacity = capacity
        keys = None if credentials is None else security.as_peer_keys(credentials, security.ENGINE)
        # A new instance id per process: the coordinator tells a restarted engine from a
        # repeated REGISTER of the same one.
        self.instance = uuid.uuid4().hex
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, b"e-" + uuid.uuid4().bytes)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let the last replies and DEREGISTER out
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self._monitor: zmq.Socket | None = None
        if keys is not None:
            security.secure_peer(self.socket, keys)
            self._monitor = self.socket.get_monitor_socket(_HANDSHAKE_FAILED)
        self.socket.connect(address)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def receive_all(self) -> list[tuple[Header, list]]:
        """Every message already waiting; malformed ones are logged and skipped."""
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

    def send(self, header: Header, *fields: object) -> None:
        self.socket.send(protocol.encode(header, *fields), zmq.NOBLOCK)

    def register(self) -> None:
        """Send REGISTER (about once a second until registered). Raises
        ``CoordinatorRefused`` once the coordinator refused the handshake: the engine could
        only wait forever, so it had better exit and show why."""
        self._check_handshake()
        self.send(Header.REGISTER, self.rank, self.capacity, self.instance)

    def _check_handshake(self) -> None:
        if self._monitor is None:
            return
        try:
            event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        raise CoordinatorRefused(
            f"the coordinator at {self.address} refused this engine's CURVE handshake "
            f"({getattr(event['event'], 'name', event['event'])}, {event['value']}): is the "
            "engine's key in the coordinator's allowed/engine/, and coordinator.key the "
            "coordinator's current public key?"
        )

    def close(self) -> None:
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
        self.socket.close()
        self.context.term()
