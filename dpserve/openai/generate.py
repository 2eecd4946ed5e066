"""Running one validated request through the ``InferenceClient``: a JSON response, or an SSE
stream whose headers wait for the first event (so a request refused before its first token
still gets a real status)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

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
from dpserve.openai.metrics import FrontMetrics
from dpserve.openai.requests import GenerationRequest
from dpserve.openai.responses import (
    SSE_DONE,
    ResponseFormat,
    ResponseIds,
    sse_event,
    sse_response,
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
                            response = sse_response()
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
                        await response.write(SSE_DONE)
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
            return await _end_stream_with(response, error, outcome)
        finally:
            handle.cancel()

    def _token_texts(self, record: RequestRecord) -> list[str]:
        return self.tokenizer.decode_batch([[token] for token in record.generated_tokens])


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
