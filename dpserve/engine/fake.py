"""``FakeRunner``: deterministic tokens without a model, for tests and benchmarks.

Each step gives every running request one token, derived from its prompt, seed and position,
so a result can be checked without knowing which engine produced it. Tokens are lowercase
ASCII letters, readable through the byte tokenizer.

It finishes requests by the model runner's rules: ``num_tokens_to_generate`` (resume tokens
included) or the context size -> "length"; ``termination_id`` or a stop string -> "stop",
neither part of the output; ``ignore_eos`` disables the termination token and ``min_tokens``
defers it and stop strings. A token is computed when it is emitted, so memory never grows with
``num_tokens_to_generate``: the token sequence repeats every ``PERIOD`` positions, which bounds
the search for where a request stops.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from dpserve.engine.runner import EngineRequest, RequestRejected, TokenUpdate
from dpserve.protocol import ErrorCode

PERIOD = 26  # fake tokens repeat with this period in the position (7 and 26 are coprime)
DEFAULT_CONTEXT_SIZE = 8192


def _base(prompt_tokens: list[int], seed: int | None) -> int:
    return sum(prompt_tokens) * 31 + len(prompt_tokens) + (seed or 0) * 7919


def _token_at(base: int, position: int) -> int:
    return ord("a") + (base + position * 7) % PERIOD


def fake_token(prompt_tokens: list[int], seed: int | None, position: int) -> int:
    """The token a fake engine emits at ``position`` (0-based) for this prompt and seed."""
    return _token_at(_base(prompt_tokens, seed), position)


@dataclass(slots=True)
class _Sequence:
    request: EngineRequest
    base: int  # _base() of its prompt and seed
    end: int  # position (resume tokens included) where the output stops
    finish_reason: str
    position: int  # next position to emit
    prompt_logprobs_sent: bool = False


def _termination_position(request: EngineRequest, base: int, start: int, limit: int) -> int | None:
    """The first position in [start, limit) whose token ends the request, if any."""
    params = request.params
    if params.termination_id is None or params.ignore_eos:
        return None
    first = max(start, params.min_tokens)
    for position in range(first, min(limit, first + PERIOD)):
        if _token_at(base, position) == params.termination_id:
            return position
    return None


def _stop_string_position(request: EngineRequest, base: int, start: int, limit: int) -> int | None:
    """Where the stop string that appears first (ends first, at or before ``limit`` and not
    before ``min_tokens``, starting at or after ``start``) starts; None if none does."""
    params = request.params
    if not params.stop_strings:
        return None
    longest = max(map(len, params.stop_strings))
    low = max(start, params.min_tokens - longest, 0)
    high = min(limit, low + PERIOD + longest)
    # Fake tokens are ASCII letters, one character each: text positions are token positions.
    window = "".join(chr(_token_at(base, p)) for p in range(low, high))
    hits = []  # (end, start) of each stop string's first match: the first to end stops
    for stop in params.stop_strings:
        offset = window.find(stop, max(0, params.min_tokens - len(stop) - low))
        if offset >= 0:
            hits.append((low + offset + len(stop), low + offset))
    return min(hits)[1] if hits else None


def plan_finish(request: EngineRequest, context_size: int) -> tuple[int, str]:
    """Where a request's output ends (a position, resume tokens included) and why."""
    params = request.params
    base = _base(request.prompt_tokens, params.seed)
    start = len(request.resume_tokens)
    limit = min(params.num_tokens_to_generate, context_size - len(request.prompt_tokens))
    end, reason = max(start, limit), "length"
    termination = _termination_position(request, base, start, limit)
    if termination is not None:
        end, reason = termination, "stop"
    stop = _stop_string_position(request, base, start, end)
    if stop is not None:
        end, reason = stop, "stop"
    return end, reason


class FakeRunner:
    def __init__(
        self, capacity: int = 256, step_delay: float = 0.0, max_context: int = DEFAULT_CONTEXT_SIZE
    ) -> None:
        self.capacity = capacity
        self.step_delay = step_delay
        self.max_context = max_context
        self.released = False
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}

    def add(self, request: EngineRequest) -> None:
        length = len(request.prompt_tokens) + len(request.resume_tokens)
        if not request.prompt_tokens:
            raise RequestRejected(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
        if length >= self.max_context:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {length} tokens leaves no room for a new token in the fake "
                f"engine's context of {self.max_context} tokens",
            )
        end, reason = plan_finish(request, self.max_context)
        base = _base(request.prompt_tokens, request.params.seed)
        self._waiting.append(_Sequence(request, base, end, reason, len(request.resume_tokens)))

    def cancel(self, request_id: int) -> None:
        self._running.pop(request_id, None)
        self._waiting = deque(s for s in self._waiting if s.request.request_id != request_id)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[TokenUpdate]:
        """One token for every running request; admits waiting ones up to capacity."""
        if self.released:
            raise RuntimeError("step() on a released runner: reload() first")
        while self._waiting and len(self._running) < self.capacity:
            sequence = self._waiting.popleft()
            self._running[sequence.request.request_id] = sequence
        if self.step_delay:
            time.sleep(self.step_delay)
        updates = []
        finished = []
        for request_id, sequence in self._running.items():
            tokens = []
            if sequence.position < sequence.end:
                tokens.append(_token_at(sequence.base, sequence.position))
                sequence.position += 1
            done = sequence.position >= sequence.end
            params = sequence.request.params
            logprobs = [-1.0] * len(tokens) if params.return_log_probs else None
            update = TokenUpdate(
                request_id, tokens, logprobs, sequence.finish_reason if done else None
            )
            if params.return_log_probs and params.top_logprobs:
                # The sampled token is the most likely of its alternatives (as under greedy).
                update.top_logprobs = [
                    [(token, -1.0)]
                    + [((token + i) % 256, -2.0) for i in range(1, params.top_logprobs)]
                    for token in tokens
                ]
            if params.prompt_logprobs and not sequence.prompt_logprobs_sent:
                sequence.prompt_logprobs_sent = True
                prompt = sequence.request.prompt_tokens
                update.prompt_logprobs = [-1.0] * (len(prompt) - 1)
                if params.top_logprobs:
                    update.prompt_top_logprobs = [
                        [(token, -1.0)] * params.top_logprobs for token in prompt[1:]
                    ]
            updates.append(update)
            if done:
                finished.append(request_id)
        for request_id in finished:
            del self._running[request_id]
        return updates

    def release(self) -> None:
        self.released = True

    def reload(self) -> None:
        self.released = False

    def stats(self) -> dict[str, int]:
        return {"waiting": len(self._waiting), "running": len(self._running)}
