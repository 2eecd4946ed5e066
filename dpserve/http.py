"""OpenAI-compatible HTTP front: aiohttp over one ``InferenceClient``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (ready: the coordinator answers and at least one engine is registered),
``GET /livez`` (the process serves) and ``GET /metrics`` (Prometheus text, from a registry
owned by the app so several apps can live in one process).

API choices, where OpenAI leaves room or where this server differs:

* ``prompt`` is one string or one list of token ids; a one-element list of either is unwrapped.
  Several prompts in one request are rejected with 400: send one request per prompt.
* ``model`` may be omitted or name anything: one model is served and its name is reported.
* ``n`` and ``best_of`` must be 1; ``echo``, ``suffix``, penalties, ``logit_bias``, ``tools``
  and non-text ``response_format`` are rejected (400) rather than silently ignored. Other
  unknown fields are ignored, as the OpenAI SDKs send a few this server has no use for.
* ``max_tokens`` defaults to 16 for completions (OpenAI's default) and to
  ``DEFAULT_CHAT_MAX_TOKENS`` for chat (OpenAI's is "until the context is full"; a bound keeps
  a forgotten ``max_tokens`` from holding an engine for minutes).
* ``top_k`` is an extension (0 or -1 disables it). ``logprobs`` returns the sampled tokens'
  log-probabilities only (no alternatives) and is not available with ``stream``.
* A streamed request that fails before its first token gets an ordinary JSON error with the
  mapped status; after the first token, an SSE ``data: {"error": ...}`` event and ``[DONE]``.
* ``stream_options.include_usage`` adds OpenAI's final usage chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import zmq
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from dpserve import security
from dpserve.client import (
    ClientError,
    InferenceClient,
    RequestFailed,
    RequestRecord,
    StreamChunk,
)
from dpserve.protocol import DEFAULT_MAX_MESSAGE_BYTES, ErrorCode
from dpserve.sampling import InvalidSamplingParams, SamplingParams
from dpserve.tokenizer import BatchTokenizer, as_batch_tokenizer

log = logging.getLogger("dpserve.http")

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_REQUEST_TIMEOUT = 600.0
STATUS_TIMEOUT = 2.0  # /health and /metrics give up on the coordinator after this long
MAX_STOP_STRINGS = 16  # SamplingParams' limit
# Room for a prompt as large as the wire protocol carries (a 128k-token list is ~1 MB of JSON).
MAX_BODY_BYTES = DEFAULT_MAX_MESSAGE_BYTES
TOKENS_PER_SECOND_WINDOW = 10.0

COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
MODELS_ENDPOINT = "/v1/models"

_SSE_DONE = b"data: [DONE]\n\n"


# ============================================================ request parsing (pure)


class InvalidRequest(ValueError):
    """A request this server will not run; becomes an OpenAI-style error body."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request, ready for the client."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final chunk with token counts


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidRequest(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"the request body must be a JSON object, got {_json_type(body)}", code="invalid_json"
        )
    return body


def parse_completion_request(body: Mapping[str, Any]) -> GenerationRequest:
    """Validate a ``/v1/completions`` body."""
    prompt = parse_prompt(body.get("prompt"))
    return_log_probs = _completion_logprobs(body.get("logprobs"))
    max_tokens = _positive_int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    return _generation_request(body, prompt, max_tokens, return_log_probs)


def parse_chat_request(body: Mapping[str, Any], tokenizer: BatchTokenizer) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its messages with the chat template."""
    messages = parse_messages(body.get("messages"))
    return_log_probs = _chat_logprobs(body)
    # max_completion_tokens is the newer name; max_tokens is deprecated but still sent.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _positive_int(body, key, DEFAULT_CHAT_MAX_TOKENS)
    # Parameters first: rendering a template costs more than checking a few fields.
    request = _generation_request(body, "", max_tokens, return_log_probs)
    try:
        prompt = tokenizer.apply_chat_template(messages)
    except Exception as exc:  # a template may raise anything (jinja's raise_exception included)
        raise InvalidRequest(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    if not prompt:
        raise InvalidRequest("the chat template rendered an empty prompt", param="messages")
    return dataclasses.replace(request, prompt=prompt)


def parse_prompt(prompt: Any) -> str | list[int]:
    """One string or one list of token ids (a one-element list of either is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(_is_token_id(token) for token in prompt):
            return list(prompt)
        if all(isinstance(item, str | list) for item in prompt):
            raise InvalidRequest(
                f"a request holds one prompt, got {len(prompt)}: send one request per prompt",
                param="prompt",
            )
        raise InvalidRequest(
            "a token prompt must be a list of integer token ids in [0, 2**31)", param="prompt"
        )
    if prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    raise InvalidRequest(
        f"prompt must be a string or a list of token ids, got {_json_type(prompt)}",
        param="prompt",
    )


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as ``{role, content}`` with text content (text parts joined by newlines)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{where}.role must be a non-empty string", param=f"{where}.role")
        parsed.append({"role": role, "content": _message_text(message.get("content"), where)})
    return parsed


def _message_text(content: Any, where: str) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest(
                    f"{where}.content: only text parts are supported", param=f"{where}.content"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"{where}.content: a text part needs a string 'text'",
                    param=f"{where}.content",
                )
            texts.append(text)
        return "\n".join(texts)
    raise InvalidRequest(
        f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
    )


# Parameters this server cannot honour: accepted only when absent or at their no-op value.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "response_format": ({"type": "text"},),
}


