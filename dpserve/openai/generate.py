"""Running one validated request through the ``InferenceClient``: a JSON response, or an SSE
stream whose headers wait for the first event (so a request refused before its first token
still gets a real status)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import Any

from aiohttp import web

from dpserve.client import (
    ClientError,
    InferenceClient,
    RequestFailed,
    RequestRecord,
    RequestStream,
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
from dpserve.openai.replies import StreamedReply, read_reply
from dpserve.openai.requests import GenerationRequest
from dpserve.openai.responses import (
    SSE_DONE,
    Choice,
    ResponseFormat,
    ResponseIds,
    TokenLogprob,
    records_usage,
    sse_event,
    sse_response,
    usage,
)
from dpserve.sampling import SamplingParams
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
        # The response names what the request ran on: the base model or its LoRA adapter.
        model = job.params.lora_name or self.model_name
        ids = ResponseIds(f"{fmt.id_prefix}{uuid.uuid4().hex}", int(time.time()), model)
        started = time.monotonic()
        self.metrics.inflight.inc()
        try:
            if job.stream:
                return await self._stream(request, fmt, job, ids, started, outcome)
            return await self._complete(fmt, job, ids, started)
        finally:
            self.metrics.inflight.dec()

    # ----------------------------------------------------------------------- fan-out

    def _candidates(self, job: GenerationRequest) -> list[tuple[str | list[int], SamplingParams]]:
        """Every sequence the request starts, prompt-major: ``best_of`` per prompt, candidate
        ``i`` seeded ``seed + i`` (candidate 0 is exactly the single request)."""
        out = []
        for prompt in job.all_prompts:
            for i in range(job.best_of):
                params = job.params
                if i and params.seed is not None:
                    params = dataclasses.replace(params, seed=(params.seed + i) % 2**63)
                out.append((prompt, params))
        return out

    async def _complete(
        self, fmt: ResponseFormat, job: GenerationRequest, ids: ResponseIds, started: float
    ) -> web.Response:
        futures = []
        try:
            # Submitted together, so they batch (and share the prompt's cached blocks).
            for prompt, params in self._candidates(job):
                futures.append(self.client.add_request(prompt, params))
            records: list[RequestRecord] = await asyncio.wait_for(
                asyncio.gather(*futures), self.request_timeout
            )
        except TimeoutError:
            return timeout_error(self.request_timeout).response()
        except RequestFailed as exc:
            return request_failed_error(exc).response()
        except ClientError as exc:
            return unavailable_error(exc).response()
        finally:
            for future in futures:
                future.cancel()  # a no-op for the finished; the rest stop on their engines
        per_prompt = [
            records[p * job.best_of : (p + 1) * job.best_of] for p in range(len(job.all_prompts))
        ]
        for record in records:
            self.metrics.add_generated(len(record.generated_tokens))
        self.metrics.finished(fmt.endpoint, records[0], records[0].ttft, time.monotonic() - started)
        choices = []
        returned = []
        for p, candidates in enumerate(per_prompt):
            if job.best_of > job.n:
                candidates = sorted(candidates, key=_cumulative_logprob, reverse=True)
            returned.append(candidates[: job.n])
            for i, record in enumerate(returned[-1]):
                choices.append(self._choice(job, p * job.n + i, record))
        used = records_usage(returned)
        if job.drop_generated:
            used = usage(used["prompt_tokens"], 0)
        return web.json_response(fmt.response(ids, choices, used))

    def _choice(self, job: GenerationRequest, index: int, record: RequestRecord) -> Choice:
        show_logprobs = job.params.return_log_probs and not job.hide_logprobs
        entries: list[TokenLogprob] | None = None
        prompt_text = ""
        if job.echo:
            prompt_text = self._prompt_text(record)
            if show_logprobs:
                entries = self._prompt_entries(record, prompt_text)
        generated_text = record.generated_text
        finish_reason: str = record.finish_reason
        if job.drop_generated:
            generated_text, finish_reason = "", "length"
        elif show_logprobs:
            entries = (entries or []) + self._entries(
                record.generated_tokens, generated_text, record.log_probs, record.top_logprobs
            )
            entries += self._stop_entry(record)
        choice = Choice(
            index, prompt_text + generated_text, finish_reason, entries, job.params.top_logprobs > 0
        )
        if job.reasoning is None and job.tool_calling is None:
            return choice
        read = read_reply(job.reasoning, job.tool_calling, generated_text, finish_reason)
        return dataclasses.replace(
            choice,
            text=read.content,
            reasoning=read.reasoning,
            tool_calls=read.calls,
            finish_reason=read.finish_reason,
        )

    def _prompt_text(self, record: RequestRecord) -> str:
        [text] = self.tokenizer.decode_batch([record.prompt_tokens])
        return text

    def _prompt_entries(self, record: RequestRecord, text: str) -> list[TokenLogprob]:
        tokens = record.prompt_tokens
        if not tokens:
            return []
        logprobs: list[float | None] = [None, *(record.prompt_logprobs or [])]
        top: list[list[tuple[int, float]] | None] = [None, *(record.prompt_top_logprobs or [])]
        pieces = token_pieces(self.tokenizer, tokens, text)
        names = self._token_names(top)
        return [
            TokenLogprob(
                piece,
                logprobs[i] if i < len(logprobs) else None,
                _named(top[i] if i < len(top) else None, names),
            )
            for i, piece in enumerate(pieces)
        ]

    def _entries(
        self,
        tokens: list[int],
        text: str,
        logprobs: list[float] | None,
        top: list[list[tuple[int, float]]] | None,
    ) -> list[TokenLogprob]:
        """Generated tokens with their log-probs; tokens from before a resume have none (they
        come first, so the log-probs align with the end)."""
        pieces = token_pieces(self.tokenizer, tokens, text)
        count = len(pieces)
        values = list(logprobs or [])[-count:] if count else []
        padded: list[float | None] = [None] * (count - len(values)) + list(values)
        alternatives = list(top or [])[-count:] if count else []
        top_padded: list[list[tuple[int, float]] | None] = [None] * (
            count - len(alternatives)
        ) + list(alternatives)
        names = self._token_names(top_padded)
        return [
            TokenLogprob(
                piece, padded[i], _named(top_padded[i], names) if top is not None else None
            )
            for i, piece in enumerate(pieces)
        ]

    def _stop_entry(self, record: RequestRecord) -> list[TokenLogprob]:
        """The stop token's entry, when it ended the choice and log-probs were asked for. It is
        generated (usage counts it) but adds no text: its string is empty, so that the entries'
        strings still join to the text."""
        if record.stop_logprob is None:
            return []
        top = record.stop_top_logprobs
        named = None if top is None else _named(top, self._token_names([top]))
        return [TokenLogprob("", record.stop_logprob, named)]

    def _token_names(self, top: list[list[tuple[int, float]] | None]) -> dict[int, str]:
        """Each alternative token's own text, decoded once per distinct token."""
        ids = sorted({token for entry in top if entry for token, _ in entry})
        return dict(zip(ids, self.tokenizer.decode_batch([[i] for i in ids]), strict=True))

    # ----------------------------------------------------------------------- streaming

    async def _stream(
        self,
        request: web.Request,
        fmt: ResponseFormat,
        job: GenerationRequest,
        ids: ResponseIds,
        started: float,
        outcome: Outcome,
    ) -> web.StreamResponse:
        handles = []
        try:
            for prompt, params in self._candidates(job):
                handles.append(self.client.stream(prompt, params))
        except ClientError as exc:
            for handle in handles:
                handle.cancel()
            return unavailable_error(exc).response()
        prompt_tokens = self._prompt_token_count(job) if job.continuous_usage else None
        sse = _SseStream(request, fmt, ids, prompt_tokens, len(handles), job)
        show_logprobs = job.params.return_log_probs and not job.hide_logprobs
        events: asyncio.Queue[tuple[int, StreamChunk | RequestRecord | BaseException]] = (
            asyncio.Queue()
        )
        pumps = [
            asyncio.ensure_future(_pump(index, handle, events))
            for index, handle in enumerate(handles)
        ]
        records: dict[int, RequestRecord] = {}
        try:
            try:
                async with asyncio.timeout(self.request_timeout):
                    while len(records) < len(handles):
                        index, event = await events.get()
                        if isinstance(event, BaseException):
                            raise event
                        await sse.open()
                        if isinstance(event, StreamChunk):
                            self.metrics.add_generated(len(event.tokens))
                            if job.echo and not sse.echoed[index]:
                                await sse.echo(index, self._echo_text(job, index))
                            entries = None
                            if show_logprobs and event.log_probs is not None:
                                entries = self._entries(
                                    event.tokens, event.text, event.log_probs, event.top_logprobs
                                )
                            await sse.chunk(index, event, entries, job.params.top_logprobs > 0)
                            continue
                        records[index] = event
                        stop = self._stop_entry(event) if show_logprobs else None
                        await sse.finish(index, event, stop, job.params.top_logprobs > 0)
                    per_prompt = [
                        [records[p * job.best_of + i] for i in range(job.best_of)]
                        for p in range(len(job.all_prompts))
                    ]
                    await sse.done(records_usage(per_prompt) if job.include_usage else None)
                    first = records[0]
                    ttft = None if sse.first_token_at is None else sse.first_token_at - started
                    self.metrics.finished(fmt.endpoint, first, ttft, time.monotonic() - started)
                    return sse.opened
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
            for pump in pumps:
                pump.cancel()
            for handle in handles:
                handle.cancel()

    def _echo_text(self, job: GenerationRequest, index: int) -> str:
        prompt = job.all_prompts[index // job.best_of]
        if isinstance(prompt, str):
            return prompt
        [text] = self.tokenizer.decode_batch([prompt])
        return text

    def _prompt_token_count(self, job: GenerationRequest) -> int:
        total = 0
        for prompt in job.all_prompts:
            if isinstance(prompt, list):
                total += len(prompt)
            else:
                total += len(self.tokenizer.encode_batch([prompt])[0])
        return total


async def _pump(
    index: int,
    handle: RequestStream,
    events: asyncio.Queue[tuple[int, StreamChunk | RequestRecord | BaseException]],
) -> None:
    """One choice's stream into the request's queue, tagged with the choice's index."""
    try:
        async with contextlib.aclosing(handle.events()) as stream:
            async for event in stream:
                events.put_nowait((index, event))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # handed to the consumer, which raises it
        events.put_nowait((index, exc))


def _cumulative_logprob(record: RequestRecord) -> float:
    return sum(record.log_probs or [])


def _named(
    entry: list[tuple[int, float]] | None, names: dict[int, str]
) -> list[tuple[str, float]] | None:
    return None if entry is None else [(names[token], logprob) for token, logprob in entry]


class _SseStream:
    """One SSE response for all of a request's choices. Headers go out with the first event,
    so a request refused before its first token still gets a real status. With
    ``prompt_tokens`` (continuous usage stats), every chunk carries the usage so far."""

    def __init__(
        self,
        request: web.Request,
        fmt: ResponseFormat,
        ids: ResponseIds,
        prompt_tokens: int | None,
        choices: int,
        job: GenerationRequest | None = None,
    ) -> None:
        self.request = request
        self.fmt = fmt
        self.ids = ids
        self.prompt_tokens = prompt_tokens
        self.choices = choices
        self.completion_tokens = 0
        self.response: web.StreamResponse | None = None
        self.first_token_at: float | None = None
        self.echoed = [False] * choices
        # Chat choices read as they come (a thought apart, tool calls): thought and content
        # are sent at once, calls when the choice ends.
        self.replies: list[StreamedReply] | None = None
        if job is not None and (job.reasoning is not None or job.tool_calling is not None):
            self.replies = [StreamedReply(job.reasoning, job.tool_calling) for _ in range(choices)]

    @property
    def opened(self) -> web.StreamResponse:
        assert self.response is not None  # only called once something was written
        return self.response

    async def open(self) -> None:
        if self.response is None:
            self.response = sse_response()
            await self.response.prepare(self.request)
            for opening in self.fmt.opening_chunks(self.ids, range(self.choices)):
                await self._write(opening)

    async def echo(self, index: int, text: str) -> None:
        self.echoed[index] = True
        await self._write(self.fmt.chunk(self.ids, Choice(index, text, None)))

    async def chunk(
        self, index: int, chunk: StreamChunk, entries: list[TokenLogprob] | None, top: bool
    ) -> None:
        if chunk.tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.completion_tokens += len(chunk.tokens)
        thought, text = "", chunk.text
        if self.replies is not None:
            thought, text = self.replies[index].feed(text)
        if text or thought or entries:
            choice = Choice(index, text, None, entries, top, reasoning=thought or None)
            await self._write(self.fmt.chunk(self.ids, choice))

    async def finish(
        self,
        index: int,
        record: RequestRecord,
        entries: list[TokenLogprob] | None = None,
        top_asked: bool = False,
    ) -> None:
        """The choice's last chunk: its finish reason, with the stop token's log-prob entry
        (after the content held back and the tool calls, if it called any)."""
        reason = record.finish_reason
        if self.replies is not None:
            held = self.replies[index].close(reason)
            reason = held.finish_reason
            if held.reasoning or held.content or held.calls:
                last = Choice(
                    index, held.content, None, tool_calls=held.calls, reasoning=held.reasoning
                )
                await self._write(self.fmt.chunk(self.ids, last))
        choice = Choice(index, "", reason, entries or None, top_asked)
        await self._write(self.fmt.chunk(self.ids, choice))

    async def done(self, final_usage: dict[str, int] | None) -> None:
        if final_usage is not None:
            await self._write(self.fmt.usage_chunk(self.ids, final_usage))
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
