"""What an engine's compute side must provide: the ``Runner`` interface.

The engine process (``dpserve.engine.server``) owns the socket, heartbeats, control states and
draining; a runner owns sequences and produces tokens. ``FakeRunner`` (no model) and
``ModelRunner`` (torch + transformers, continuous batching) both implement this, so the
protocol side is written once. The layers, top down: the server drives a *runner*; a model
runner hands the KV cache and the forward to a *backend* (``backend.Backend``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dpserve.protocol import ErrorCode
from dpserve.sampling import SamplingParams


class RequestRejected(Exception):
    """The runner cannot take this request (for example: prompt longer than the context)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class RunnerRequest:
    request_id: int
    prompt_tokens: list[int]
    params: SamplingParams
    # Tokens another engine already generated (re-dispatch after that engine died):
    # generation continues after them, and they count towards num_tokens_to_generate.
    resume_tokens: list[int] = field(default_factory=list)


def check_tokens_fit(request: RunnerRequest, context_size: int, vocab_size: int) -> None:
    """``RequestRejected`` unless ``request``'s prompt is not empty, its prompt and resumed
    tokens leave room for a new token in a context of ``context_size``, and every token id
    (its ``logit_bias``'s too) is one of the model's ``vocab_size`` (a model runner's first
    check, whatever its engine)."""
    prompt_length = len(request.prompt_tokens)
    if prompt_length == 0:
        raise RequestRejected(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
    if prompt_length + len(request.resume_tokens) >= context_size:
        resumed = f" + {len(request.resume_tokens)} resumed tokens" if request.resume_tokens else ""
        raise RequestRejected(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt of {prompt_length} tokens{resumed} leaves no room for a new token in "
            f"this engine's context of {context_size} tokens (at most {context_size - 1} prompt "
            "tokens)",
        )
    all_tokens = request.prompt_tokens + request.resume_tokens
    if min(all_tokens) < 0 or max(all_tokens) >= vocab_size:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST, f"token ids must be in [0, {vocab_size}) for this model"
        )
    biased = request.params.logit_bias
    if biased and max(token for token, _ in biased) >= vocab_size:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"logit_bias: token ids must be in [0, {vocab_size}) for this model",
        )


@dataclass(slots=True)
class TokenUpdate:
    """What one step produced for one request."""

    request_id: int
    tokens: list[int]
    logprobs: list[float] | None = None  # one per token, only when return_log_probs
    finish_reason: str | None = None  # "stop" (EOS / termination id / stop string) or "length"
    # The tokens' text where the runner decoded it already (requests with stop strings, see
    # ``sequences.StopText``); None: the engine server decodes it.
    text: str | None = None
    # Context tokens the engine found in its prefix cache when it admitted the request.
    cached_tokens: int | None = None
    # Per token its top_logprobs alternatives (token, log-prob), when the request asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # prompt_logprobs: the prompt's tokens after the first (log-prob, alternatives), in the
    # request's first update.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # With finish_reason "stop": the EOS / termination_id / stop_token_ids token that ended the
    # request (not in tokens, but generated: usage counts it, as vLLM and llama.cpp do).
    stop_token: int | None = None
    # Its log-prob and alternatives, when the request asked for log-probs.
    stop_logprob: float | None = None
    stop_top_logprobs: list[tuple[int, float]] | None = None
    # The request failed after it was accepted (its constraint did not compile within its
    # limits, or could no longer be followed): why. ``finish_reason`` then holds its
    # ``protocol.ErrorCode``, as an ENGINE_REPLY entry's does, and nothing else is reported.
    error: str | None = None


class Runner(Protocol):
    max_num_seqs: int  # sequences decoded together at most (the capacity the coordinator sees)
    # The transformers tokenizer the engine's text is decoded with; None: the byte tokenizer
    # (the fake runner's tokens are ASCII letters).
    tokenizer: Any

    def add(self, request: RunnerRequest) -> None:
        """Queue a request; raise ``RequestRejected`` if it can never be served."""

    def cancel(self, request_id: int) -> None:
        """Forget a request (client gone, coordinator restarted); unknown ids are ignored."""

    def has_work(self) -> bool:
        """True while any request is waiting or running."""

    def step(self) -> list[TokenUpdate]:
        """One scheduling step: admit waiting requests, prefill them, decode the running ones
        and retire the finished. Returns an update per request whose first tokens came or
        that ended; what a request produced in between is taken with ``unreported``."""

    def unreported(self) -> list[TokenUpdate]:
        """An update per running request with tokens not reported yet (the engine server
        takes them once per stream interval, and all of them when it hands its requests
        over)."""

    def warm_up(self) -> None:
        """Once, before the engine registers: what the first request of some kind would
        otherwise do on the step loop, holding every request of the engine meanwhile (the
        tokenizer's tables for structured output, a compile)."""

    def release(self) -> None:
        """Suspend: free the model's and KV cache's memory; requests stay queued."""

    def reload(self) -> None:
        """Resume after ``release``: load the model again; requests continue."""

    def stats(self) -> Mapping[str, object]:
        """Numbers for the heartbeat (KV pool, preemptions, ...); non-numbers are dropped."""
