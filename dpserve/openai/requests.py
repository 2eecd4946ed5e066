"""OpenAI request bodies -> a validated prompt and ``SamplingParams``: the one place that
reads them. Pure functions, no I/O; the handlers in ``app`` call them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from dpserve.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.values import (
    is_int,
    is_token_id,
    json_type,
    read_bool,
    read_int,
    read_number,
    read_positive_int,
    same_json,
)
from dpserve.sampling import InvalidSamplingParams, SamplingParams
from dpserve.tokenizer import BatchTokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 512


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
            f"the request body must be a JSON object, got {json_type(body)}", code="invalid_json"
        )
    return body


def parse_completion_request(
    body: Mapping[str, Any], limits: RequestLimits = DEFAULT_REQUEST_LIMITS
) -> GenerationRequest:
    """Validate a ``/v1/completions`` body."""
    prompt = parse_prompt(body.get("prompt"))
    return_log_probs = _completion_logprobs(body.get("logprobs"))
    max_tokens = read_positive_int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    return _generation_request(body, prompt, "max_tokens", max_tokens, return_log_probs)


def parse_chat_request(
    body: Mapping[str, Any],
    tokenizer: BatchTokenizer,
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its messages with the chat template."""
    messages = parse_messages(body.get("messages"))
    return_log_probs = _chat_logprobs(body)
    # max_completion_tokens is the newer name; max_tokens is deprecated but still sent.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = read_positive_int(body, key, DEFAULT_CHAT_MAX_TOKENS)
    # Parameters first: rendering a template costs more than checking a few fields.
    request = _generation_request(body, "", key, max_tokens, return_log_probs)
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
        if all(is_token_id(token) for token in prompt):
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
        f"prompt must be a string or a list of token ids, got {json_type(prompt)}",
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
    body: Mapping[str, Any],
    prompt: str | list[int],
    max_tokens_key: str,
    max_tokens: int,
    return_log_probs: bool,
) -> GenerationRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise InvalidRequest("only n=1 is supported", param="n")
    for name, no_ops in _NO_OP_VALUES.items():
        value = body.get(name)
        if value is not None and not any(same_json(value, ok) for ok in no_ops):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)
    stream = read_bool(body, "stream", default=False)
    include_usage = _include_usage(body.get("stream_options"), stream)
    if stream and return_log_probs:
        raise InvalidRequest("logprobs are not available for streamed responses", param="logprobs")
    top_k = read_int(body, "top_k", 0)
    try:
        params = SamplingParams(
            temperature=read_number(body, "temperature", 1.0),
            top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's spelling of "disabled"
            top_p=read_number(body, "top_p", 1.0),
            num_tokens_to_generate=max_tokens,
            stop_strings=_stop_strings(body.get("stop")),
            return_log_probs=return_log_probs,
            seed=read_int(body, "seed", None),
            stream=stream,
        )
    except InvalidSamplingParams as exc:  # SamplingParams owns the value rules
        raise InvalidRequest(str(exc), param=_param_named_in(str(exc), max_tokens_key)) from None
    return GenerationRequest(prompt, params, stream, include_usage)


# SamplingParams' field names as the API spells them.
_API_NAMES = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "stop_string": "stop",
    "stop string": "stop",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
}


def _param_named_in(message: str, max_tokens_key: str) -> str | None:
    """The API parameter a ``SamplingParams`` refusal names first (its message leads with the
    field)."""
    names = {**_API_NAMES, "num_tokens_to_generate": max_tokens_key}
    found = [(message.find(field), param) for field, param in names.items() if field in message]
    return min(found)[1] if found else None


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them", param="stop")
    return tuple(stops)


def _completion_logprobs(value: Any) -> bool:
    # Legacy completions take an int: how many alternatives per token. Any int >= 0 asks for
    # the sampled tokens' log-probs, which is what this server returns.
    if value is None or value is False:
        return False
    if value is True:
        return True
    if is_int(value) and value >= 0:
        return True
    raise InvalidRequest("logprobs must be an integer >= 0 or a boolean", param="logprobs")


def _chat_logprobs(body: Mapping[str, Any]) -> bool:
    wanted = read_bool(body, "logprobs", default=False)
    top = body.get("top_logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= 20:
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
    return read_bool(options, "include_usage", default=False, param="stream_options.include_usage")
