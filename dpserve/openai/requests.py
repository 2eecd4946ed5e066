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
import json
from collections.abc import Mapping
from typing import Any, Final

from dpserve import protocol
from dpserve.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.guided import check_size, parse_guided, schema_param
from dpserve.openai.prompts import (
    chat_template_kwargs,
    message_chars,
    parse_messages,
    parse_prompts,
)
from dpserve.openai.reasoning import Reasoning
from dpserve.openai.tools import ToolCalling, parse_tool_calling
from dpserve.openai.values import (
    is_int,
    read_bool,
    read_int,
    read_number,
    read_positive_int,
    same_json,
)
from dpserve.protocol import SubmitRequest
from dpserve.reply_formats import NO_REPLY_PARSERS, ReplyParsers
from dpserve.sampling import InvalidSamplingParams, SamplingParams
from dpserve.tokenizer import BatchTokenizer, ChatRendering

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
    "model": Field(
        Handling.HONOURED,
        "the base model or a LoRA adapter (openai.adapters); the response names it",
    ),
    "user": Field(Handling.INFORMATIONAL, "an end-user id for the caller's records; not stored"),
    "stream": _honoured("SSE chunks, then data: [DONE]"),
    "stream_options": _honoured("include_usage (a final usage chunk), continuous_usage_stats"),
    "temperature": _honoured("SamplingParams.temperature, in [0, 2]; below 1e-5 decodes greedily"),
    "top_p": _honoured("SamplingParams.top_p"),
    "top_k": _honoured("vLLM extension: SamplingParams.top_k (0 or -1 disables it)"),
    "seed": _honoured("SamplingParams.seed: same seed, prompt and model give the same tokens"),
    "stop": _honoured("SamplingParams.stop_strings (a string or a list)"),
    "max_tokens": _honoured("SamplingParams.num_tokens_to_generate"),
    "ignore_eos": _honoured("vLLM extension: SamplingParams.ignore_eos"),
    "min_tokens": _honoured("vLLM extension: SamplingParams.min_tokens"),
    "cache_salt": _honoured(
        "vLLM extension: SamplingParams.cache_salt; requests with different salts never share "
        "prefix-cache blocks (docs/security.md)"
    ),
    "logprobs": _honoured("the sampled tokens' log-probs (completions: and k alternatives)"),
    "n": _honoured("choices per prompt, each its own random stream (seed + i with a seed)"),
    "presence_penalty": _honoured("SamplingParams.presence_penalty, in [-2, 2]"),
    "frequency_penalty": _honoured("SamplingParams.frequency_penalty, in [-2, 2]"),
    "repetition_penalty": _honoured("vLLM extension: SamplingParams.repetition_penalty (> 0)"),
    "response_format": _honoured("text, json_object or json_schema: the output is constrained"),
    "guided_json": _honoured("vLLM extension: a JSON schema the output follows"),
    "guided_regex": _honoured("vLLM extension: a regular expression the output matches"),
    "guided_choice": _honoured("vLLM extension: the output is one of these strings"),
    "logit_bias": _honoured(
        "token id (a string) -> bias in [-100, 100], added to its logit: SamplingParams.logit_bias"
    ),
    "min_p": _honoured("vLLM extension: SamplingParams.min_p, in [0, 1] (0 disables it)"),
    "stop_token_ids": _honoured(
        "vLLM extension: SamplingParams.stop_token_ids, tokens that end a choice as EOS does"
    ),
    "include_stop_str_in_output": _honoured(
        "vLLM extension: the stop string that ended a choice stays in its text"
    ),
    "skip_special_tokens": _no_op("vLLM extension; special tokens are always skipped", True),
    "spaces_between_special_tokens": _no_op("vLLM extension", True),
    "priority": _no_op("vLLM extension; no priorities", 0),
    "store": _no_op("nothing is stored", False),
    "metadata": _no_op("nothing is stored", {}),
}
COMPLETION_FIELDS: Final[dict[str, Field]] = {
    **COMMON_FIELDS,
    "prompt": _honoured("a string, a list of token ids, or a list of either (several prompts)"),
    "best_of": _honoured("candidates per prompt; the n with the highest log-prob are returned"),
    "echo": _honoured("the prompt before the completion; with logprobs its tokens' log-probs"),
    "suffix": _no_op("no insertion", ""),
}
CHAT_FIELDS: Final[dict[str, Field]] = {
    **COMMON_FIELDS,
    "messages": _honoured("role + text content, rendered with the model's chat template"),
    "max_completion_tokens": _honoured("OpenAI's newer name of max_tokens; wins over it"),
    "top_logprobs": _honoured("alternatives per token, with logprobs: true (at most 20)"),
    "tools": _honoured("functions the chat template shows the model (openai.tools)"),
    "tool_choice": _honoured(
        "none, auto (needs --tool-call-parser), required or a named function: the reply's "
        "calls come back as message.tool_calls (openai.tools, openai.tool_calls)"
    ),
    "parallel_tool_calls": _honoured("false: at most one call (tool_choice required)"),
    "functions": _no_op("deprecated by OpenAI: send tools", []),
    "function_call": _no_op("deprecated by OpenAI: send tool_choice", "none"),
    "modalities": _no_op("text only", ["text"]),
    "add_generation_prompt": _honoured(
        "vLLM extension: false renders no opening of the assistant's turn after the messages"
    ),
    "chat_template_kwargs": _honoured(
        "vLLM extension: more variables for the chat template (e.g. Qwen3's enable_thinking); "
        "a template that does not use one renders as without it"
    ),
    "continue_final_message": _honoured(
        "vLLM extension: the final message is left open and the reply continues it (with "
        "add_generation_prompt false)"
    ),
    "echo": _no_op("vLLM extension; the prompt is not repeated", False),
}
STREAM_OPTIONS: Final = frozenset({"include_usage", "continuous_usage_stats"})


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request, ready for the client."""

    prompt: str | list[int]  # the first (usually only) prompt
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final chunk with token counts
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # candidates generated per prompt (>= n); the n most likely are returned
    echo: bool = False  # the prompt's text (and log-probs) before each choice
    prompts: tuple[str | list[int], ...] = ()  # every prompt (completions may send a list)
    # The client did not ask for log-probs: they were turned on to rank best_of candidates.
    hide_logprobs: bool = False
    drop_generated: bool = False  # max_tokens 0 with echo: one token is generated, not shown
    # The parameter its JSON schema came in, if any: the schema's own check
    # (``guided.check_constraint``) runs off the event loop after parsing, and names it.
    schema_param: str | None = None
    # Chat: the tools and tool_choice; each choice's reply is parsed for calls.
    tool_calling: ToolCalling | None = None
    # Chat: how each choice's thought is told from its answer (--reasoning-parser).
    reasoning: Reasoning | None = None

    @property
    def all_prompts(self) -> tuple[str | list[int], ...]:
        return self.prompts or (self.prompt,)


def parse_completion_request(
    body: Mapping[str, Any], limits: RequestLimits = DEFAULT_REQUEST_LIMITS
) -> GenerationRequest:
    """Validate a ``/v1/completions`` body."""
    _check_fields(body, COMPLETION_FIELDS)
    prompts = parse_prompts(body.get("prompt"), limits.max_prompts)
    for prompt in prompts:
        _check_prompt_size(prompt, limits)
    top_logprobs = _completion_logprobs(body.get("logprobs"), limits)
    echo = read_bool(body, "echo", default=False)
    max_tokens = body.get("max_tokens")
    drop_generated = echo and is_int(max_tokens) and max_tokens == 0
    if drop_generated:
        body = {**body, "max_tokens": 1}  # the prompt's log-probs come with the first token
    request = _generation_request(
        body,
        prompts[0],
        "max_tokens",
        DEFAULT_COMPLETION_MAX_TOKENS,
        top_logprobs is not None,
        limits,
        top_logprobs or 0,
    )
    n = request.n
    best_of = read_positive_int(body, "best_of", n)
    if best_of < n:
        raise InvalidRequest(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if best_of > limits.max_choices:
        raise _over_limit("best_of", best_of, "candidates", "max_choices", limits, "best_of")
    if best_of > n and request.stream:
        raise InvalidRequest("best_of > n cannot be streamed", param="best_of")
    if echo and request.stream and (drop_generated or top_logprobs is not None):
        raise InvalidRequest(
            "echo with logprobs or max_tokens 0 cannot be streamed (the prompt's log-probs come "
            "with the whole response)",
            param="echo",
        )
    if best_of * len(prompts) > limits.max_request_sequences:
        raise _over_limit(
            "best_of (or n) x prompts",
            best_of * len(prompts),
            "sequences",
            "max_request_sequences",
            limits,
            "n",
        )
    params = request.params
    hide = best_of > n and not params.return_log_probs
    if hide:
        params = dataclasses.replace(params, return_log_probs=True)
    if echo and params.return_log_probs:
        params = dataclasses.replace(params, prompt_logprobs=True)
    return dataclasses.replace(
        request,
        params=params,
        best_of=best_of,
        echo=echo,
        prompts=tuple(prompts),
        hide_logprobs=hide,
        drop_generated=drop_generated,
    )


def parse_chat_request(
    body: Mapping[str, Any],
    tokenizer: BatchTokenizer,
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
    parsers: ReplyParsers = NO_REPLY_PARSERS,
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its messages (and tools) with the
    chat template. ``parsers``: what the server reads out of replies."""
    _check_fields(body, CHAT_FIELDS)
    messages = parse_messages(body.get("messages"))
    tool_calling = parse_tool_calling(body, parsers.tool_calls)
    # Bounded before the template renders them (on the front's event loop): the messages'
    # text and the tools' JSON, which the template writes into the prompt.
    template_kwargs = chat_template_kwargs(body.get("chat_template_kwargs"))
    chars = message_chars(messages) + (tool_calling.chars if tool_calling is not None else 0)
    chars += len(json.dumps(template_kwargs)) if template_kwargs else 0
    if chars > limits.max_prompt_chars:
        raise _over_limit(
            "the messages' text and tools", chars, "characters", "max_prompt_chars", limits
        )
    return_log_probs = read_bool(body, "logprobs", default=False)
    top_logprobs = read_int(body, "top_logprobs", 0)
    if top_logprobs and not return_log_probs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    _check_top_logprobs(top_logprobs, limits, "top_logprobs")
    # max_completion_tokens is the newer name; max_tokens is deprecated but still sent.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # Parameters first: rendering a template costs more than checking a few fields.
    request = _generation_request(
        body, "", key, DEFAULT_CHAT_MAX_TOKENS, return_log_probs, limits, top_logprobs
    )
    if tool_calling is not None:
        request = _with_tool_calling(request, tool_calling, limits)
    add_generation_prompt = read_bool(body, "add_generation_prompt", default=True)
    continue_final_message = read_bool(body, "continue_final_message", default=False)
    reasoning = None
    # A constrained reply (structured output, a forced tool call) has no thought: the
    # constraint holds from its first token (vLLM lets the model think first).
    if parsers.reasoning is not None and not request.params.guided:
        thinking = (template_kwargs or {}).get("enable_thinking", True) is not False
        reasoning = Reasoning(parsers.reasoning, thinking)
    if add_generation_prompt and continue_final_message:
        raise InvalidRequest(
            "continue_final_message continues the final message: send it with "
            "add_generation_prompt false",
            param="continue_final_message",
        )
    try:
        prompt = tokenizer.apply_chat_template(
            messages,
            ChatRendering(
                tool_calling.template_tools if tool_calling is not None else None,
                add_generation_prompt,
                continue_final_message,
                template_kwargs,
            ),
        )
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
    return dataclasses.replace(request, prompt=prompt, reasoning=reasoning)


