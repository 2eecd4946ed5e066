"""The client's session with one coordinator instance: the CONNECT handshake, heartbeats, and
noticing that the coordinator restarted (another instance id in CONNECT_ACK or HEARTBEAT_ACK,
or an UNKNOWN_PEER error), after which the client connects again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dpserve import protocol
from dpserve.protocol import Connect, Heartbeat

log = logging.getLogger("dpserve.client")


class CoordinatorSession:
    """``send`` puts a message on the connection; ``on_restarted(instance)`` runs once a
    reconnection (or a restarted coordinator) completes its handshake."""

    def __init__(self, send: Callable[[bytes], None], on_restarted: Callable[[str], None]) -> None:
        self._send = send
        self._on_restarted = on_restarted
        self.instance: str | None = None  # the coordinator's instance id, once it answered
        self._handshake: asyncio.Future[str] | None = None
        self._reconnecting = False
        self.closed = False

    def connect(self) -> asyncio.Future[str]:
        """Send CONNECT; the returned future resolves on CONNECT_ACK."""
        self._handshake = asyncio.get_running_loop().create_future()
        self._send(protocol.encode(Connect(protocol.PROTOCOL_VERSION)))
        return self._handshake

    def on_connect_ack(self, instance: str) -> None:
        restarted = self.instance is not None and instance != self.instance
        self.instance = instance
        if self._handshake is not None and not self._handshake.done():
            self._handshake.set_result(instance)
        if self._reconnecting or restarted:
            self._reconnecting = False
            self._on_restarted(instance)

    def on_heartbeat_ack(self, instance: str) -> None:
        if self.instance not in (None, instance):
            self.reconnect("the coordinator restarted")

    def reconnect(self, why: str) -> None:
        if self._reconnecting or self.closed:
            return
        log.warning("%s: connecting again", why)
        self._reconnecting = True
        self._send(protocol.encode(Connect(protocol.PROTOCOL_VERSION)))

    async def heartbeat(self, interval: float) -> None:
        # Lets the client notice a restarted coordinator even while it is only waiting.
        payload = protocol.encode(Heartbeat(0))
        while True:
            await asyncio.sleep(interval)
            if self._reconnecting:
                self._send(protocol.encode(Connect(protocol.PROTOCOL_VERSION)))
            else:
                self._send(payload)
