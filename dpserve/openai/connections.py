"""Bounds on what HTTP connections may hold: at most ``max_connections`` open at once (one
more is answered 503 and closed), and a request head that must arrive within
``header_timeout`` of its first byte (a client that trickles its headers is answered 408 and
closed). A fresh connection that sends nothing is closed after ``keepalive_timeout``, as
aiohttp closes an idle kept-alive one; the body's deadline is the handlers' (``app``).

The guard wraps each connection's protocol (asyncio's ``Protocol`` interface only), so it
works the same whatever aiohttp version serves the requests.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from dpserve.limits import HttpLimits
from dpserve.openai.errors import error_body, error_type_for_status

log = logging.getLogger("dpserve.openai")


def _raw_response(status: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response, written before (or instead of) aiohttp's parsing."""
    error_type = error_type_for_status(int(status.split()[0]))
    body = json.dumps(error_body(message, error_type, None, code)).encode()
    retry = "Retry-After: 1\r\n" if status.startswith("503") else ""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"{retry}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _State(enum.Enum):
    FRESH = "fresh"  # connected, nothing received yet
    HEAD = "head"  # bytes of a request head are arriving
    BUSY = "busy"  # a handler runs
    IDLE = "idle"  # between requests: aiohttp's keep-alive timer governs


class ConnectionGuard:
    """Counts and caps connections; times request heads. ``middleware`` tells it when a
    request's head has been parsed (its handler starts) and when the handler is done."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open = 0
        self.refused = 0
        self.timed_out = 0
        self._by_transport: dict[asyncio.BaseTransport, _GuardedProtocol] = {}

    def protocol_factory(
        self, inner: Callable[[], asyncio.Protocol]
    ) -> Callable[[], asyncio.Protocol]:
        """Wrap ``inner`` (aiohttp's ``runner.server``) for ``loop.create_server``."""
        return lambda: _GuardedProtocol(self, inner())

    def opened(self, protocol: _GuardedProtocol, transport: asyncio.BaseTransport) -> None:
        self.open += 1
        self._by_transport[transport] = protocol

    def closed(self, transport: asyncio.BaseTransport) -> None:
        self.open -= 1
        self._by_transport.pop(transport, None)

    @web.middleware
    async def middleware(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        guarded = self._by_transport.get(request.transport) if request.transport else None
        if guarded is not None:
            guarded.enter(_State.BUSY)
        try:
            return await handler(request)
        finally:
            if guarded is not None:
                guarded.enter(_State.IDLE)


class _GuardedProtocol(asyncio.Protocol):
    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.state = _State.FRESH
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        guard = self.guard
        if guard.open >= guard.limits.max_connections:
            guard.refused += 1
            transport.write(
                _raw_response(
                    "503 Service Unavailable",
                    f"too many open connections (max_connections={guard.limits.max_connections},"
                    " flag --http-max-connections)",
                    "max_connections",
                )
            )
            transport.close()
            return
        self.transport = transport
        guard.opened(self, transport)
        self._arm(guard.limits.keepalive_timeout, "sent nothing")
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return  # refused
        if self.state in (_State.FRESH, _State.IDLE):
            self.state = _State.HEAD
            self._arm(self.guard.limits.header_timeout, "did not finish its request head")
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.transport is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        self.guard.closed(self.transport)
        self._disarm()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def enter(self, state: _State) -> None:
        self.state = state
        self._disarm()  # BUSY: the handler's own deadlines apply; IDLE: aiohttp's keep-alive

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(seconds, self._expire, seconds, what)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self, seconds: float, what: str) -> None:
        self.timer = None
        if self.transport is None or self.transport.is_closing():
            return
        self.guard.timed_out += 1
        log.debug("closing a connection that %s within %g s", what, seconds)
        if self.state is _State.HEAD:
            self.transport.write(
                _raw_response(
                    "408 Request Timeout",
                    f"the request head did not arrive within {seconds:g} s "
                    "(header_timeout, flag --http-header-timeout)",
                    "header_timeout",
                )
            )
        self.transport.close()
