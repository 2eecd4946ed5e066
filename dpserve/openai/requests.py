"""OpenAI request bodies -> a validated prompt and ``SamplingParams``: the one place that
reads them, with the table of every field a client may send and what this server does with it.
Pure functions, no I/O; the handlers in ``app`` call them.

Every limit of ``dpserve.limits.RequestLimits`` that can be known before the coordinator
tokenizes is checked here (prompt characters, token-id prompt length, ``max_tokens``, stop
strings; the body's size, depth and text in ``body``; the encoded message size in ``app``),
so a request that would fail later is refused now, with a 400 that names the limit.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Final

from dpserve import protocol
from dpserve.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.prompts import parse_messages, parse_prompt
from dpserve.openai.values import (
    is_int,
    read_bool,
    read_int,
    read_number,
    read_positive_int,
    same_json,
)
from dpserve.protocol import Header
from dpserve.sampling import InvalidSamplingParams, SamplingParams
from dpserve.tokenizer import BatchTokenizer

DEFAULT_COMPLETION_MAX_TOKENS: Final = 16
DEFAULT_CHAT_MAX_TOKENS: Final = 512


class Handling(enum.Enum):
    HONOURED = "honoured"  # read into the prompt, SamplingParams or the response's shape
    INFORMATIONAL = "informational"  # type-checked and accepted; it asks nothing of generation
    NO_OP_ONLY = "no-op only"  # accepted only at values that change nothing; others are a 400


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    handling: Handling
    note: str
    no_ops: tuple[object, ...] = ()


def _honoured(note: str) -> Field:
    return Field(Handling.HONOURED, note)


def _no_op(note: str, *values: object) -> Field:
    return Field(Handling.NO_OP_ONLY, note, values)


# Every field OpenAI's API or vLLM's extensions define that clients send, on both endpoints.
# A field not in the table for its endpoint is refused with a 400 naming it; a null value is
# the same as an absent field. Nothing is ignored silently.
COMMON_FIELDS: Final[dict[str, Field]] = {
    "model": Field(Handling.INFORMATIONAL, "one model is served; the response names it"),
    "user": Field(Handling.INFORMATIONAL, "an end-user id for the caller's records; not stored"),
    "stream": _honoured("SSE chunks, then data: [DONE]"),
    "stream_options": _honoured("include_usage (a final usage chunk), continuous_usage_stats"),
    "temperature": _honoured("SamplingParams.temperature; below 1e-5 decodes greedily"),
    "top_p": _honoured("SamplingParams.top_p"),
    "top_k": _honoured("vLLM extension: SamplingParams.top_k (0 or -1 disables it)"),
    "seed": _honoured("SamplingParams.seed: same seed, prompt and model give the same tokens"),
    "stop": _honoured("SamplingParams.stop_strings (a string or a list)"),
    "max_tokens": _honoured("SamplingParams.num_tokens_to_generate"),
    "ignore_eos": _honoured("vLLM extension: SamplingParams.ignore_eos"),
    "min_tokens": _honoured("vLLM extension: SamplingParams.min_tokens"),
    "logprobs": _honoured("the sampled tokens' log-probs; not with stream"),
    "n": _no_op("one choice per request", 1),
    "best_of": _no_op("one candidate per request", 1),
    "presence_penalty": _no_op("penalties are not implemented", 0),
    "frequency_penalty": _no_op("penalties are not implemented", 0),
    "repetition_penalty": _no_op("vLLM extension; penalties are not implemented", 1),
    "logit_bias": _no_op("not implemented", {}),
    "min_p": _no_op("vLLM extension; not implemented", 0),
    "stop_token_ids": _no_op("vLLM extension; not implemented", []),
    "include_stop_str_in_output": _no_op("vLLM extension; stop strings are cut", False),
    "skip_special_tokens": _no_op("vLLM extension; special tokens are always skipped", True),
    "spaces_between_special_tokens": _no_op("vLLM extension", True),
    "response_format": _no_op("plain text only", {"type": "text"}),
    "priority": _no_op("vLLM extension; no priorities", 0),
    "store": _no_op("nothing is stored", False),
    "metadata": _no_op("nothing is stored", {}),
}
COMPLETION_FIELDS: Final[dict[str, Field]] = {
    **COMMON_FIELDS,
    "prompt": _honoured("one string or one list of token ids"),
    "echo": _no_op("the prompt is not repeated", False),
    "suffix": _no_op("no insertion", ""),
}
CHAT_FIELDS: Final[dict[str, Field]] = {
    **COMMON_FIELDS,
    "messages": _honoured("role + text content, rendered with the model's chat template"),
    "max_completion_tokens": _honoured("OpenAI's newer name of max_tokens; wins over it"),
    "top_logprobs": _no_op("alternatives are not computed: logprobs gives the sampled token", 0),
    "tools": _no_op("no tool calling", []),
    "functions": _no_op("no tool calling", []),
    "tool_choice": _no_op("no tool calling", "none"),
    "function_call": _no_op("no tool calling", "none"),
    "parallel_tool_calls": _no_op("no tool calling, so nothing to parallelize", True, False),
    "modalities": _no_op("text only", ["text"]),
    "add_generation_prompt": _no_op("vLLM extension; always added", True),
    "continue_final_message": _no_op("vLLM extension; not implemented", False),
    "echo": _no_op("vLLM extension; the prompt is not repeated", False),
}
STREAM_OPTIONS: Final = frozenset({"include_usage", "continuous_usage_stats"})


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request, ready for the client."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final chunk with token counts
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk


def parse_completion_request(
    body: Mapping[str, Any], limits: RequestLimits = DEFAULT_REQUEST_LIMITS
) -> GenerationRequest:
    """Validate a ``/v1/completions`` body."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = parse_prompt(body.get("prompt"))
    _check_prompt_size(prompt, limits)
    return_log_probs = _completion_logprobs(body.get("logprobs"))
    return _generation_request(
        body, prompt, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, return_log_probs, limits
    )