def _generation_request(
    body: Mapping[str, Any], prompt: str | list[int], max_tokens: int, return_log_probs: bool
) -> GenerationRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise InvalidRequest("only n=1 is supported", param="n")
    for name, no_ops in _NO_OP_VALUES.items():
        value = body.get(name)
        if value is not None and not any(_same_json(value, ok) for ok in no_ops):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    stream = _bool(body, "stream", default=False)
    include_usage = _include_usage(body.get("stream_options"), stream)
    if stream and return_log_probs:
        raise InvalidRequest("logprobs are not available for streamed responses", param="logprobs")

    temperature = _number(body, "temperature", 1.0)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(
            f"temperature must be a finite number >= 0, got {temperature}", param="temperature"
        )
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = _int(body, "top_k", 0)
    if top_k == -1:  # vLLM's spelling of "disabled"
        top_k = 0
    if top_k < 0:
        raise InvalidRequest(
            f"top_k must be >= 0 (0 or -1 disables it), got {top_k}", param="top_k"
        )
    seed = _int(body, "seed", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise InvalidRequest("seed must be in [0, 2**63)", param="seed")

    try:
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            num_tokens_to_generate=max_tokens,
            stop_strings=_stop_strings(body.get("stop")),
            return_log_probs=return_log_probs,
            seed=seed,
            stream=stream,
        )
    except InvalidSamplingParams as exc:  # a constraint only SamplingParams knows about
        raise InvalidRequest(str(exc)) from None
    return GenerationRequest(prompt, params, stream, include_usage)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return tuple(stops)


def _completion_logprobs(value: Any) -> bool:
    # Legacy completions take an int: how many alternatives per token. Any int >= 0 asks for
    # the sampled tokens' log-probs, which is what this server returns.
    if value is None or value is False:
        return False
    if value is True:
        return True
    if _is_int(value) and value >= 0:
        return True
    raise InvalidRequest("logprobs must be an integer >= 0 or a boolean", param="logprobs")


def _chat_logprobs(body: Mapping[str, Any]) -> bool:
    wanted = _bool(body, "logprobs", default=False)
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= 20:
            raise InvalidRequest("top_logprobs must be an integer in [0, 20]", param="top_logprobs")
        if top > 0 and not wanted:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
    return wanted


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    return _bool(options, "include_usage", default=False, param="stream_options.include_usage")


def _positive_int(body: Mapping[str, Any], name: str, default: int) -> int:
    value = _int(body, name, default)
    if value < 1:
        raise InvalidRequest(f"{name} must be >= 1, got {value}", param=name)
    return value


