"""The prompt of a completion request and the messages of a chat request."""

from __future__ import annotations

import json
from typing import Any, Final

from dpserve.openai.errors import InvalidRequest
from dpserve.openai.values import is_token_id, json_type

# Message fields other than role, content and those of tool calling, accepted only at these
# values (or null). Anything else in a message is refused.
_MESSAGE_NO_OPS: Final[dict[str, tuple[object, ...]]] = {
    "refusal": ("",),
    "annotations": ([],),
}


def parse_prompts(prompt: object, max_prompts: int) -> list[str | list[int]]:
    """A string, a list of token ids, or a list of either (several prompts: each its own
    choices, in order)."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, str | list) for item in prompt):
        if len(prompt) > max_prompts:
            raise InvalidRequest(
                f"the request has {len(prompt)} prompts, more than max_prompts={max_prompts} "
                "(flag --max-prompts)",
                param="prompt",
                code="max_prompts",
            )
        return [parse_prompt([item]) for item in prompt]
    return [parse_prompt(prompt)]


def parse_prompt(prompt: object) -> str | list[int]:
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


def parse_messages(messages: object) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: ``{role, content}`` with text content
    (text parts joined by newlines), an assistant turn's ``tool_calls`` (their arguments as
    objects, as templates render them), a tool turn's ``tool_call_id``, a ``name``."""
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
        _refuse_other_fields(message, where)
        turn: dict[str, Any] = {
            "role": role,
            "content": _message_text(message.get("content"), where),
        }
        for key in ("name", "tool_call_id"):
            value = message.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
                turn[key] = value
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant":
                raise InvalidRequest(
                    f"{where}.tool_calls: only an assistant message calls tools",
                    param=f"{where}.tool_calls",
                )
            turn["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        parsed.append(turn)
    return parsed


# What a chat template's variables may not be named: the parameters of transformers'
# ``apply_chat_template`` (a kwarg of that name would change how it renders, not what) and
# the variables this server sets. tests/unit/test_chat_rendering.py checks the list against the
# installed transformers.
RESERVED_TEMPLATE_NAMES: Final = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize",
        "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def chat_template_kwargs(value: object) -> dict[str, Any] | None:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template, by name."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"chat_template_kwargs must be an object, got {json_type(value)}",
            param="chat_template_kwargs",
        )
    for key in value:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_NAMES:
            raise InvalidRequest(
                f"chat_template_kwargs.{key} cannot be a template variable (a name the "
                "template reads, not one of the renderer's own parameters or the messages)",
                param=f"chat_template_kwargs.{key}",
            )
    return dict(value)


def message_chars(messages: list[dict[str, Any]]) -> int:
    """The text a conversation's messages carry (what ``max_prompt_chars`` counts before the
    template renders them)."""
    total = 0
    for message in messages:
        total += len(message["content"])
        for call in message.get("tool_calls", ()):
            function = call["function"]
            total += len(function["name"]) + len(json.dumps(function["arguments"]))
    return total


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list", param=where)
    parsed = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise InvalidRequest(
                f"{at} must be {{id, type: 'function', function: {{name, arguments}}}} with "
                "arguments a JSON string",
                param=at,
            )
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise InvalidRequest(
                f"{at}.function.arguments is not JSON", param=f"{at}.function.arguments"
            ) from None
        call_id = call.get("id")
        parsed.append(
            {
                "id": call_id if isinstance(call_id, str) else "",
                "type": "function",
                "function": {
                    "name": function["name"],
                    "arguments": arguments,
                },
            }
        )
    return parsed


def _refuse_other_fields(message: dict[str, Any], where: str) -> None:
    for key, value in message.items():
        if key in _MESSAGE_FIELDS or value is None:
            continue
        if key not in _MESSAGE_NO_OPS:
            raise InvalidRequest(
                f"{where}.{key} is not supported (a message has role, content, name, "
                "tool_calls, tool_call_id)",
                param=f"{where}.{key}",
                code="unsupported_field",
            )
        if value not in _MESSAGE_NO_OPS[key]:
            raise InvalidRequest(
                f"{where}.{key} is not supported by this server",
                param=f"{where}.{key}",
                code="unsupported_field",
            )


_MESSAGE_FIELDS: Final = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def _message_text(content: object, where: str) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or len(part) != 2:
                raise InvalidRequest(
                    f"{where}.content: only text parts {{type: text, text}} are supported",
                    param=f"{where}.content",
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