def parse_chat_request(
    body: Mapping[str, Any],
    tokenizer: BatchTokenizer,
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its messages with the chat template."""
    _check_fields(body, CHAT_FIELDS)
    messages = parse_messages(body.get("messages"))
    chars = sum(len(message["content"]) for message in messages)
    if chars > limits.max_prompt_chars:
        raise _over_limit("the messages' text", chars, "characters", "max_prompt_chars", limits)
    return_log_probs = read_bool(body, "logprobs", default=False)
    # max_completion_tokens is the newer name; max_tokens is deprecated but still sent.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # Parameters first: rendering a template costs more than checking a few fields.
    request = _generation_request(body, "", key, DEFAULT_CHAT_MAX_TOKENS, return_log_probs, limits)
    try:
        prompt = tokenizer.apply_chat_template(messages)
    except Exception as exc:  # a template may raise anything (jinja's raise_exception included)
        raise InvalidRequest(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    if not prompt:
        raise InvalidRequest("the chat template rendered an empty prompt", param="messages")
    # The limit is on the text the model reads (the coordinator checks the same): the
    # template's own characters count.
    if len(prompt) > limits.max_prompt_chars:
        raise _over_limit(
            "the rendered conversation",
            len(prompt),
            "characters",
            "max_prompt_chars",
            limits,
            param="messages",
        )
    return dataclasses.replace(request, prompt=prompt)


def _check_fields(body: Mapping[str, Any], known: Mapping[str, Field]) -> None:
    for name, value in body.items():
        if value is None:
            continue
        field = known.get(name)
        if field is None:
            raise InvalidRequest(
                f"unknown field {name!r}: this server does not support it",
                param=name,
                code="unknown_field",
            )
        if field.handling is Handling.NO_OP_ONLY and not any(
            same_json(value, ok) for ok in field.no_ops
        ):
            raise InvalidRequest(
                f"{name} is not supported by this server ({field.note}); accepted only as "
                + " or ".join(repr(ok) for ok in field.no_ops),
                param=name,
                code="unsupported_field",
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("user must be a string", param="user")


def _check_prompt_size(prompt: str | list[int], limits: RequestLimits) -> None:
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise _over_limit("the prompt", len(prompt), "characters", "max_prompt_chars", limits)
    elif len(prompt) > limits.max_prompt_tokens:
        raise _over_limit("the prompt", len(prompt), "tokens", "max_prompt_tokens", limits)


def _over_limit(
    what: str, size: int, unit: str, limit: str, limits: RequestLimits, param: str = "prompt"
) -> InvalidRequest:
    flag = "--" + limit.replace("_", "-")
    return InvalidRequest(
        f"{what} has {size} {unit}, more than {limit}={getattr(limits, limit)} (flag {flag})",
        param=param,
        code=limit,
    )


def _generation_request(
    body: Mapping[str, Any],
    prompt: str | list[int],
    max_tokens_key: str,
    default_max_tokens: int,
    return_log_probs: bool,
    limits: RequestLimits,
) -> GenerationRequest:
    max_tokens = read_positive_int(body, max_tokens_key, default_max_tokens)
    if max_tokens > limits.max_new_tokens:
        raise _over_limit(
            max_tokens_key, max_tokens, "tokens", "max_new_tokens", limits, max_tokens_key
        )
    stream = read_bool(body, "stream", default=False)
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    if stream and return_log_probs:
        raise InvalidRequest("logprobs are not available for streamed responses", param="logprobs")
    top_k = read_int(body, "top_k", 0)
    try:
        params = SamplingParams(
            temperature=read_number(body, "temperature", 1.0),
            top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's spelling of "disabled"
            top_p=read_number(body, "top_p", 1.0),
            num_tokens_to_generate=max_tokens,
            stop_strings=_stop_strings(body.get("stop"), limits),
            return_log_probs=return_log_probs,
            seed=read_int(body, "seed", None),
            stream=stream,
            ignore_eos=read_bool(body, "ignore_eos", default=False),
            min_tokens=read_int(body, "min_tokens", 0),
        )
    except InvalidSamplingParams as exc:  # SamplingParams owns the value rules
        raise InvalidRequest(str(exc), param=_param_named_in(str(exc), max_tokens_key)) from None
    return GenerationRequest(prompt, params, stream, include_usage, continuous_usage)


# SamplingParams' field names as the API spells them.
_API_NAMES: Final = {
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


def _stop_strings(stop: object, limits: RequestLimits) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > limits.max_stop_strings:
        raise _over_limit("stop", len(stops), "strings", "max_stop_strings", limits, "stop")
    longest = max(len(s) for s in stops) if stops else 0
    if longest > limits.max_stop_string_chars:
        raise _over_limit(
            "a stop string", longest, "characters", "max_stop_string_chars", limits, "stop"
        )
    return tuple(stops)


def _completion_logprobs(value: object) -> bool:
    # Legacy completions take an int: how many alternatives per token besides the sampled one.
    # 0 (or true) asks for the sampled tokens' log-probs, which is what this server returns.
    if value is None or value is False:
        return False
    if value is True or (is_int(value) and value == 0):
        return True
    raise InvalidRequest(
        "logprobs must be 0 or true: the sampled tokens' log-probs are returned, alternatives "
        "are not computed",
        param="logprobs",
    )


def _stream_options(options: object, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)"""
    if options is None:
        return False, False
    if not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    unknown = sorted(k for k, v in options.items() if v is not None and k not in STREAM_OPTIONS)
    if unknown:
        raise InvalidRequest(
            f"unknown stream_options field {unknown[0]!r}; known: "
            + ", ".join(sorted(STREAM_OPTIONS)),
            param=f"stream_options.{unknown[0]}",
            code="unknown_field",
        )
    return (
        read_bool(options, "include_usage", default=False, param="stream_options.include_usage"),
        read_bool(
            options,
            "continuous_usage_stats",
            default=False,
            param="stream_options.continuous_usage_stats",
        ),
    )


def check_message_size(job: GenerationRequest, max_message_bytes: int) -> None:
    """Refuse a request whose SUBMIT message would exceed the coordinator's message limit: it
    would be dropped on the wire. (Token ids travel packed, 4 bytes each: a JSON list of
    small ids is smaller than its message.)"""
    prompt = job.prompt if isinstance(job.prompt, str) else protocol.pack_tokens(job.prompt)
    # The largest request id the client can send, so the estimate never falls short.
    message = protocol.encode(Header.SUBMIT_REQUEST, 2**63 - 1, prompt, job.params.serialize())
    if len(message) > max_message_bytes:
        raise InvalidRequest(
            f"the request encodes to {len(message)} bytes, more than the coordinator's message "
            f"limit of {max_message_bytes} bytes (max_message_bytes: flag --max-body-bytes, "
            "or the coordinator's --max-message-bytes)",
            param="prompt",
            code="max_message_bytes",
        )
