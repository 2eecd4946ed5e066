"""The prompt of a completion request and the messages of a chat request."""

from __future__ import annotations

from typing import Any, Final

from dpserve.openai.errors import InvalidRequest
from dpserve.openai.values import is_token_id, json_type

# Message fields other than role and content, accepted only at these values (or null): they
# ask for tool calling, which this server does not do. Anything else in a message is refused.
_MESSAGE_NO_OPS: Final[dict[str, tuple[object, ...]]] = {
    "tool_calls": ([],),
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


def parse_messages(messages: object) -> list[dict[str, str]]:
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
        _refuse_other_fields(message, where)
        parsed.append({"role": role, "content": _message_text(message.get("content"), where)})
    return parsed


def _refuse_other_fields(message: dict[str, Any], where: str) -> None:
    for key, value in message.items():
        if key in ("role", "content") or value is None:
            continue
        if key not in _MESSAGE_NO_OPS:
            raise InvalidRequest(
                f"{where}.{key} is not supported (a message has role and content)",
                param=f"{where}.{key}",
                code="unsupported_field",
            )
        if value not in _MESSAGE_NO_OPS[key]:
            raise InvalidRequest(
                f"{where}.{key} is not supported by this server (no tool calling)",
                param=f"{where}.{key}",
                code="unsupported_field",
            )


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
