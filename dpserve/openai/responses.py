"""Response and stream-chunk shapes of the OpenAI API (pure: dicts and bytes)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Final, Protocol

from aiohttp import web

from dpserve.client import RequestRecord
from dpserve.openai.logprobs import token_logprob_pairs

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
    counts: dict[str, Any] = usage(len(record.prompt_tokens), len(record.generated_tokens))
    if record.cached_tokens is not None:
        # OpenAI's field: prompt tokens served from the prefix cache (a resumed request's
        # cached context may include generated tokens: never more than the prompt).
        cached = min(record.cached_tokens, len(record.prompt_tokens))
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
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
        return {**self._envelope(ids), "choices": [choice], "usage": record_usage(record)}

    def opening_chunks(self, ids: ResponseIds) -> list[dict[str, Any]]:
        return []

    def chunk(self, ids: ResponseIds, text: str) -> dict[str, Any]:
        return self._chunk(ids, text, None)

    def final_chunk(self, ids: ResponseIds, finish_reason: str) -> dict[str, Any]:
        return self._chunk(ids, "", finish_reason)

    def usage_chunk(self, ids: ResponseIds, record: RequestRecord) -> dict[str, Any]:
        return {**self._envelope(ids), "choices": [], "usage": record_usage(record)}

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
            "usage": record_usage(record),
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
            "usage": record_usage(record),
        }

    def _chunk(
        self, ids: ResponseIds, delta: dict[str, str], finish_reason: str | None
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._envelope(ids, "chat.completion.chunk"), "choices": [choice]}

    @staticmethod
    def _envelope(ids: ResponseIds, object_name: str) -> dict[str, Any]:
        return {"id": ids.id, "object": object_name, "created": ids.created, "model": ids.model}