def _with_tool_calling(
    request: GenerationRequest, calling: ToolCalling, limits: RequestLimits
) -> GenerationRequest:
    """A named or required tool choice constrains the reply to the calls' schema."""
    schema = calling.constraint()
    if schema is None:
        return dataclasses.replace(request, tool_calling=calling)
    check_size({"guided_json": schema}, limits, param="tools")
    try:
        params = dataclasses.replace(request.params, guided_json=schema)
    except InvalidSamplingParams as exc:
        raise InvalidRequest(str(exc), param="tools") from None
    return dataclasses.replace(request, params=params, tool_calling=calling, schema_param="tools")


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
    top_logprobs: int = 0,
) -> GenerationRequest:
    max_tokens = read_positive_int(body, max_tokens_key, default_max_tokens)
    n = read_positive_int(body, "n", 1)
    if n > limits.max_choices:
        raise _over_limit("n", n, "choices", "max_choices", limits, "n")
    if max_tokens > limits.max_new_tokens:
        raise _over_limit(
            max_tokens_key, max_tokens, "tokens", "max_new_tokens", limits, max_tokens_key
        )
    stream = read_bool(body, "stream", default=False)
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    top_k = read_int(body, "top_k", 0)
    guided = parse_guided(body, limits)
    try:
        params = SamplingParams(
            temperature=read_number(body, "temperature", 1.0),
            top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's spelling of "disabled"
            top_p=read_number(body, "top_p", 1.0),
            min_p=read_number(body, "min_p", 0.0),
            num_tokens_to_generate=max_tokens,
            stop_strings=_stop_strings(body.get("stop"), limits),
            stop_token_ids=_stop_token_ids(body.get("stop_token_ids"), limits),
            logit_bias=_logit_bias(body.get("logit_bias"), limits),
            return_log_probs=return_log_probs,
            seed=read_int(body, "seed", None),
            stream=stream,
            ignore_eos=read_bool(body, "ignore_eos", default=False),
            include_stop_str_in_output=read_bool(body, "include_stop_str_in_output", default=False),
            min_tokens=read_int(body, "min_tokens", 0),
            cache_salt=_cache_salt(body.get("cache_salt")),
            top_logprobs=top_logprobs,
            presence_penalty=read_number(body, "presence_penalty", 0.0),
            frequency_penalty=read_number(body, "frequency_penalty", 0.0),
            repetition_penalty=read_number(body, "repetition_penalty", 1.0),
            **guided,
        )
    except InvalidSamplingParams as exc:  # SamplingParams owns the value rules
        raise InvalidRequest(str(exc), param=_param_named_in(str(exc), max_tokens_key)) from None
    return GenerationRequest(
        prompt,
        params,
        stream,
        include_usage,
        continuous_usage,
        n=n,
        best_of=n,
        schema_param=schema_param(body) if params.guided_json is not None else None,
    )


