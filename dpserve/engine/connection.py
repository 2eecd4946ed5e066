"""The engine's side of the wire: a DEALER socket to the coordinator and the engine messages."""

from __future__ import annotations

import logging
import uuid

import zmq

from dpserve import protocol
from dpserve.protocol import Header, ProtocolError

log = logging.getLogger("dpserve.engine")


class CoordinatorConnection:
    def __init__(self, address: str, rank: int, capacity: int) -> None:
        self.address = address
        self.rank = rank
        self.capacity = capacity
        # A new instance id per process: the coordinator tells a restarted engine from a
        # repeated REGISTER of the same one.
        self.instance = uuid.uuid4().hex
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, b"e-" + uuid.uuid4().bytes)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let the last replies and DEREGISTER out
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
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
        self.send(Header.REGISTER, self.rank, self.capacity, self.instance)

    def close(self) -> None:
        self.socket.close()
        self.context.term()
