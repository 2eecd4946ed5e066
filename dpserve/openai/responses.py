"""Response and stream-chunk shapes of the OpenAI API (pure: dicts and bytes)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Final, Protocol

from aiohttp import web

from dpserve.client import RequestRecord
from dpserve.openai.tool_calls import ToolCall

COMPLETIONS_ENDPOINT: Final = "/v1/completions"
CHAT_ENDPOINT: Final = "/v1/chat/completions"
MODELS_ENDPOINT: Final = "/v1/models"

SSE_DONE: Final = b"data: [DONE]\n\n"


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


def record_usage(record: RequestRecord) -> dict[str, Any]:
    return with_cached_tokens(
        usage(len(record.prompt_tokens), completion_tokens(record)), [[record]]
    )


def completion_tokens(record: RequestRecord) -> int:
    """Generated tokens, the stop token included when EOS / termination_id ended the request
    (as vLLM and llama.cpp count: the model did generate it; it is not in the text)."""
    return len(record.generated_tokens) + (record.stop_token is not None)


def records_usage(per_prompt: list[list[RequestRecord]]) -> dict[str, Any]:
    """One request's usage over its returned choices: every prompt once (its n choices share
    it), every choice's generated tokens (as vLLM's serving_completion counts)."""
    prompt_tokens = sum(len(records[0].prompt_tokens) for records in per_prompt if records)
    generated = sum(completion_tokens(r) for records in per_prompt for r in records)
    return with_cached_tokens(usage(prompt_tokens, generated), per_prompt)


def with_cached_tokens(
    counts: dict[str, Any], per_prompt: list[list[RequestRecord]]
) -> dict[str, Any]:
    """OpenAI's ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix
    cache, each prompt once (a resumed request's cached context may include generated tokens:
    never more than the prompt). Absent when no engine reported it."""
    reported = [
        records[0] for records in per_prompt if records and records[0].cached_tokens is not None
    ]
    if reported:
        counts["prompt_tokens_details"] = {
            "cached_tokens": sum(min(r.cached_tokens or 0, len(r.prompt_tokens)) for r in reported)
        }
    return counts


def sse_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # keep reverse proxies from buffering the stream
        }
    )


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token of a choice with its log-prob (None: the prompt's first token, or a token
    generated before a resume) and its alternatives (token text, log-prob), when asked for."""

    text: str
    logprob: float | None
    top: list[tuple[str, float]] | None


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    top_asked: bool = False  # alternatives were asked for (completions: a dict per token)
    tool_calls: tuple[ToolCall, ...] = ()  # chat: the calls read out of the reply
    reasoning: str | None = None  # chat: the thought (--reasoning-parser)


class ResponseFormat(Protocol):
    """How one endpoint shapes its responses and stream chunks."""

    endpoint: str
    id_prefix: str

    def response(
        self, ids: ResponseIds, choices: list[Choice], usage: dict[str, int]
    ) -> dict[str, Any]: ...

    def opening_chunks(self, ids: ResponseIds, indices: range) -> list[dict[str, Any]]: ...

    def chunk(self, ids: ResponseIds, choice: Choice) -> dict[str, Any]: ...

    def usage_chunk(self, ids: ResponseIds, usage: dict[str, int]) -> dict[str, Any]: ...


def _completion_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    offsets, position = [], 0
    for entry in choice.logprobs:
        offsets.append(position)
        position += len(entry.text)
    return {
        "tokens": [entry.text for entry in choice.logprobs],
        "token_logprobs": [entry.logprob for entry in choice.logprobs],
        "top_logprobs": [
            None if entry.top is None else dict(entry.top) for entry in choice.logprobs
        ]
        if choice.top_asked
        else None,
        "text_offset": offsets,
    }


def _chat_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    return {
        "content": [
            {
                "token": entry.text,
                "logprob": entry.logprob,
                "bytes": list(entry.text.encode("utf-8")),
                "top_logprobs": [
                    {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
                    for text, logprob in entry.top or []
                ],
            }
            for entry in choice.logprobs
        ]
    }


def _message(choice: Choice) -> dict[str, Any]:
    """A chat choice's message: its text, and its tool calls (then a reply of calls alone has
    null content, as OpenAI's)."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.tool_calls:
        message["content"] = choice.text or None
        message["tool_calls"] = [call.as_openai() for call in choice.tool_calls]
    return {**message, **_thought(choice)}


def _thought(choice: Choice) -> dict[str, str]:
    """vLLM's ``reasoning`` and its earlier name ``reasoning_content`` (DeepSeek's API's,
    which LangChain and Open WebUI read), when the choice has a thought."""
    if choice.reasoning is None:
        return {}
    return {"reasoning": choice.reasoning, "reasoning_content": choice.reasoning}


class CompletionFormat:
    endpoint = COMPLETIONS_ENDPOINT
    id_prefix = "cmpl-"
    object_name = "text_completion"

    def response(
        self, ids: ResponseIds, choices: list[Choice], usage: dict[str, int]
    ) -> dict[str, Any]:
        return {
            **self._envelope(ids),
            "choices": [self._choice(choice) for choice in choices],
            "usage": usage,
        }

    def opening_chunks(self, ids: ResponseIds, indices: range) -> list[dict[str, Any]]:
        return []

    def chunk(self, ids: ResponseIds, choice: Choice) -> dict[str, Any]:
        return {**self._envelope(ids), "choices": [self._choice(choice)]}

    def usage_chunk(self, ids: ResponseIds, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(ids), "choices": [], "usage": usage}

    @staticmethod
    def _choice(choice: Choice) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": choice.text,
            "finish_reason": choice.finish_reason,
            "logprobs": _completion_logprobs(choice),
        }

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
        self, ids: ResponseIds, choices: list[Choice], usage: dict[str, int]
    ) -> dict[str, Any]:
        return {
            **self._envelope(ids, "chat.completion"),
            "choices": [
                {
                    "index": choice.index,
                    "message": _message(choice),
                    "finish_reason": choice.finish_reason,
                    "logprobs": _chat_logprobs(choice),
                }
                for choice in choices
            ],
            "usage": usage,
        }

    def opening_chunks(self, ids: ResponseIds, indices: range) -> list[dict[str, Any]]:
        return [
            self._chunk(ids, index, {"role": "assistant", "content": ""}, None, None)
            for index in indices
        ]

    def chunk(self, ids: ResponseIds, choice: Choice) -> dict[str, Any]:
        delta: dict[str, Any] = _thought(choice)
        if choice.text or (
            choice.finish_reason is None and not choice.tool_calls and choice.reasoning is None
        ):
            delta["content"] = choice.text
        if choice.tool_calls:
            delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(choice.tool_calls)]
        return self._chunk(ids, choice.index, delta, choice.finish_reason, _chat_logprobs(choice))

    def usage_chunk(self, ids: ResponseIds, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(ids, "chat.completion.chunk"), "choices": [], "usage": usage}

    def _chunk(
        self,
        ids: ResponseIds,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
        return {**self._envelope(ids, "chat.completion.chunk"), "choices": [choice]}

    @staticmethod
    def _envelope(ids: ResponseIds, object_name: str) -> dict[str, Any]:
        return {"id": ids.id, "object": object_name, "created": ids.created, "model": ids.model}
