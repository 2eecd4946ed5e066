"""``Admission``: whether a submitted request is taken, and its checked prompt and parameters.

Every refusal names the limit and its flag (``CoordinatorConfig``, defaults from
``dpserve.limits``) and is answered before anything is tokenized or dispatched — except the
prompt-token limit of a text prompt, which is checked right after tokenizing its batch.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from dpserve import protocol
from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.registry import Client
from dpserve.protocol import ControlState, ErrorCode, ProtocolError
from dpserve.sampling import ParamsMemo, SamplingParams

Refusal = tuple[str, str]  # (ERROR code, message)


class Admission:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._params = ParamsMemo(_normalized_params)

    def refusal(
        self, client: Client, inflight: int, state: ControlState, prompt: Any
    ) -> Refusal | None:
        """Why a new request from ``client`` is refused now, or None to take it."""
        config = self.config
        if isinstance(prompt, str) and len(prompt) > config.max_prompt_chars:
            return (
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {len(prompt)} characters; this coordinator accepts at most "
                f"{config.max_prompt_chars} (--max-prompt-chars)",
            )
        if state is ControlState.STOPPED:
            return ErrorCode.STOPPED, "engines have been stopped"
        if client.inflight >= config.max_inflight_per_client:
            return (
                ErrorCode.OVERLOADED,
                f"this client has {client.inflight} requests in flight, the per-client cap "
                f"(--max-inflight-per-client {config.max_inflight_per_client})",
            )
        if inflight >= config.max_inflight_requests:
            return (
                ErrorCode.OVERLOADED,
                f"coordinator overloaded: {inflight} requests in flight "
                f"(--max-inflight-requests {config.max_inflight_requests})",
            )
        return None

    def prompt_tokens_refusal(self, packed_tokens: bytes) -> Refusal | None:
        if not packed_tokens:
            return ErrorCode.BAD_REQUEST, "the prompt is empty after tokenization"
        count = len(packed_tokens) // 4  # packed int32
        if count > self.config.max_prompt_tokens:
            return (
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {count} tokens; this coordinator accepts at most "
                f"{self.config.max_prompt_tokens} (--max-prompt-tokens)",
            )
        return None

    def validated_params(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Checked, normalized sampling parameters (raises ``InvalidSamplingParams``),
        memoized (``sampling.ParamsMemo``; the result is shared: not to be modified)."""
        return self._params(raw)


def _normalized_params(raw: Any) -> dict[str, Any]:
    return SamplingParams.deserialize(raw).serialize()


def is_chat(prompt: object) -> TypeGuard[list[Any]]:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def chat_messages(messages: list[Any]) -> list[dict[str, str]]:
    """Check a chat prompt: a list of ``{"role": str, "content": str}`` maps."""
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ProtocolError('a chat prompt is a list of {"role": str, "content": str} maps')
    return messages


def token_prompt(prompt: bytes | list[Any]) -> bytes:
    """A token prompt (packed bytes or a list of ids) as checked packed int32 tokens."""
    if isinstance(prompt, list):
        if not all(type(t) is int and 0 <= t < 2**31 for t in prompt):
            raise ProtocolError("a token-list prompt must hold non-negative integers")
        prompt = protocol.pack_tokens(prompt)
    if not prompt or len(prompt) % 4:
        raise ProtocolError("a token prompt must be non-empty packed int32 tokens")
    return prompt
