"""The aiohttp application: routes, middlewares, and the thin handlers that tie parsing
(``requests``), generation (``generate``) and metrics together."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import zmq
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST

from dpserve.client import ClientError, InferenceClient
from dpserve.limits import DEFAULT_HTTP_LIMITS, DEFAULT_REQUEST_LIMITS, HttpLimits, RequestLimits
from dpserve.openai.adapters import (
    ADMIN_ENDPOINTS,
    LOAD_ENDPOINT,
    RANKS_ENDPOINT,
    UNLOAD_ENDPOINT,
    AdapterDirectory,
    adapter_ranks,
    change_adapter,
    parse_adapter_body,
)
from dpserve.openai.body import parse_json_body
from dpserve.openai.connections import ConnectionGuard
from dpserve.openai.errors import (
    HttpError,
    InvalidRequest,
    invalid_request_error,
    outcome_for_status,
)
from dpserve.openai.generate import Generator, Outcome
from dpserve.openai.guided import check_constraint
from dpserve.openai.health import LIVE_BODY, readiness
from dpserve.openai.metrics import STATUS_TIMEOUT, FrontMetrics
from dpserve.openai.requests import (
    GenerationRequest,
    check_message_size,
    parse_chat_request,
    parse_completion_request,
)
from dpserve.openai.responses import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    MODELS_ENDPOINT,
    ChatFormat,
    CompletionFormat,
)
from dpserve.reply_formats import NO_REPLY_PARSERS, ReplyParsers
from dpserve.security import api_tokens
from dpserve.tokenizer import BatchTokenizer

log = logging.getLogger("dpserve.openai")

_ApiHandler = Callable[[web.Request, Outcome], Awaitable[web.StreamResponse]]


class HttpFront:
    """The handlers and their shared state; ``create_app`` wires them into an application."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: BatchTokenizer,
        model_name: str,
        limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
        http_limits: HttpLimits = DEFAULT_HTTP_LIMITS,
        hold_without_engines: bool = False,
        reply_parsers: ReplyParsers = NO_REPLY_PARSERS,
    ) -> None:
        self.client = client
        self.reply_parsers = reply_parsers
        self.hold_without_engines = hold_without_engines
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.http_limits = http_limits
        self.max_message_bytes = limits.max_message_bytes
        # The coordinator instance whose limits this front checks requests against too.
        self._limits_of: str | None = None
        self.metrics = FrontMetrics()
        self.generator = Generator(
            client, tokenizer, model_name, http_limits.request_timeout, self.metrics
        )
        self.created = int(time.time())
        self.adapters = AdapterDirectory(model_name, self.coordinator_status)

    def counted(self, endpoint: str, handler: _ApiHandler) -> Handler:
        """Wrap an API handler so every request is counted once, by endpoint and outcome."""
        requests = self.metrics.requests

        async def wrapped(request: web.Request) -> web.StreamResponse:
            outcome = Outcome()
            try:
                response = await handler(request, outcome)
            except asyncio.CancelledError:  # the client went away (handler cancellation)
                requests.labels(endpoint, "cancelled").inc()
                raise
            except Exception:
                requests.labels(endpoint, "error").inc()
                raise
            requests.labels(endpoint, outcome.value or outcome_for_status(response.status)).inc()
            return response

        return wrapped

    async def completions(self, request: web.Request, outcome: Outcome) -> web.StreamResponse:
        try:
            await self._follow_coordinator_limits()
            body = await self._read_json(request)
            job = await self._with_adapter(parse_completion_request(body, self.limits), body)
            check_message_size(job, self.max_message_bytes)
            await check_constraint(job.params, job.schema_param, self.limits)
        except InvalidRequest as exc:
            return _refusal(exc)
        return await self.generator.generate(request, CompletionFormat(), job, outcome)

    async def chat_completions(self, request: web.Request, outcome: Outcome) -> web.StreamResponse:
        try:
            await self._follow_coordinator_limits()
            body = await self._read_json(request)
            job = await self._with_adapter(
                parse_chat_request(body, self.tokenizer, self.limits, self.reply_parsers), body
            )
            check_message_size(job, self.max_message_bytes)
            await check_constraint(job.params, job.schema_param, self.limits)
        except InvalidRequest as exc:
            return _refusal(exc)
        return await self.generator.generate(request, ChatFormat(), job, outcome)

    async def _with_adapter(
        self, job: GenerationRequest, body: dict[str, Any]
    ) -> GenerationRequest:
        """The request with the LoRA adapter its ``model`` names (``adapters``)."""
        lora_name = await self.adapters.resolve(body.get("model"))
        if lora_name is None:
            return job
        return dataclasses.replace(job, params=dataclasses.replace(job.params, lora_name=lora_name))

    async def models(self, request: web.Request, outcome: Outcome) -> web.StreamResponse:
        """The base model and every LoRA adapter an engine holds, each with its ``parent``
        (the base model), as vLLM lists them."""
        await self.adapters.refresh()
        base = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "dpserve",
            "root": self.model_name,
            "parent": None,
        }
        adapters = [
            {**base, "id": name, "root": name, "parent": self.model_name}
            for name in sorted(self.adapters.names)
        ]
        return web.json_response({"object": "list", "data": [base, *adapters]})

    async def lora_adapter_ranks(self, request: web.Request, outcome: Outcome) -> web.Response:
        """Which engines hold each adapter (``adapters.adapter_ranks``); 503 while the
        coordinator does not answer."""
        status = await self.coordinator_status()
        if status is None:
            return HttpError.of(
                503, "the coordinator did not answer", code="coordinator_unavailable"
            ).response()
        return web.json_response({"object": "list", "data": adapter_ranks(status)})

    async def load_lora_adapter(self, request: web.Request, outcome: Outcome) -> web.Response:
        return await self._change_adapter(request, load=True)

    async def unload_lora_adapter(self, request: web.Request, outcome: Outcome) -> web.Response:
        return await self._change_adapter(request, load=False)

    async def _change_adapter(self, request: web.Request, *, load: bool) -> web.Response:
        try:
            name, path = parse_adapter_body(await self._read_json(request), load=load)
        except InvalidRequest as exc:
            return _refusal(exc)
        return await change_adapter(self.client, self.adapters, name, path, load=load)

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response(LIVE_BODY)

    async def ready(self, request: web.Request) -> web.Response:
        status_code, body = readiness(
            await self.coordinator_status(), hold_without_engines=self.hold_without_engines
        )
        return web.json_response(body, status=status_code)

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = self.metrics.render(await self.coordinator_status())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def coordinator_status(self) -> dict[str, Any] | None:
        """The coordinator's status, or None when it does not answer within STATUS_TIMEOUT."""
        try:
            status: dict[str, Any] = await asyncio.wait_for(
                self.client.get_status(), STATUS_TIMEOUT
            )
        except (TimeoutError, ClientError, zmq.ZMQError):  # ZMQError: the client was stopped
            return None
        return status

    async def _follow_coordinator_limits(self) -> None:
        """Once per coordinator instance (a restarted one may be configured otherwise), read
        its limits from STATUS and check requests against those tighter than this front's."""
        instance = self.client.coordinator_instance
        if instance is None or instance == self._limits_of:
            return
        status = await self.coordinator_status()
        if status is not None and self.client.coordinator_instance == instance:
            self._limits_of = instance
            self._adopt_coordinator_limits(status.get("limits") or {})

    def _adopt_coordinator_limits(self, limits: dict[str, Any]) -> None:
        """A coordinator configured tighter than this front would drop (message size) or
        refuse (prompt tokens) what the front lets through: check against its values too."""
        message_bytes = limits.get("max_message_bytes")
        if isinstance(message_bytes, int) and message_bytes < self.max_message_bytes:
            log.info("the coordinator's message limit is %d bytes: checking it", message_bytes)
            self.max_message_bytes = message_bytes
        prompt_tokens = limits.get("max_prompt_tokens")
        if isinstance(prompt_tokens, int) and prompt_tokens < self.limits.max_prompt_tokens:
            self.limits = dataclasses.replace(self.limits, max_prompt_tokens=prompt_tokens)

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        too_large = InvalidRequest(
            f"the request body exceeds max_body_bytes={self.limits.max_body_bytes} "
            "(flag --max-body-bytes)",
            code="max_body_bytes",
            status=413,
        )
        if (request.content_length or 0) > self.limits.max_body_bytes:
            raise too_large  # refused before a byte of the body is read
        try:
            async with asyncio.timeout(self.http_limits.body_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except TimeoutError:
            raise InvalidRequest(
                f"the request body did not arrive within {self.http_limits.body_timeout:g} s "
                "(flag --http-body-timeout)",
                code="body_timeout",
                status=408,
            ) from None
        return parse_json_body(raw, self.limits)


def _refusal(exc: InvalidRequest) -> web.Response:
    response = invalid_request_error(exc).response()
    if exc.status in (408, 413):
        # The body was not read to its end: the connection cannot carry another request.
        response.force_close()
    return response


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, ...) and unexpected exceptions as OpenAI-style JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return HttpError.of(exc.status, exc.reason, headers=_allow_header(exc)).response()
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return HttpError.of(500, "internal server error", code="internal_error").response()


