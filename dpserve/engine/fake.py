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
from dpserve.tokenizer import ByteTokenizer


def fake_token(prompt_tokens: list[int], seed: int | None, position: int) -> int:
    """The token a fake engine emits at ``position`` (0-based) for this prompt and seed."""
    base = sum(prompt_tokens) * 31 + len(prompt_tokens) + (seed or 0) * 7919
    return ord("a") + (base + position * 7) % 26


@dataclass(slots=True)
class _Sequence:
    request: EngineRequest
    generated: list[int]
    base: int = 0


class FakeRunner:
    def __init__(
        self, capacity: int = 256, step_delay: float = 0.0, max_context: int = 8192
    ) -> None:
        self.capacity = capacity
        self.step_delay = step_delay
        self.max_context = max_context
        self.tokenizer = ByteTokenizer()
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
        self._waiting.append(_Sequence(request, list(request.resume_tokens)))

    def cancel(self, request_id: int) -> None:
        self._running.pop(request_id, None)
        self._waiting = deque(s for s in self._waiting if s.request.request_id != request_id)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[TokenUpdate]:
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
            request = sequence.request
            params = request.params
            token = fake_token(request.prompt_tokens, params.seed, len(sequence.generated))
            sequence.generated.append(token)
            reason = None
            if token == params.termination_id or self._hits_stop_string(sequence):
                reason = "stop"
            elif len(sequence.generated) >= params.num_tokens_to_generate:
                reason = "length"
            logprobs = [-1.0] if params.return_log_probs else None
            updates.append(TokenUpdate(request_id, [token], logprobs, reason))
            if reason is not None:
                finished.append(request_id)
        for request_id in finished:
            del self._running[request_id]
        return updates

    def _hits_stop_string(self, sequence: _Sequence) -> bool:
        if not sequence.request.params.stop_strings:
            return False
        [text] = self.tokenizer.decode_batch([sequence.generated[-64:]])
        return any(text.endswith(stop) for stop in sequence.request.params.stop_strings)

    def release(self) -> None:
        self.released = True

    def reload(self) -> None:
        self.released = False

    def stats(self) -> dict[str, int]:
        return {"waiting": len(self._waiting), "running": len(self._running)}
