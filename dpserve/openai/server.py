"""Serving the app: bind, run until stopped, shut down gracefully; and the front as a whole
(a client connected to a coordinator plus the app)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path

from aiohttp import web

from dpserve import security
from dpserve.client import InferenceClient
from dpserve.limits import DEFAULT_HTTP_LIMITS, DEFAULT_REQUEST_LIMITS, HttpLimits, RequestLimits
from dpserve.openai.app import create_app
from dpserve.tokenizer import BatchTokenizer, as_batch_tokenizer

log = logging.getLogger("dpserve.http")


@dataclasses.dataclass(frozen=True, slots=True)
class FrontConfig:
    """Everything one HTTP front needs: where its coordinator is, what it serves, its limits."""

    address: str  # the coordinator's ZMQ address
    tokenizer_spec: str | None  # None: the byte tokenizer
    host: str
    port: int
    model_name: str
    credentials: security.PeerKeys | None = None  # CURVE keys for the coordinator
    api_keys: tuple[bytes, ...] | None = dataclasses.field(default=None, repr=False)
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS


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
    app = create_app(
        client,
        tokenizer,
        config.model_name,
        api_keys=config.api_keys,
        limits=config.limits,
        http_limits=config.http_limits,
    )
    runner = web.AppRunner(
        app,
        # A client that disconnects cancels its handler, which cancels its request.
        handler_cancellation=True,
        shutdown_timeout=config.http_limits.shutdown_timeout,
        # One log line per request costs real CPU at benchmark rates: only when debugging.
        access_log=logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        log.info("HTTP front for %s on http://%s:%d", config.model_name, config.host, config.port)
        if listening is not None:
            listening.set()
        if stop_event is None:
            await asyncio.Future()  # until cancelled
        else:
            await stop_event.wait()
    finally:
        await runner.cleanup()


async def run_http_front(
    config: FrontConfig,
    stop_event: asyncio.Event | None = None,
    *,
    listening: asyncio.Event | None = None,
) -> None:
    """Connect a client to the coordinator and serve HTTP until cancelled or ``stop_event`` is
    set (``listening`` is set once the port accepts connections). Raises
    ``CoordinatorUnavailable`` when the handshake fails."""
    tokenizer = as_batch_tokenizer(config.tokenizer_spec)
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
