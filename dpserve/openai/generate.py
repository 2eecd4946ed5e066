"""Running one validated request through the ``InferenceClient``: a JSON response, or an SSE
stream whose headers wait for the first event (so a request refused before its first token
still gets a real status)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from aiohttp import web

from dpserve.client import (
    ClientError,
    InferenceClient,
    RequestFailed,
    RequestRecord,
    StreamChunk,
)
from dpserve.openai.errors import (
    HttpError,
    outcome_for_status,
    request_failed_error,
    timeout_error,
    unavailable_error,
)
from dpserve.openai.logprobs import token_pieces
from dpserve.openai.metrics import FrontMetrics
from dpserve.openai.requests import GenerationRequest
from dpserve.openai.responses import (
    SSE_DONE,
    ResponseFormat,
    ResponseIds,
    sse_event,
    sse_response,
    usage,
)
from dpserve.tokenizer import BatchTokenizer


class Outcome:
    """Lets a handler name its outcome when the status code does not tell (a stream that
    failed or lost its client after a 200 was sent)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: str | None = None


class Generator:
    """Submits requests and shapes what comes back; counts tokens and latencies."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: BatchTokenizer,
        model_name: str,
        request_timeout: float,
        metrics: FrontMetrics,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.metrics = metrics

    async def generate(
        self, request: web.Request, fmt: ResponseFormat, job: GenerationRequest, outcome: Outcome
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
        outcome: Outcome,
    ) -> web.StreamResponse:
        try:
            handle = self.client.stream(job.prompt, job.params)
        except ClientError as exc:
            return unavailable_error(exc).response()
        prompt_tokens = self._prompt_token_count(job) if job.continuous_usage else None
        sse = _SseStream(request, fmt, ids, prompt_tokens)
        try:
            try:
                async with (
                    asyncio.timeout(self.request_timeout),
                    contextlib.aclosing(handle.events()) as events,
                ):
                    async for event in events:
                        await sse.open()
                        if isinstance(event, StreamChunk):
                            self.metrics.add_generated(len(event.tokens))
                            await sse.chunk(event)
                            continue
                        await sse.finish(event, job.include_usage)
                        ttft = None if sse.first_token_at is None else sse.first_token_at - started
                        self.metrics.finished(fmt.endpoint, event, ttft, time.monotonic() - started)
                        return sse.opened
                raise RuntimeError("the stream ended without a result")  # events() yields one
            except ConnectionResetError:
                outcome.value = "cancelled"  # the client left; there is nobody to tell
                return sse.opened
            except TimeoutError:
                error = timeout_error(self.request_timeout)
            except RequestFailed as exc:
                error = request_failed_error(exc)
            except ClientError as exc:
                error = unavailable_error(exc)
            if sse.response is None:
                return error.response()
            return await _end_stream_with(sse.response, error, outcome)
        finally:
            handle.cancel()

    def _prompt_token_count(self, job: GenerationRequest) -> int:
        if isinstance(job.prompt, list):
            return len(job.prompt)
        return len(self.tokenizer.encode_batch([job.prompt])[0])

    def _token_texts(self, record: RequestRecord) -> list[str]:
        return token_pieces(self.tokenizer, record.generated_tokens, record.generated_text)


class _SseStream:
    """One SSE response. Headers go out with the first event, so a request refused before
    its first token still gets a real status. With ``prompt_tokens`` (continuous usage
    stats), every chunk carries the usage so far."""

    def __init__(
        self,
        request: web.Request,
        fmt: ResponseFormat,
        ids: ResponseIds,
        prompt_tokens: int | None,
    ) -> None:
        self.request = request
        self.fmt = fmt
        self.ids = ids
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.response: web.StreamResponse | None = None
        self.first_token_at: float | None = None

    @property
    def opened(self) -> web.StreamResponse:
        assert self.response is not None  # only called once something was written
        return self.response

    async def open(self) -> None:
        if self.response is None:
            self.response = sse_response()
            await self.response.prepare(self.request)
            for opening in self.fmt.opening_chunks(self.ids):
                await self._write(opening)

    async def chunk(self, chunk: StreamChunk) -> None:
        if chunk.tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.completion_tokens += len(chunk.tokens)
        if chunk.text:
            await self._write(self.fmt.chunk(self.ids, chunk.text))

    async def finish(self, record: RequestRecord, include_usage: bool) -> None:
        if self.prompt_tokens is not None:
            self.prompt_tokens = len(record.prompt_tokens)  # the coordinator's count is exact
            self.completion_tokens = len(record.generated_tokens)
        await self._write(self.fmt.final_chunk(self.ids, record.finish_reason))
        if include_usage:
            await self._write(self.fmt.usage_chunk(self.ids, record))
        await self.opened.write(SSE_DONE)
        await self.opened.write_eof()

    async def _write(self, payload: dict[str, Any]) -> None:
        if self.prompt_tokens is not None:
            payload = {**payload, "usage": usage(self.prompt_tokens, self.completion_tokens)}
        await self.opened.write(sse_event(payload))


async def _end_stream_with(
    response: web.StreamResponse, error: HttpError, outcome: Outcome
) -> web.StreamResponse:
    """The 200 is already out: report the error in the stream, then end it as usual."""
    outcome.value = outcome_for_status(error.status)
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        async with asyncio.timeout(1.0):
            await response.write(sse_event(error.body) + SSE_DONE)
            await response.write_eof()
    return response
