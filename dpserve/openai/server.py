"""Serving the app: bind, run until stopped, shut down gracefully; and the front as a whole
(a client connected to a coordinator plus the app)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import socket
from pathlib import Path

from aiohttp import web

from dpserve.client import InferenceClient
from dpserve.limits import DEFAULT_HTTP_LIMITS, DEFAULT_REQUEST_LIMITS, HttpLimits, RequestLimits
from dpserve.openai.app import FRONT_KEY, create_app
from dpserve.openai.connections import ConnectionGuard
from dpserve.reply_formats import ReplyParsers
from dpserve.security import api_tokens, key_files
from dpserve.tokenizer import BatchTokenizer, as_batch_tokenizer, with_chat_template

log = logging.getLogger("dpserve.openai")


@dataclasses.dataclass(frozen=True, slots=True)
class FrontConfig:
    """Everything one HTTP front needs: where its coordinator is, what it serves, its limits."""

    address: str  # the coordinator's ZMQ address
    tokenizer_spec: str | None  # None: the byte tokenizer
    host: str
    port: int
    model_name: str
    credentials: key_files.PeerKeys | None = None  # CURVE keys for the coordinator
    api_keys: api_tokens.ApiKeys | None = dataclasses.field(default=None, repr=False)
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS
    # /ready is 200 while requests are held for want of an engine (autoscaled from zero).
    hold_without_engines: bool = False
    # --chat-template's text: chats rendered with it, not the model's own template.
    chat_template: str | None = None
    # What is read out of chat replies (--tool-call-parser, --reasoning-parser).
    reply_parsers: ReplyParsers = dataclasses.field(default_factory=ReplyParsers)
    # A socket already bound to host:port (``dpserve serve`` binds it before starting its
    # engines), which the front listens on; None: the front binds host:port itself.
    bound_socket: socket.socket | None = dataclasses.field(default=None, repr=False)


async def serve_http(
    client: InferenceClient,
    tokenizer: BatchTokenizer,
    config: FrontConfig,
    *,
    stop_event: asyncio.Event | None = None,
    listening: asyncio.Event | None = None,
) -> None:
    """Serve the app on ``config.host:config.port`` until cancelled or ``stop_event`` is set.
    In-flight requests get ``shutdown_timeout`` seconds to finish; the client is left to the
    caller."""
    limits = config.http_limits
    guard = ConnectionGuard(limits)
    app = create_app(
        client,
        tokenizer,
        config.model_name,
        api_keys=config.api_keys,
        limits=config.limits,
        http_limits=limits,
        guard=guard,
        hold_without_engines=config.hold_without_engines,
        reply_parsers=config.reply_parsers,
    )
    await app[FRONT_KEY].coordinator_status()  # learn the coordinator's limits before serving
    runner = web.AppRunner(
        app,
        # A client that disconnects cancels its handler, which cancels its request.
        handler_cancellation=True,
        shutdown_timeout=limits.shutdown_timeout,
        keepalive_timeout=limits.keepalive_timeout,
        lingering_time=limits.linger_timeout,
        # One log line per request costs real CPU at benchmark rates: only when debugging.
        access_log=logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None,
    )
    await runner.setup()
    assert runner.server is not None  # setup() made it
    _allow_open_files(limits.max_connections)
    try:
        loop = asyncio.get_running_loop()
        factory = guard.protocol_factory(runner.server)
        server = await (
            loop.create_server(factory, sock=config.bound_socket)
            if config.bound_socket is not None
            else loop.create_server(factory, config.host, config.port, reuse_address=True)
        )
        try:
            log.info(
                "HTTP front for %s on http://%s:%d", config.model_name, config.host, config.port
            )
            if listening is not None:
                listening.set()
            if stop_event is None:
                await asyncio.Future()  # until cancelled
            else:
                await stop_event.wait()
        finally:
            server.close()  # stop accepting; the runner then lets in-flight requests finish
    finally:
        await runner.cleanup()


def _allow_open_files(connections: int) -> None:
    """Raise the soft limit on open files (up to the hard one) so that ``connections`` can be
    held besides what the process needs for itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            log.warning(
                "open files are limited to %d: fewer than --http-max-connections %d can be held",
                new,
                connections,
            )


async def run_http_front(
    config: FrontConfig,
    stop_event: asyncio.Event | None = None,
    *,
    listening: asyncio.Event | None = None,
) -> None:
    """Connect a client to the coordinator and serve HTTP until cancelled or ``stop_event`` is
    set (``listening`` is set once the port accepts connections). Raises
    ``CoordinatorUnavailable`` when the handshake fails."""
    tokenizer = with_chat_template(as_batch_tokenizer(config.tokenizer_spec), config.chat_template)
    client = InferenceClient(config.address, handshake_timeout=30.0, credentials=config.credentials)
    await client.start()
    try:
        await serve_http(client, tokenizer, config, stop_event=stop_event, listening=listening)
    finally:
        client.stop()


def default_model_name(tokenizer_spec: str | None) -> str:
    """A local model directory's name, a hub id as given, or ``dpserve`` (byte tokenizer)."""
    if tokenizer_spec is None:
        return "dpserve"
    return Path(tokenizer_spec).name if os.path.isdir(tokenizer_spec) else tokenizer_spec
