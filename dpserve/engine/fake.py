"""``FakeRunner``: deterministic tokens without a model, for tests and benchmarks.

Each step gives every running request one token, derived from its prompt, seed and position,
so a result can be checked without knowing which engine produced it. Tokens are lowercase
ASCII letters, readable through the byte tokenizer.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from dpserve.engine.runner import EngineRequest, RequestRejected, TokenUpdate
from dpserve.protocol import ErrorCode


def fake_token(prompt_tokens: list[int], seed: int | None, position: int) -> int:
    """The token a fake engine emits at ``position`` (0-based) for this prompt and seed."""
    base = sum(prompt_tokens) * 31 + len(prompt_tokens) + (seed or 0) * 7919
    return ord("a") + (base + position * 7) % 26


@dataclass(slots=True)
class _Sequence:
    request: EngineRequest
    planned: list[int]  # every token this request will emit (its output is known up front)
    finish_reason: str
    emitted: int = 0


def plan_output(request: EngineRequest) -> tuple[list[int], str]:
    """The tokens a fake engine emits for a request after its resume tokens, and why it stops.
    Like the model runner (and OpenAI), neither the termination token nor a stop string is
    part of the output."""
    params = request.params
    start = len(request.resume_tokens)
    tokens = [
        fake_token(request.prompt_tokens, params.seed, i)
        for i in range(start, params.num_tokens_to_generate)
    ]
    reason = "length"
    if params.termination_id in tokens:
        tokens = tokens[: tokens.index(params.termination_id)]
        reason = "stop"
    # Fake tokens are ASCII letters, one character each: text positions are token positions.
    text = bytes(request.resume_tokens + tokens).decode("latin-1")
    hits = [i for stop in params.stop_strings if (i := text.find(stop, start)) >= 0]
    if hits:
        tokens = tokens[: min(hits) - start]
        reason = "stop"
    return tokens, reason


class FakeRunner:
    def __init__(
        self, capacity: int = 256, step_delay: float = 0.0, max_context: int = 8192
    ) -> None:
        self.capacity = capacity
        self.step_delay = step_delay
        self.max_context = max_context
        self.released = False
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}

    def add(self, request: EngineRequest) -> None:
        length = len(request.prompt_tokens) + len(request.resume_tokens)
        if length >= self.max_context:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {length} tokens does not fit the {self.max_context}-token context",
            )
        self._waiting.append(_Sequence(request, *plan_output(request)))

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
            tokens = sequence.planned[sequence.emitted : sequence.emitted + 1]
            sequence.emitted += len(tokens)
            done = sequence.emitted >= len(sequence.planned)
            logprobs = [-1.0] * len(tokens) if sequence.request.params.return_log_probs else None
            updates.append(
                TokenUpdate(request_id, tokens, logprobs, sequence.finish_reason if done else None)
            )
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