def _allow_header(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None


# The token may also come as this header: the Kubernetes API server's service proxy, through
# which the operator loads adapters, drops the Authorization header once it has
# authenticated its own caller with it.
API_KEY_HEADER: Final = "X-Api-Key"


def _is_admin_endpoint(request: web.Request) -> bool:
    """Whether the route the request matched is an admin endpoint: the route, not the raw
    path, so that no spelling of a path reaches an admin handler unchecked."""
    resource = request.match_info.route.resource
    return resource is not None and resource.canonical in ADMIN_ENDPOINTS


def _bearer_auth(keys: api_tokens.ApiKeys) -> Middleware:
    """Check the API (``/v1/...``) against ``keys`` (``ApiKeys.authorize`` decides), the token
    as ``Authorization: Bearer`` or ``X-Api-Key``: 401 without one of them, 403 for an API
    token on an admin endpoint. Health and metrics stay open for probes and scrapers."""

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/v1" or request.path.startswith("/v1/"):
            authorization = request.headers.get("Authorization")
            api_key = request.headers.get(API_KEY_HEADER)
            if authorization is None and api_key is not None:
                authorization = f"Bearer {api_key}"
            access = keys.authorize(authorization, admin_endpoint=_is_admin_endpoint(request))
            if access is api_tokens.Access.NOT_ADMIN:
                message = (
                    "Loading and unloading LoRA adapters needs an admin API key "
                    "(--admin-api-key-file); this key may use the rest of the API."
                )
                return HttpError.of(403, message, code="admin_api_key_required").response()
            if access is api_tokens.Access.UNAUTHENTICATED:
                message = (
                    "Incorrect API key provided."
                    if authorization
                    else "You didn't provide an API key: send `Authorization: Bearer <key>`."
                )
                return HttpError.of(
                    401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
                ).response()
        return await handler(request)

    return require_token


FRONT_KEY = web.AppKey("dpserve_http_front", HttpFront)


def create_app(
    client: InferenceClient,
    tokenizer: BatchTokenizer,
    model_name: str,
    *,
    api_keys: api_tokens.ApiKeys | None = None,
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS,
    guard: ConnectionGuard | None = None,
    hold_without_engines: bool = False,
    reply_parsers: ReplyParsers = NO_REPLY_PARSERS,
) -> web.Application:
    """The HTTP front as an aiohttp application; ``app[FRONT_KEY]`` holds its state. With
    ``api_keys``, ``/v1/*`` answer 401 unless given ``Authorization: Bearer <one of them>``,
    and the admin endpoints 403 unless it is an admin token (``_bearer_auth``);
    ``guard`` is told when each request's handler starts and ends (``serve_http``);
    ``hold_without_engines``: /ready is 200 while the coordinator holds requests for want of
    an engine (``health.readiness``); ``reply_parsers``: what is read out of chat replies."""
    front = HttpFront(
        client,
        tokenizer,
        model_name,
        limits,
        http_limits,
        hold_without_engines,
        reply_parsers,
    )
    middlewares = [
        *([guard.middleware] if guard is not None else []),
        _json_errors,
        *([_bearer_auth(api_keys)] if api_keys else []),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=limits.max_body_bytes)
    app[FRONT_KEY] = front
    if guard is not None:
        front.metrics.watch_connections(guard)
    app.router.add_post(
        COMPLETIONS_ENDPOINT, front.counted(COMPLETIONS_ENDPOINT, front.completions)
    )
    app.router.add_post(CHAT_ENDPOINT, front.counted(CHAT_ENDPOINT, front.chat_completions))
    app.router.add_get(MODELS_ENDPOINT, front.counted(MODELS_ENDPOINT, front.models))
    # Admin work (ADMIN_ENDPOINTS): with API keys only an admin token may call them, and the
    # coordinator relays them only from a connection with the admin role (when it uses
    # credentials).
    app.router.add_post(LOAD_ENDPOINT, front.counted(LOAD_ENDPOINT, front.load_lora_adapter))
    app.router.add_post(UNLOAD_ENDPOINT, front.counted(UNLOAD_ENDPOINT, front.unload_lora_adapter))
    app.router.add_get(RANKS_ENDPOINT, front.counted(RANKS_ENDPOINT, front.lora_adapter_ranks))
    app.router.add_get("/health", front.live)
    app.router.add_get("/livez", front.live)
    app.router.add_get("/ready", front.ready)
    app.router.add_get("/metrics", front.metrics_page)
    return app