# SamplingParams' field names as the API spells them.
_API_NAMES: Final = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
    "stop_string": "stop",
    "stop string": "stop",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "cache_salt": "cache_salt",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "guided_choice": "guided_choice",
    "guided_regex": "guided_regex",
    "guided_json": "guided_json",
}


def _param_named_in(message: str, max_tokens_key: str) -> str | None:
    """The API parameter a ``SamplingParams`` refusal names first (its message leads with the
    field)."""
    names = {**_API_NAMES, "num_tokens_to_generate": max_tokens_key}
    found = [(message.find(field), param) for field, param in names.items() if field in message]
    return min(found)[1] if found else None


def _cache_salt(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidRequest("cache_salt must be a string", param="cache_salt")


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


def _stop_token_ids(value: object, limits: RequestLimits) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(token) and token >= 0 for token in value):
        raise InvalidRequest(
            "stop_token_ids must be a list of token ids >= 0", param="stop_token_ids"
        )
    if len(value) > limits.max_stop_token_ids:
        raise _over_limit(
            "stop_token_ids", len(value), "ids", "max_stop_token_ids", limits, "stop_token_ids"
        )
    return tuple(value)


def _logit_bias(value: object, limits: RequestLimits) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object of token ids (JSON keys are strings) to biases."""
    if value is None:
        return ()
    problem = InvalidRequest(
        "logit_bias must map token ids (as strings) to numbers in [-100, 100]", param="logit_bias"
    )
    if not isinstance(value, dict):
        raise problem
    if len(value) > limits.max_logit_bias_tokens:
        raise _over_limit(
            "logit_bias", len(value), "tokens", "max_logit_bias_tokens", limits, "logit_bias"
        )
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise problem
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise problem
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _completion_logprobs(value: object, limits: RequestLimits) -> int | None:
    """Legacy completions take an int: how many alternatives per token besides the sampled
    one (None: no log-probs; true counts as 0)."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if not is_int(value):
        raise InvalidRequest("logprobs must be an integer", param="logprobs")
    _check_top_logprobs(value, limits, "logprobs")
    return value


def _check_top_logprobs(value: int, limits: RequestLimits, param: str) -> None:
    if value < 0:
        raise InvalidRequest(f"{param} must be >= 0, got {value}", param=param)
    if value > limits.max_top_logprobs:
        raise _over_limit(param, value, "alternatives", "max_top_logprobs", limits, param)


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
    largest = max(job.all_prompts, key=len)  # every prompt is its own SUBMIT message
    prompt = largest if isinstance(largest, str) else protocol.pack_tokens(largest)
    # The largest request id the client can send, so the estimate never falls short.
    message = protocol.encode(SubmitRequest(2**63 - 1, prompt, job.params.serialize()))
    if len(message) > max_message_bytes:
        raise InvalidRequest(
            f"the request encodes to {len(message)} bytes, more than the coordinator's message "
            f"limit of {max_message_bytes} bytes (max_message_bytes: flag --max-body-bytes, "
            "or the coordinator's --max-message-bytes)",
            param="prompt",
            code="max_message_bytes",
        )