def _int(body: Mapping[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise InvalidRequest(f"{name} must be an integer, got {_json_type(value)}", param=name)
    # JSON integers are unbounded; the wire format (msgpack) stops at 64 bits.
    if not -(2**63) <= value < 2**63:
        raise InvalidRequest(f"{name} is out of range", param=name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, got {_json_type(value)}", param=name)
    try:
        return float(value)
    except OverflowError:  # an integer too large for a float
        raise InvalidRequest(f"{name} is out of range", param=name) from None


def _bool(body: Mapping[str, Any], name: str, *, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(
            f"{name} must be true or false, got {_json_type(value)}", param=param or name
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value < 2**31


def _same_json(value: Any, expected: Any) -> bool:
    # JSON has one number type: 0 and 0.0 are the same, but true is not 1.
    return isinstance(value, bool) == isinstance(expected, bool) and value == expected


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


# ========================================================= response building (pure)


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseIds:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(
    message: str,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# ErrorCode of a RequestFailed -> HTTP status. Unlisted codes are our own bugs: 500.
_FAILURE_STATUS: dict[str, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.NO_ENGINE: 503,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.STOPPED: 503,
    ErrorCode.CANCELLED: 503,
    ErrorCode.ENGINE_ERROR: 502,
}


def failure_status(code: str) -> int:
    return _FAILURE_STATUS.get(code, 500)


@dataclasses.dataclass(frozen=True, slots=True)
class HttpError:
    """An error as status, OpenAI-style body and headers: sent as a JSON response, or as an
    SSE event when a stream has already started."""

    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] | None = None

    @classmethod
    def of(
        cls,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> HttpError:
        return cls(status, error_body(message, error_type_for_status(status), param, code), headers)

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


def invalid_request_error(exc: InvalidRequest) -> HttpError:
    return HttpError.of(exc.status, exc.message, param=exc.param, code=exc.code)


def request_failed_error(exc: RequestFailed) -> HttpError:
    """A coordinator's or engine's refusal, with the status its code maps to."""
    status = failure_status(exc.code)
    return HttpError.of(
        status,
        exc.message,
        param="prompt" if exc.code == ErrorCode.PROMPT_TOO_LONG else None,
        code=exc.code,
        headers={"Retry-After": "1"} if status == 503 else None,
    )


def unavailable_error(exc: ClientError) -> HttpError:
    return HttpError.of(503, f"the coordinator client is unavailable: {exc}", code="unavailable")


def timeout_error(seconds: float) -> HttpError:
    return HttpError.of(504, f"the request did not finish within {seconds:g} s", code="timeout")


def error_type_for_status(status: int) -> str:
    if status < 500:
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable_error"
    if status == 504:
        return "timeout_error"
    return "server_error"


def outcome_for_status(status: int) -> str:
    """The ``outcome`` label of ``dpserve_http_requests_total`` for a response status."""
    if status < 400:
        return "success"
    if status < 500:
        return "invalid_request"
    return {502: "engine_error", 503: "unavailable", 504: "timeout"}.get(status, "error")


def token_logprob_pairs(
    token_texts: list[str], logprobs: list[float]
) -> list[tuple[str, float | None]]:
    """Pair every token with its log-prob. Tokens generated before a request moved to another
    engine may have none; they come first, so the log-probs align with the end."""
    count = len(token_texts)
    aligned: list[float | None] = list(logprobs[max(0, len(logprobs) - count) :] if count else [])
    return list(zip(token_texts, [None] * (count - len(aligned)) + aligned, strict=True))


class ResponseFormat(Protocol):
    """How one endpoint shapes its responses and stream chunks."""

    endpoint: str
    id_prefix: str

    def response(
        self, ids: ResponseIds, record: RequestRecord, token_texts: list[str] | None
    ) -> dict[str, Any]: ...

    def opening_chunks(self, ids: ResponseIds) -> list[dict[str, Any]]: ...

    def chunk(self, ids: ResponseIds, text: str) -> dict[str, Any]: ...

    def final_chunk(self, ids: ResponseIds, finish_reason: str) -> dict[str, Any]: ...

    def usage_chunk(self, ids: ResponseIds, record: RequestRecord) -> dict[str, Any]: ...


class CompletionFormat:
    endpoint = COMPLETIONS_ENDPOINT
    id_prefix = "cmpl-"
    object_name = "text_completion"

    def response(
        self, ids: ResponseIds, record: RequestRecord, token_texts: list[str] | None
    ) -> dict[str, Any]:
        logprobs = None
        if token_texts is not None and record.log_probs is not None:
            pairs = token_logprob_pairs(token_texts, record.log_probs)
            offsets, position = [], 0
            for text in token_texts:
                offsets.append(position)
                position += len(text)
            logprobs = {
                "tokens": token_texts,
                "token_logprobs": [lp for _, lp in pairs],
                "top_logprobs": None,  # alternatives are not computed
                "text_offset": offsets,
            }
        choice = {
            "index": 0,
            "text": record.generated_text,
            "finish_reason": record.finish_reason,
            "logprobs": logprobs,
        }
        return {
            **self._envelope(ids),
            "choices": [choice],
            "usage": usage(len(record.prompt_tokens), len(record.generated_tokens)),
        }

    def opening_chunks(self, ids: ResponseIds) -> list[dict[str, Any]]:
        return []

    def chunk(self, ids: ResponseIds, text: str) -> dict[str, Any]:
        return self._chunk(ids, text, None)

    def final_chunk(self, ids: ResponseIds, finish_reason: str) -> dict[str, Any]:
        return self._chunk(ids, "", finish_reason)

    def usage_chunk(self, ids: ResponseIds, record: RequestRecord) -> dict[str, Any]:
        return {
            **self._envelope(ids),
            "choices": [],
            "usage": usage(len(record.prompt_tokens), len(record.generated_tokens)),
        }

    def _chunk(self, ids: ResponseIds, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return {**self._envelope(ids), "choices": [choice]}

    def _envelope(self, ids: ResponseIds) -> dict[str, Any]:
        return {
            "id": ids.id,
            "object": self.object_name,
            "created": ids.created,
            "model": ids.model,
        }


class ChatFormat:
    endpoint = CHAT_ENDPOINT
    id_prefix = "chatcmpl-"

    def response(
        self, ids: ResponseIds, record: RequestRecord, token_texts: list[str] | None
    ) -> dict[str, Any]:
        logprobs = None
        if token_texts is not None and record.log_probs is not None:
            logprobs = {
                "content": [
                    {
                        "token": text,
                        "logprob": logprob,
                        "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [],  # alternatives are not computed
                    }
                    for text, logprob in token_logprob_pairs(token_texts, record.log_probs)
                ]
            }
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": record.generated_text},
            "finish_reason": record.finish_reason,
            "logprobs": logprobs,
        }
        return {
            **self._envelope(ids, "chat.completion"),
            "choices": [choice],
            "usage": usage(len(record.prompt_tokens), len(record.generated_tokens)),
        }

    def opening_chunks(self, ids: ResponseIds) -> list[dict[str, Any]]:
        return [self._chunk(ids, {"role": "assistant", "content": ""}, None)]

    def chunk(self, ids: ResponseIds, text: str) -> dict[str, Any]:
        return self._chunk(ids, {"content": text}, None)

    def final_chunk(self, ids: ResponseIds, finish_reason: str) -> dict[str, Any]:
        return self._chunk(ids, {}, finish_reason)

    def usage_chunk(self, ids: ResponseIds, record: RequestRecord) -> dict[str, Any]:
        return {
            **self._envelope(ids, "chat.completion.chunk"),
            "choices": [],
            "usage": usage(len(record.prompt_tokens), len(record.generated_tokens)),
        }

    def _chunk(
        self, ids: ResponseIds, delta: dict[str, str], finish_reason: str | None
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._envelope(ids, "chat.completion.chunk"), "choices": [choice]}

    @staticmethod
    def _envelope(ids: ResponseIds, object_name: str) -> dict[str, Any]:
        return {"id": ids.id, "object": object_name, "created": ids.created, "model": ids.model}


def sse_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def health_body(status: Mapping[str, Any] | None) -> tuple[int, dict[str, Any]]:
    """``/health``'s status code and body for a coordinator status (None: no answer)."""
    if status is None:
        return 503, {"status": "coordinator_unavailable"}
    engines = int(status.get("engines", 0))
    body = {
        "status": "ok" if engines >= 1 else "no_engines",
        "engines": engines,
        "draining": status.get("draining", 0),
        "queued": status.get("queued", 0),
        "state": status.get("state"),
    }
    return (200 if engines >= 1 else 503), body


# ================================================================ metrics


class TokenRate:
    """Generated tokens per second over a sliding window (a gauge for dashboards that do not
    compute ``rate()`` themselves)."""

    def __init__(self, window: float = TOKENS_PER_SECOND_WINDOW) -> None:
        self.window = window
        self._started = time.monotonic()
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, count: int, now: float | None = None) -> None:
        if count:
            now = time.monotonic() if now is None else now
            self._events.append((now, count))
            self._total += count
            self._forget_before(now - self.window)  # bounded memory even if nobody scrapes

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._forget_before(now - self.window)
        # A process younger than the window has not had the whole window to generate in.
        span = max(1.0, min(self.window, now - self._started))
        return self._total / span

    def _forget_before(self, cutoff: float) -> None:
        while self._events and self._events[0][0] < cutoff:
            self._total -= self._events.popleft()[1]


class _ScrapeCollector:
    """Gauges computed at scrape time: the coordinator's status (refreshed by the /metrics
    handler just before rendering) and the recent token rate."""

    def __init__(self, token_rate: TokenRate) -> None:
        self.token_rate = token_rate
        self.status: Mapping[str, Any] | None = None

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "dpserve_generated_tokens_per_second",
            f"Generated tokens per second over the last {self.token_rate.window:g} s",
            value=self.token_rate.per_second(),
        )
        status = self.status
        yield GaugeMetricFamily(
            "dpserve_coordinator_up",
            f"1 if the coordinator answered a status query within {STATUS_TIMEOUT:g} s",
            value=0 if status is None else 1,
        )
        if status is None:
            return  # absent beats stale: dashboards show a gap, not old numbers
        for name, key, help_text in (
            ("dpserve_registered_engines", "engines", "Engines registered with the coordinator"),
            ("dpserve_draining_engines", "draining", "Registered engines that are draining"),
            ("dpserve_queued_requests", "queued", "Requests waiting for an engine"),
            ("dpserve_coordinator_inflight_requests", "inflight", "Requests the coordinator holds"),
        ):
            yield GaugeMetricFamily(name, help_text, value=status.get(key, 0))
        inflight = GaugeMetricFamily(
            "dpserve_engine_inflight_requests",
            "Requests outstanding on each engine",
            labels=["rank"],
        )
        capacity = GaugeMetricFamily(
            "dpserve_engine_capacity", "Batch capacity each engine registered", labels=["rank"]
        )
        for engine in status.get("engine_list", []):
            inflight.add_metric([str(engine["rank"])], engine["outstanding"])
            capacity.add_metric([str(engine["rank"])], engine["capacity"])
        yield inflight
        yield capacity
        for name, value in status.get("limits", {}).items():
            yield GaugeMetricFamily(
                f"dpserve_limit_{name}",
                f"The coordinator's admission limit on {name.replace('_', ' ')}",
                value=value,
            )


class FrontMetrics:
    """The HTTP front's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dpserve_http_requests",
            "HTTP API requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "dpserve_http_inflight_requests",
            "Generation requests this HTTP front is serving",
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "dpserve_time_to_first_token_seconds",
            "Seconds from receiving a request to its first generated token",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.latency = Histogram(
            "dpserve_request_latency_seconds",
            "Seconds from receiving a generation request to its last token",
            ["endpoint"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "dpserve_generated_tokens", "Tokens generated for this front", registry=self.registry
        )
        self.prompt_tokens = Counter(
            "dpserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.token_rate = TokenRate()
        self._scrape = _ScrapeCollector(self.token_rate)
        self.registry.register(self._scrape)
        # Export zeros from the start, so a rate() over the first requests is not lost.
        for endpoint in (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT):
            self.requests.labels(endpoint, "success")

    def add_generated(self, count: int) -> None:
        if count:
            self.generated_tokens.inc(count)
            self.token_rate.add(count)

    def finished(
        self, endpoint: str, record: RequestRecord, ttft: float | None, latency: float
    ) -> None:
        self.prompt_tokens.inc(len(record.prompt_tokens))
        if ttft is not None:
            self.time_to_first_token.labels(endpoint).observe(ttft)
        self.latency.labels(endpoint).observe(latency)

    def render(self, coordinator_status: Mapping[str, Any] | None) -> bytes:
        self._scrape.status = coordinator_status
        return generate_latest(self.registry)


# ============================================================== streaming adapter


# ==================================================================== the app


class _Outcome:
    """Lets a handler name its outcome when the status code does not tell (a stream that
    failed or lost its client after a 200 was sent)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: str | None = None


_ApiHandler = Callable[[web.Request, _Outcome], Awaitable[web.StreamResponse]]


class HttpFront:
    """The handlers and their shared state; ``create_app`` wires them into an application."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: BatchTokenizer,
        model_name: str,
        request_timeout: float,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.metrics = FrontMetrics()
        self.created = int(time.time())

    # ----------------------------------------------------------- wiring helpers

    def counted(self, endpoint: str, handler: _ApiHandler) -> Callable[[web.Request], Awaitable]:
        """Wrap an API handler so every request is counted once, by endpoint and outcome."""
        requests = self.metrics.requests

        async def wrapped(request: web.Request) -> web.StreamResponse:
            outcome = _Outcome()
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

    # -------------------------------------------------------------- endpoints

    async def completions(self, request: web.Request, outcome: _Outcome) -> web.StreamResponse:
        try:
            job = parse_completion_request(await _read_json(request))
        except InvalidRequest as exc:
            return invalid_request_error(exc).response()
        return await self._generate(request, CompletionFormat(), job, outcome)

    async def chat_completions(self, request: web.Request, outcome: _Outcome) -> web.StreamResponse:
        try:
            job = parse_chat_request(await _read_json(request), self.tokenizer)
        except InvalidRequest as exc:
            return invalid_request_error(exc).response()
        return await self._generate(request, ChatFormat(), job, outcome)

    async def models(self, request: web.Request, outcome: _Outcome) -> web.StreamResponse:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "dpserve",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        status_code, body = health_body(await self.coordinator_status())
        return web.json_response(body, status=status_code)

    async def livez(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = self.metrics.render(await self.coordinator_status())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def coordinator_status(self) -> dict[str, Any] | None:
        """The coordinator's status, or None when it does not answer within STATUS_TIMEOUT."""
        try:
            return await asyncio.wait_for(self.client.get_status(), STATUS_TIMEOUT)
        except (TimeoutError, ClientError, zmq.ZMQError):  # ZMQError: the client was stopped
            return None

    # ------------------------------------------------------------- generation

    async def _generate(
        self, request: web.Request, fmt: ResponseFormat, job: GenerationRequest, outcome: _Outcome
    ) -> web.StreamResponse:
        ids = ResponseIds(f"{fmt.id_prefix}{uuid.uuid4().hex}", int(time.time()), self.model_name)
        started = time.monotonic()
        self.metrics.inflight.inc()
        try:
            if job.stream:
                return await self._stream(request, fmt, job, ids, started, outcome)
            return await self._complete(fmt, job, ids, started)
        finally:
            self.metrics.inflight.dec()

    async def _complete(
        self, fmt: ResponseFormat, job: GenerationRequest, ids: ResponseIds, started: float
    ) -> web.Response:
        try:
            future = self.client.add_request(job.prompt, job.params)
            # wait_for cancels the future on timeout and when this handler is cancelled (the
            # client disconnected): the client then cancels the request on its engine.
            record: RequestRecord = await asyncio.wait_for(future, self.request_timeout)
        except TimeoutError:
            return timeout_error(self.request_timeout).response()
        except RequestFailed as exc:
            return request_failed_error(exc).response()
        except ClientError as exc:
            return unavailable_error(exc).response()
        self.metrics.add_generated(len(record.generated_tokens))
        self.metrics.finished(fmt.endpoint, record, record.ttft, time.monotonic() - started)
        token_texts = self._token_texts(record) if job.params.return_log_probs else None
        return web.json_response(fmt.response(ids, record, token_texts))

    async def _stream(
        self,
        request: web.Request,
        fmt: ResponseFormat,
        job: GenerationRequest,
        ids: ResponseIds,
        started: float,
        outcome: _Outcome,
    ) -> web.StreamResponse:
        try:
            handle = self.client.stream(job.prompt, job.params)
        except ClientError as exc:
            return unavailable_error(exc).response()
        response: web.StreamResponse | None = None
        first_token_at: float | None = None
        try:
            try:
                async with (
                    asyncio.timeout(self.request_timeout),
                    contextlib.aclosing(handle.events()) as events,
                ):
                    async for event in events:
                        if response is None:
                            # Headers wait for the first event, so a request refused before
                            # its first token still gets a proper error status.
                            response = _sse_response()
                            await response.prepare(request)
                            for opening in fmt.opening_chunks(ids):
                                await response.write(sse_event(opening))
                        if isinstance(event, StreamChunk):
                            if event.tokens and first_token_at is None:
                                first_token_at = time.monotonic()
                            self.metrics.add_generated(len(event.tokens))
                            if event.text:
                                await response.write(sse_event(fmt.chunk(ids, event.text)))
                            continue
                        await response.write(sse_event(fmt.final_chunk(ids, event.finish_reason)))
                        if job.include_usage:
                            await response.write(sse_event(fmt.usage_chunk(ids, event)))
                        await response.write(_SSE_DONE)
                        await response.write_eof()
                        ttft = None if first_token_at is None else first_token_at - started
                        self.metrics.finished(fmt.endpoint, event, ttft, time.monotonic() - started)
                        return response
                raise RuntimeError("the stream ended without a result")  # events() yields one
            except ConnectionResetError:
                outcome.value = "cancelled"  # the client left; there is nobody to tell
                assert response is not None  # only writing to the client raises it
                return response
            except TimeoutError:
                error = timeout_error(self.request_timeout)
            except RequestFailed as exc:
                error = request_failed_error(exc)
            except ClientError as exc:
                error = unavailable_error(exc)
            if response is None:
                return error.response()
            # The 200 is already out: report the error in the stream, then end it as usual.
            outcome.value = outcome_for_status(error.status)
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await response.write(sse_event(error.body) + _SSE_DONE)
                    await response.write_eof()
            return response
        finally:
            handle.cancel()

    def _token_texts(self, record: RequestRecord) -> list[str]:
        return self.tokenizer.decode_batch([[token] for token in record.generated_tokens])


def _sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # keep reverse proxies from buffering the stream
        }
    )


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise InvalidRequest(
            f"the request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large", status=413
        ) from None
    return parse_json_body(raw)


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
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


def _bearer_auth(tokens: tuple[bytes, ...]) -> Callable:
    """Require one of ``tokens`` on the API (``/v1/...``); health and metrics stay open for
    probes and scrapers."""

    @web.middleware
    async def require_token(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path == "/v1" or request.path.startswith("/v1/"):
            authorization = request.headers.get("Authorization")
            if not security.bearer_token_matches(authorization, tokens):
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
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    api_keys: tuple[bytes, ...] | None = None,
) -> web.Application:
    """The HTTP front as an aiohttp application; ``app[FRONT_KEY]`` holds its state. With
    ``api_keys``, ``/v1/*`` answer 401 unless given ``Authorization: Bearer <one of them>``."""
    front = HttpFront(client, tokenizer, model_name, request_timeout)
    middlewares = [_json_errors] + ([_bearer_auth(api_keys)] if api_keys else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[FRONT_KEY] = front
    app.router.add_post(
        COMPLETIONS_ENDPOINT, front.counted(COMPLETIONS_ENDPOINT, front.completions)
    )
    app.router.add_post(CHAT_ENDPOINT, front.counted(CHAT_ENDPOINT, front.chat_completions))
    app.router.add_get(MODELS_ENDPOINT, front.counted(MODELS_ENDPOINT, front.models))
    app.router.add_get("/health", front.health)
    app.router.add_get("/livez", front.livez)
    app.router.add_get("/metrics", front.metrics_page)
    return app


# ================================================================ serving


async def serve_http(
    client: InferenceClient,
    tokenizer: BatchTokenizer,
    model_name: str,
    host: str,
    port: int,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    stop_event: asyncio.Event | None = None,
    shutdown_timeout: float = 10.0,
    listening: asyncio.Event | None = None,
    api_keys: tuple[bytes, ...] | None = None,
) -> None:
    """Serve the app on ``host:port`` until cancelled or ``stop_event`` is set. In-flight
    requests get ``shutdown_timeout`` seconds to finish; the client is left to the caller."""
    app = create_app(
        client, tokenizer, model_name, request_timeout=request_timeout, api_keys=api_keys
    )
    runner = web.AppRunner(
        app,
        # A client that disconnects cancels its handler, which cancels its request.
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout,
        # One log line per request costs real CPU at benchmark rates: only when debugging.
        access_log=logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("HTTP front for %s on http://%s:%d", model_name, host, port)
        if listening is not None:
            listening.set()
        if stop_event is None:
            await asyncio.Future()  # until cancelled
        else:
            await stop_event.wait()
    finally:
        await runner.cleanup()


async def run_http_front(
    address: str,
    tokenizer_spec: str | None,
    host: str,
    port: int,
    model_name: str,
    stop_event: asyncio.Event | None = None,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    listening: asyncio.Event | None = None,
    credentials: security.PeerKeys | None = None,
    api_keys: tuple[bytes, ...] | None = None,
) -> None:
    """Connect a client to the coordinator at ``address`` and serve HTTP until cancelled or
    ``stop_event`` is set (``listening`` is set once the port accepts connections). Raises
    ``CoordinatorUnavailable`` when the handshake fails."""
    tokenizer = as_batch_tokenizer(tokenizer_spec)
    client = InferenceClient(address, handshake_timeout=30.0, credentials=credentials)
    await client.start()
    try:
        await serve_http(
            client,
            tokenizer,
            model_name,
            host,
            port,
            request_timeout=request_timeout,
            stop_event=stop_event,
            listening=listening,
            api_keys=api_keys,
        )
    finally:
        client.stop()


def default_model_name(tokenizer_spec: str | None) -> str:
    """A local model directory's name, a hub id as given, or ``dpserve`` (byte tokenizer)."""
    if tokenizer_spec is None:
        return "dpserve"
    return Path(tokenizer_spec).name if os.path.isdir(tokenizer_spec) else tokenizer_spec


def run_http_with_coordinator(
    args: Any,
    tokenizer_spec: str | None,
    options: Mapping[str, Any],
    *,
    credentials: security.PeerKeys | None = None,
    api_keys: tuple[bytes, ...] | None = None,
) -> int:
    """``dpserve coordinator --http-port``: the coordinator in a child process, the HTTP front
    in this one. SIGTERM/SIGINT stop the front, then the child; the exit code is 0 unless the
    coordinator failed to start or died while serving."""
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    # Ctrl-C reaches the whole process group. The coordinator must outlive the front's
    # graceful shutdown, so it ignores SIGINT (the disposition survives spawn's exec) and
    # leaves when this process closes the pipe, or dies.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process = context.Process(
            target=_coordinator_process,
            # data_parallel_size=0: the child must not wait for engines before answering.
            args=(
                logging.getLogger().getEffectiveLevel(),
                child_end,
                0,
                tokenizer_spec,
                args.port,
                args.deterministic,
            ),
            kwargs=dict(options),
            name="dpserve-coordinator",
            daemon=True,
        )
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    child_end.close()
    try:
        port = _wait_for_port(process, parent_end, timeout=120.0)
        if port is None:
            log.error("the coordinator process exited before it was ready")
            return 1
        address = f"tcp://{_connect_host(args.host)}:{port}"
        model_name = getattr(args, "served_model_name", None) or default_model_name(tokenizer_spec)
        request_timeout = getattr(args, "request_timeout", None) or DEFAULT_REQUEST_TIMEOUT
        try:
            return asyncio.run(
                _serve_beside(
                    process,
                    address,
                    tokenizer_spec,
                    args,
                    model_name,
                    request_timeout,
                    credentials,
                    api_keys,
                )
            )
        except OSError as exc:  # typically: the HTTP port is taken
            log.error("cannot serve HTTP on %s:%s: %s", args.host, args.http_port, exc)
            return 1
        except ClientError as exc:  # the handshake with our own coordinator failed
            log.error("cannot reach the coordinator at %s: %s", address, exc)
            return 1
    finally:
        _stop_child(process, parent_end)


async def _serve_beside(
    process: BaseProcess,
    address: str,
    tokenizer_spec: str | None,
    args: Any,
    model_name: str,
    request_timeout: float,
    credentials: security.PeerKeys | None,
    api_keys: tuple[bytes, ...] | None,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    child_died = False

    def on_child_exit() -> None:
        nonlocal child_died
        child_died = True
        loop.remove_reader(process.sentinel)  # level-triggered: it would fire forever
        stop.set()

    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    # Without its coordinator the front could only answer 503: exit so it gets restarted.
    loop.add_reader(process.sentinel, on_child_exit)
    try:
        await run_http_front(
            address,
            tokenizer_spec,
            args.host,
            args.http_port,
            model_name,
            stop,
            request_timeout=request_timeout,
            credentials=credentials,
            api_keys=api_keys,
        )
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(process.sentinel)
        for signum in signals:
            loop.remove_signal_handler(signum)
    if child_died:
        log.error("the coordinator process exited (code %s) while serving", process.exitcode)
        return 1
    log.info("HTTP front stopped")
    return 0


def _coordinator_process(
    log_level: int,
    pipe: Connection,
    data_parallel_size: int,
    tokenizer_spec: str | None,
    port: int,
    deterministic: bool,
    **options: Any,
) -> None:
    """The child's entry point: a spawned process starts without logging configured."""
    from dpserve.coordinator import DataParallelInferenceCoordinator

    logging.basicConfig(level=log_level, format=_CHILD_LOG_FORMAT)
    DataParallelInferenceCoordinator.entrypoint(
        pipe, None, data_parallel_size, tokenizer_spec, port, deterministic, **options
    )


_CHILD_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"  # as the CLI's


def _wait_for_port(process: BaseProcess, connection: Connection, timeout: float) -> int | None:
    """The port the child bound (it sends it once its socket is up), or None if it died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if connection.poll(0.1):
            try:
                return int(connection.recv())
            except (EOFError, OSError):
                return None
        if not process.is_alive():
            return None
    return None


def _stop_child(process: BaseProcess, connection: Connection) -> None:
    """Ask the coordinator to stop (closing the pipe would do too), then make sure it did."""
    with contextlib.suppress(OSError, ValueError):
        connection.send("stop")
    connection.close()
    process.join(10)
    if process.is_alive():
        log.warning("the coordinator did not stop within 10 s: terminating it")
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join()


def _connect_host(bind_host: str) -> str:
    """Where this process reaches a coordinator bound to ``bind_host``."""
    return "127.0.0.1" if bind_host in ("", "*", "0.0.0.0") else bind_host


__all__ = [
    "FRONT_KEY",
    "ChatFormat",
    "CompletionFormat",
    "FrontMetrics",
    "GenerationRequest",
    "HttpError",
    "HttpFront",
    "InvalidRequest",
    "create_app",
    "default_model_name",
    "failure_status",
    "health_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_body",
    "parse_messages",
    "parse_prompt",
    "run_http_front",
    "run_http_with_coordinator",
    "serve_http",
]
