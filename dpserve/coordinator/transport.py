"""The coordinator's socket: one ROUTER, its options, CURVE, binding, polling and framing.

A message is ``[identity, payload]`` on the ROUTER. ``receive`` drains every message already
waiting as ``(identity, payload or None, role or None)``; ``send`` never blocks and never
raises for a peer that vanished: it notes the peer in ``unreachable`` and returns False. The
coordinator's loop removes those peers after the turn's handlers returned
(``Membership.remove_unreachable``), never in the middle of a send.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import zmq

from dpserve import protocol
from dpserve.coordinator.config import CoordinatorConfig
from dpserve.protocol import Error
from dpserve.security import bind, key_files, roles

log = logging.getLogger("dpserve.coordinator")

MAX_BATCH = 4096  # messages handled per loop turn, so timers still run under a flood
# libzmq reads messages up to this multiple of the message limit, so that the coordinator can
# refuse one in-band (an ERROR naming the request); a larger one makes libzmq drop the
# connection before buffering it, which bounds the memory one peer can make us allocate.
TRANSPORT_CEILING_FACTOR = 4

Received = tuple[bytes, bytes | None, str | None]


class Transport:
    def __init__(self, config: CoordinatorConfig, port: int | None, pipe: Connection | None):
        self.context = zmq.Context()
        self.socket = socket = self.context.socket(zmq.ROUTER)
        # Report unroutable sends (a client that vanished) instead of dropping them silently,
        # and never drop a reply at a high-water mark: admission control bounds memory.
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_CEILING_FACTOR * config.max_message_bytes)
        # libzmq's own heartbeats run in its I/O thread, so they keep the connection of an
        # engine that is merely busy (a long prefill holds its Python loop) and drop one whose
        # process froze or whose host vanished; sending to a dropped peer then fails
        # (ROUTER_MANDATORY), which is how the liveness check tells dead from busy.
        socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.heartbeat_timeout * 1000))
        # Peers a send found gone, oldest first, until the loop removes them.
        self.unreachable: deque[bytes] = deque()
        self.authenticator: roles.RoleAuthenticator | None = None
        # How a drained batch is received: plain, or with each message's role (CURVE).
        self.receive: Callable[[], Sequence[Received]] = self._drain
        self.pipe = pipe
        self._closed = False
        try:
            self._secure(config)
            self.port = self._bind(config.host, port)
        except Exception:
            self.close()  # the authenticator's thread and the context must not outlive us
            raise
        self.poller = zmq.Poller()
        self.poller.register(socket, zmq.POLLIN)
        if pipe is not None:
            # The parent closing its end (or dying) stops us: no orphaned coordinator.
            self.poller.register(pipe.fileno(), zmq.POLLIN)

    def _secure(self, config: CoordinatorConfig) -> None:
        if config.credentials is not None:
            keys = key_files.as_server_keys(config.credentials)
            # Admit only allowed keys (ZAP) and receive each message with its connection's role.
            self.authenticator = roles.secure_server(self.socket, keys)
            self.receive = functools.partial(receive_with_roles, self.socket, MAX_BATCH)
        elif not bind.is_loopback(config.host):
            log.warning(
                "coordinator bound to %s WITHOUT credentials: anyone who can reach the port "
                "can submit work, register as an engine and stop every engine",
                config.host,
            )

    def _bind(self, host: str, port: int | None) -> int:
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            return port
        return self.socket.bind_to_random_port(f"tcp://{host}")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def secured(self) -> bool:
        return self.authenticator is not None

    def poll(self, timeout_ms: int) -> tuple[bool, bool]:
        """Wait for input; returns (the parent asks us to stop, messages are waiting)."""
        events = dict(self.poller.poll(timeout_ms))
        pipe = self.pipe
        stop = pipe is not None and pipe.fileno() in events and self._pipe_says_stop(pipe)
        return stop, self.socket in events

    @staticmethod
    def _pipe_says_stop(pipe: Connection) -> bool:
        try:
            message: object = pipe.recv()
            return message == "stop"
        except (EOFError, OSError):
            return True

    def _drain(self) -> list[Received]:
        """Every message waiting on a plain socket, as ``(identity, payload, role=None)``;
        the payload is None when the message does not have exactly one frame after it."""
        batch: list[Received] = []
        recv = self.socket.recv_multipart
        try:
            while len(batch) < MAX_BATCH:
                frames = recv(zmq.NOBLOCK)
                batch.append((frames[0], frames[1] if len(frames) == 2 else None, None))
        except zmq.Again:
            pass
        return batch

    def send(self, identity: bytes, payload: bytes) -> bool:
        """Send to one peer; a peer that vanished is noted in ``unreachable``, never fatal."""
        try:
            self.socket.send_multipart((identity, payload), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self.unreachable.append(identity)
                return False
            raise

    def error(self, identity: bytes, ref: int | None, code: str, message: str) -> None:
        self.send(identity, protocol.encode(Error(ref, code, message)))

    def close(self) -> None:
        """Release the socket, the authenticator and the context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.socket.close(linger=0)
        if self.authenticator is not None:
            with contextlib.suppress(Exception):
                self.authenticator.stop()  # its sockets would keep context.term() waiting
        with contextlib.suppress(Exception):
            self.context.term()


def receive_with_roles(
    socket: zmq.Socket[bytes], limit: int
) -> list[tuple[bytes, bytes | None, str]]:
    """Up to ``limit`` waiting messages of a CURVE ROUTER as (identity, payload, role); the
    payload is None for a message that is not exactly one frame after the identity.
    Two ``recv`` calls cost less than one ``recv_multipart``, which pays back most of
    receiving the payload as a ``Frame`` to read its User-Id."""
    batch: list[tuple[bytes, bytes | None, str]] = []
    recv = socket.recv
    try:
        while len(batch) < limit:
            identity = recv(zmq.NOBLOCK)
            frame = recv(zmq.NOBLOCK, copy=False)  # the parts of a message arrive together
            payload: bytes | None = frame.bytes
            if frame.more:
                payload = None
                while recv(zmq.NOBLOCK, copy=False).more:
                    pass
            try:
                # A bytes name: libzmq's string properties come back as str (pyzmq types a
                # str name's result as int | str, covering its int options too).
                role = frame.get(b"User-Id")
            except zmq.ZMQError:  # no User-Id: cannot happen behind our ZAP handler
                role = ""
            batch.append((identity, payload, role))
    except zmq.Again:
        pass
    return batch
