"""``FakeRunner``: deterministic tokens without a model, for tests and benchmarks.

Each step gives every running request one token, derived from its prompt, seed and position,
so a result can be checked without knowing which engine produced it. Tokens are lowercase
ASCII letters, readable through the byte tokenizer.

It finishes requests by the model runner's own rules (``Sequence.accept``, the same code):
``num_tokens_to_generate`` (resume tokens included) or the context size -> "length";
``termination_id``, a ``stop_token_ids`` token or a stop string -> "stop", none part of the
output; ``ignore_eos`` disables the termination token and ``min_tokens`` defers it and stop
strings. Like a model runner it keeps each request's generated tokens (a small int each) until
the request ends.
"""

from __future__ import annotations

import time
from collections import deque

from dpserve.block_hash import BlockHash, extra_keys
from dpserve.engine.defaults import DEFAULT_MAX_NUM_SEQS
from dpserve.engine.fake_cache import SimulatedPrefixCache
from dpserve.engine.kv_events import KVEvent
from dpserve.engine.runner import RequestRejected, RunnerRequest, TokenUpdate
from dpserve.engine.sequences import Sequence, StopText, decode_new_tokens, stop_ids_of
from dpserve.protocol import ErrorCode
from dpserve.tokenizer import ByteTokenizer

PERIOD = 26  # fake tokens repeat with this period in the position (7 and 26 are coprime)
DEFAULT_CONTEXT_SIZE = 8192


def _base(prompt_tokens: list[int], seed: int | None) -> int:
    return sum(prompt_tokens) * 31 + len(prompt_tokens) + (seed or 0) * 7919


def _token_at(base: int, position: int) -> int:
    return ord("a") + (base + position * 7) % PERIOD


def fake_token(prompt_tokens: list[int], seed: int | None, position: int) -> int:
    """The token a fake engine emits at ``position`` (0-based) for this prompt and seed."""
    return _token_at(_base(prompt_tokens, seed), position)


class FakeRunner:
    tokenizer = None  # the byte tokenizer reads its tokens

    def __init__(
        self,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        step_delay: float = 0.0,
        max_context: int = DEFAULT_CONTEXT_SIZE,
        *,
        prefix_cache: SimulatedPrefixCache | None = None,
        prefill_cost: float = 0.0,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.max_context = max_context
        self.released = False
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}
        self._arrived_done: list[Sequence] = []  # resumed with nothing left to generate
        self._bases: dict[int, int] = {}  # request id -> _base() of its prompt and seed
        # Cache simulation: a step that admits requests also sleeps ``prefill_cost`` seconds
        # per prompt token the simulated prefix cache did not hold.
        self.prefix_cache = prefix_cache
        self.prefill_cost = prefill_cost
        self.prefill_tokens = 0

    def add(self, request: RunnerRequest) -> None:
        length = len(request.prompt_tokens) + len(request.resume_tokens)
        if not request.prompt_tokens:
            raise RequestRejected(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
        if length >= self.max_context:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {length} tokens leaves no room for a new token in the fake "
                f"engine's context of {self.max_context} tokens",
            )
        params = request.params
        sequence = Sequence(
            request=request,
            params=params,
            max_generated=min(
                params.num_tokens_to_generate, self.max_context - len(request.prompt_tokens)
            ),
            stop_ids=stop_ids_of(params, frozenset()),  # no model, so no EOS of its own
            tokens=list(request.resume_tokens),
            emitted=len(request.resume_tokens),
        )
        if params.stop_strings:
            sequence.stop_text = StopText.start(
                ByteTokenizer(), request.resume_tokens, params.stop_strings
            )
        if len(sequence.tokens) >= sequence.max_generated:
            self._arrived_done.append(sequence)
            return
        self._bases[request.request_id] = _base(request.prompt_tokens, params.seed)
        self._waiting.append(sequence)

    def cancel(self, request_id: int) -> None:
        self._running.pop(request_id, None)
        self._bases.pop(request_id, None)
        self._waiting = deque(s for s in self._waiting if s.request_id != request_id)
        self._arrived_done = [s for s in self._arrived_done if s.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._arrived_done)

    def unreported(self) -> list[TokenUpdate]:
        return [update for sequence in self._running.values() if (update := sequence.unreported())]

    def step(self) -> list[TokenUpdate]:
        """One token for every running request; admits waiting ones up to capacity."""
        if self.released:
            raise RuntimeError("step() on a released runner: reload() first")
        prefilled = 0
        while self._waiting and len(self._running) < self.max_num_seqs:
            sequence = self._waiting.popleft()
            self._running[sequence.request_id] = sequence
            prefilled += self._prefill(sequence)
        self.prefill_tokens += prefilled
        delay = self.step_delay + prefilled * self.prefill_cost
        if delay:
            time.sleep(delay)
        updates = [s.emit(len(s.tokens), "length") for s in self._arrived_done]
        self._arrived_done = []
        finished = []
        tokens = [_token_at(self._bases[i], len(s.tokens)) for i, s in self._running.items()]
        decode_new_tokens(list(self._running.values()), tokens)
        for (request_id, sequence), token in zip(self._running.items(), tokens, strict=True):
            params = sequence.params
            if params.prompt_logprobs and not sequence.prompt_logprobs:
                prompt = sequence.request.prompt_tokens
                prompt_top = [[(t, -1.0)] * params.top_logprobs for t in prompt[1:]]
                sequence.record_prompt_logprobs(
                    0, [-1.0] * (len(prompt) - 1), prompt_top if params.top_logprobs else None
                )
            # The fake token is the most likely of its alternatives (as under greedy).
            top = [(token, -1.0)] + [
                ((token + i) % 256, -2.0) for i in range(1, params.top_logprobs)
            ]
            update = sequence.accept(token, -1.0, top)
            if update is not None:
                updates.append(update)
                if update.finish_reason is not None:
                    finished.append(request_id)
        for request_id in finished:
            del self._running[request_id]
            del self._bases[request_id]
        return updates

    def warm_up(self) -> None:
        pass  # no model, nothing compiled

    def release(self) -> None:
        self.released = True

    def reload(self) -> None:
        self.released = False

    def stats(self) -> dict[str, int]:
        stats = {"waiting": len(self._waiting), "running": len(self._running)}
        if self.prefix_cache is not None:
            cache = self.prefix_cache
            stats |= {
                "prefill_tokens": self.prefill_tokens,
                "kv_cached_blocks": len(cache),
                "kv_empty_blocks": max(0, cache.capacity_blocks - len(cache)),
                "prefix_cache_queries": cache.queries,
                "prefix_cache_hits": cache.hits,
                "prefix_cache_evictions": cache.evictions,
            }
        return stats

    # --------------------------------------------------------- prefix-cache simulation

    def _prefill(self, sequence: Sequence) -> int:
        """Admit a sequence to the simulated cache; the prompt tokens it must compute."""
        prompt = sequence.request.prompt_tokens
        if self.prefix_cache is None:
            return len(prompt)
        cached = self.prefix_cache.admit(
            prompt, extra_keys(sequence.params.cache_salt, sequence.params.lora_name)
        )
        sequence.cached_prompt_tokens = cached
        return len(prompt) - cached

    @property
    def kv_block_size(self) -> int | None:
        return None if self.prefix_cache is None else self.prefix_cache.block_size

    def kv_events(self) -> list[KVEvent]:
        return [] if self.prefix_cache is None else self.prefix_cache.take_events()

    def kv_snapshot(self) -> list[BlockHash]:
        return [] if self.prefix_cache is None else self.prefix_cache.snapshot()
