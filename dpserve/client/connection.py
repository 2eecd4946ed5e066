"""The client's DEALER socket to the coordinator: sending, draining input, and watching the
connection (is anything listening, was the CURVE handshake refused) while the handshake waits.

The listener awaits the socket in the event loop (zmq.asyncio) and then drains every waiting
message without blocking: no sleep-polling. Sends and drains go through a plain-socket view of
the same socket, so no message costs a Future.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dpserve import protocol
from dpserve.client.records import CoordinatorRefused, CoordinatorUnavailable
from dpserve.handshake import WATCHED_EVENTS, HandshakeWatch
from dpserve.protocol import Header, ProtocolError
from dpserve.security import key_files, roles

log = logging.getLogger("dpserve.client")

_WAITING_NOTE_EVERY = 10.0  # seconds between log lines while nothing listens yet
# A SUBMIT_REQUESTS message's bytes beyond its entries' (its header and two array headers).
_BATCH_OVERHEAD_BYTES = 16


class ClientConnection:
    """One DEALER socket, its monitor and its handshake watch. ``on_message`` gets every
    payload that arrives; ``on_refused`` is called once the coordinator refuses this peer."""

    def __init__(
        self,
        address: str,
        keys: key_files.PeerKeys | None,
        on_message: Callable[[bytes], None],
        on_refused: Callable[[CoordinatorRefused], None],
    ) -> None:
        self.address = address
        self._on_message = on_message
        self._on_refused = on_refused
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        # A fixed identity lets a restarted coordinator (and ZMQ reconnects) see the same peer.
        self.socket.setsockopt(zmq.IDENTITY, b"c-" + uuid.uuid4().bytes)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:
            roles.secure_peer(self.socket, keys)
        self._watch = HandshakeWatch(
            address,
            "client",
            keys is not None,
            f"allowed/{keys.role}/" if keys is not None else "allowed/",
        )
        self._monitor = self.socket.get_monitor_socket(WATCHED_EVENTS)
        self._handshake_news = asyncio.Event()  # set by every monitor event
        self.refusal: CoordinatorRefused | None = None
        # Only the wait for input goes through the event loop (see send).
        self._sync_socket: zmq.Socket[bytes] = zmq.Socket.shadow(self.socket.underlying)
        self._recheck_scheduled = False
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        # The most bytes of a SUBMIT_REQUESTS the coordinator reads (its CONNECT_ACK; 0: none,
        # each request goes as its own SUBMIT_REQUEST). The requests submitted in one turn of
        # the event loop, packed, wait in ``_submits`` and go out together at its end.
        self.submit_batch_bytes = 0
        self._submits: list[bytes] = []
        self._submit_bytes = 0

    def connect(self) -> asyncio.Task[None]:
        """Start watching the connection, connect, and start listening; returns the
        listener's task."""
        monitor = asyncio.create_task(self._watch_monitor(), name="dpserve-client-monitor")
        self.socket.connect(self.address)
        listener = asyncio.create_task(self._listen(), name="dpserve-client-listener")
        self._tasks += (listener, monitor)
        return listener

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)
        self.context.term()

    def send_submit(self, entry: bytes, single: Callable[[], bytes]) -> None:
        """Send a request packed by ``protocol.encode_entry``: with the others of this loop
        turn in one SUBMIT_REQUESTS, or alone (``single()``: its SUBMIT_REQUEST) where the
        coordinator reads no batch or the entry would not fit one."""
        room = self.submit_batch_bytes - _BATCH_OVERHEAD_BYTES
        if len(entry) > room:
            self.send(single())
            return
        if self._submit_bytes + len(entry) > room:
            self._flush_submits()
        if not self._submits:
            asyncio.get_running_loop().call_soon(self._flush_submits)
        self._submits.append(entry)
        self._submit_bytes += len(entry)

    def _flush_submits(self) -> None:
        if not self._submits or self._closed:
            return
        entries, self._submits, self._submit_bytes = self._submits, [], 0
        self._send_now(protocol.encode_batch(Header.SUBMIT_REQUESTS, entries))

    def send(self, payload: bytes) -> None:
        """Send a message, after the requests still waiting for this loop turn's end: a CANCEL
        must not overtake the request it cancels."""
        self._flush_submits()
        self._send_now(payload)

    def _send_now(self, payload: bytes) -> None:
        self._sync_socket.send(payload, zmq.NOBLOCK)  # never waits: no send high-water mark
        # ZMQ's descriptor is edge-triggered: a send can consume the wake-up for input that
        # arrived meanwhile. Look for such input once per loop turn, after a burst of sends.
        if not self._recheck_scheduled:
            self._recheck_scheduled = True
            asyncio.get_running_loop().call_soon(self._recheck_input)

    def _recheck_input(self) -> None:
        self._recheck_scheduled = False
        # ZMQ_EVENTS is an int option; pyzmq's get() is typed for every option at once.
        if not self._closed and cast(int, self._sync_socket.get(zmq.EVENTS)) & zmq.POLLIN:
            self._drain()

    async def _listen(self) -> None:
        """Wait for input in the event loop, then handle everything already waiting."""
        while True:
            await self.socket.poll()  # flags default to POLLIN (pyzmq's stub omits them)
            self._drain()

    def _drain(self) -> None:
        recv, handle = self._sync_socket.recv, self._on_message
        try:
            while True:
                payload = recv(zmq.NOBLOCK)
                try:
                    handle(payload)
                except ProtocolError as exc:
                    log.warning("ignoring a malformed message from the coordinator: %s", exc)
        except zmq.Again:
            pass

    async def wait_for_handshake(
        self, handshake: asyncio.Future[Any], startup_timeout: float, handshake_timeout: float
    ) -> None:
        """Wait for ``handshake``: patiently (up to ``startup_timeout``) while nothing listens
        at the address yet, for ``handshake_timeout`` once connected, not at all once the
        handshake was refused."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        connected_since: float | None = None
        next_note = started + min(handshake_timeout, _WAITING_NOTE_EVERY)
        while not handshake.done():
            if self.refusal is not None:
                raise self.refusal
            now = loop.time()
            if not self._watch.connected:
                connected_since = None
                if now - started >= startup_timeout:
                    raise CoordinatorUnavailable(
                        f"nothing is listening at {self.address} after "
                        f"{startup_timeout:g} s (is the coordinator running?)"
                    )
                if now >= next_note:
                    log.warning(
                        "waiting for the coordinator at %s: nothing listening yet after %.0f s "
                        "(still starting?)",
                        self.address,
                        now - started,
                    )
                    next_note = now + _WAITING_NOTE_EVERY
                wake = min(next_note, started + startup_timeout)
            else:
                connected_since = connected_since or now
                if now - connected_since >= handshake_timeout:
                    raise CoordinatorUnavailable(
                        f"connected to {self.address}, but no answer to the handshake within "
                        f"{handshake_timeout:g} s (is it a dpserve coordinator?)"
                    )
                wake = connected_since + handshake_timeout
            await self._wait_for_news(handshake, max(0.0, wake - now))

    async def _wait_for_news(self, handshake: asyncio.Future[Any], seconds: float) -> None:
        """Until the handshake completes, a monitor event arrives, or ``seconds`` pass."""
        self._handshake_news.clear()
        news = asyncio.ensure_future(self._handshake_news.wait())
        try:
            await asyncio.wait(
                {handshake, news}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            news.cancel()

    async def _watch_monitor(self) -> None:
        """Follow the socket's connection events; a refused handshake is reported at once
        instead of leaving requests to wait for an answer."""
        while True:
            frames = await self._monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
                refusal = self._watch.observe(event["event"], event["value"])
            except Exception:  # a surprise here must not leave start() waiting blind
                log.exception("cannot interpret a socket monitor event")
                continue
            if self._watch.succeeded:
                self.refusal = None
            self._handshake_news.set()
            if refusal is not None and self.refusal is None:
                self.refusal = CoordinatorRefused(refusal)
                self._on_refused(self.refusal)
