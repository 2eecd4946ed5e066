"""The GPU engine core: our Llama forward over the paged KV cache, scheduled in chunks.

``PagedBackend`` owns the pool (``kv_cache``), the scheduler (``scheduler``), the model
(``llama.PagedLlama``) and, on CUDA, the decode graphs (``cuda_graphs``). One step = one
forward: the scheduler's decodes and prefill chunks are flattened into one batch
(``paged_batch``), the model writes their keys/values into the pool and returns the logits of
the rows whose next token is due, and those rows are sampled (``backend.sample``).

Sizing, logged at start and reported in ``stats()``: on CUDA the pool takes
``gpu_memory_utilization`` of the device minus the weights and an activation estimate (or
``kv_cache_bytes`` when given); on CPU ``kv_cache_bytes`` (1 GiB by default). It never takes
more than ``max_num_seqs`` full contexts could use. A sequence's context is capped at what the
pool holds, so a sequence alone always fits; ``max_num_seqs`` (sequences running at once) is
the configured one when given, else what the pool holds at ``TOKENS_PER_SEQUENCE`` tokens
each (at most ``DEFAULT_MAX_NUM_SEQS``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dpserve.engine import sampler
from dpserve.engine.backend import Sampled, sample
from dpserve.engine.cuda_graphs import DecodeGraphs
from dpserve.engine.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    TOKENS_PER_SEQUENCE,
)
from dpserve.engine.kv_cache import (
    RESERVED_BLOCKS,
    KVCacheShape,
    PagedKVCache,
    cuda_kv_budget_bytes,
    num_blocks_for_budget,
)
from dpserve.engine.llama import ForwardBatch, PagedLlama
from dpserve.engine.paged_attention import decode_attention_backend
from dpserve.engine.paged_batch import build_forward_batch
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.sequences import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PagedConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int | None = None  # None: derived from the pool
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]  # the device's default
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cuda_graphs: bool = True


class PagedBackend:
    """Implements ``backend.Backend`` for Llama-family models."""

    computes_prompt_logprobs = True  # logits at prompt positions (build_forward_batch)

    def __init__(self, model: Any, config: PagedConfig) -> None:
        self.config = config
        self.device: torch.device = model.device
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._sequences: dict[int, Sequence] = {}
        self.scheduler: Scheduler[Sequence] | None = None
        self.prefill_tokens = 0
        self._build(model)

    # ------------------------------------------------------------------------ construction

    def _build(self, model: Any) -> None:
        with torch.inference_mode():
            self.model: PagedLlama | None = PagedLlama(model)
            shape = self.model.kv_cache_shape(self.config.block_size)
            self.cache: PagedKVCache | None = PagedKVCache(
                shape, self._pool_blocks(shape), self.device
            )
        self.context_size = min(self.model.context_size, self.cache.token_capacity)
        self.max_num_seqs = self.config.max_num_seqs or max(
            1,
            min(
                DEFAULT_MAX_NUM_SEQS,
                self.cache.token_capacity // min(self.context_size, TOKENS_PER_SEQUENCE),
            ),
        )
        waiting = self.scheduler.waiting if self.scheduler is not None else []
        self.scheduler = Scheduler(
            self.cache.pool,
            self.config.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        self.scheduler.waiting.extend(waiting)
        self.graphs: DecodeGraphs | None = None
        if self._use_graphs():
            try:
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(
                        self.model,
                        self.cache,
                        self.max_num_seqs,
                        shape.blocks_for(self.context_size),
                    )
            except RuntimeError as exc:  # a kernel that syncs with the host cannot be captured
                log.error("CUDA graph capture failed, decoding eagerly: %s", exc)
                torch.cuda.synchronize()

    def _use_graphs(self) -> bool:
        return (
            self.config.cuda_graphs
            and self.device.type == "cuda"
            and decode_attention_backend(self.device) == "triton"
        )

    def _pool_blocks(self, shape: KVCacheShape) -> int:
        assert self.model is not None
        sequences = self.config.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        useful = RESERVED_BLOCKS + sequences * shape.blocks_for(self.model.context_size)
        budget = self.config.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            activations = self.model.activation_bytes(self.max_num_batched_tokens, sequences)
            budget = cuda_kv_budget_bytes(
                self.device, self.config.gpu_memory_utilization, activations
            )
        elif budget is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        return min(num_blocks_for_budget(shape, budget), useful)

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"backend": "paged"}
        if self.cache is not None:
            facts.update(self.cache.describe())
        facts.update(
            {
                "max_num_seqs": self.max_num_seqs,
                "context_size": self.context_size,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "decode_attention": decode_attention_backend(self.device),
                "cuda_graphs": self.graphs.sizes if self.graphs is not None else [],
            }
        )
        facts.pop("kv_free_blocks", None)
        return facts

    def stats(self) -> dict[str, Any]:
        assert self.scheduler is not None
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "prefill_tokens": self.prefill_tokens,
            "preemptions": self.scheduler.preemptions,
            "kv_free_blocks": self.scheduler.pool.free_blocks,
        }

    # ---------------------------------------------------------------------------- requests

    def add(self, sequence: Sequence) -> None:
        assert self.scheduler is not None
        self._sequences[sequence.request_id] = sequence
        self.scheduler.add(sequence)

    def cancel(self, request_id: int) -> bool:
        sequence = self._sequences.pop(request_id, None)
        return sequence is not None and self._forget(sequence)

    def has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    def _forget(self, sequence: Sequence) -> bool:
        if self._sequences.get(sequence.request_id) is sequence:
            del self._sequences[sequence.request_id]
        assert self.scheduler is not None
        return self.scheduler.remove(sequence)

    def release(self) -> None:
        assert self.scheduler is not None
        self.scheduler.preempt_all()
        self.model = self.cache = self.graphs = None

    def reload(self, model: Any) -> None:
        self._build(model)

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[Sampled]:
        assert self.scheduler is not None and self.cache is not None
        plan = self.scheduler.schedule()
        if not plan:
            return []
        built = build_forward_batch(plan, self.cache.block_size, self.device)
        logits = self._forward(built.batch)
        self.scheduler.commit(plan)
        self.prefill_tokens += sum(chunk.length for chunk in plan.prefills)
        if built.prompt_rows:
            _record_prompt_logprobs(built.prompt_rows, logits[len(built.sampled) :])
            logits = logits[: len(built.sampled)]
        if not built.sampled:
            return []
        return [sample(built.sampled, logits)]

    def finish(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            self._forget(sequence)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert self.model is not None and self.cache is not None
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model.forward(batch, self.cache)


def _record_prompt_logprobs(
    prompt_rows: list[tuple[Sequence, int, int]], logits: torch.Tensor
) -> None:
    """The prompt tokens' log-probs (and alternatives) for the rows ``build_forward_batch``
    added, for all sequences with one log-softmax, one top-k and one copy to the host."""
    targets = [
        token
        for sequence, start, count in prompt_rows
        for token in sequence.tokens_between(start + 1, start + 1 + count)
    ]
    k = max(sequence.params.top_logprobs for sequence, _, _ in prompt_rows)
    target_tensor = torch.tensor(targets, dtype=torch.long).to(logits.device)
    host = sampler.log_probs_of(logits, target_tensor, k).to_host()
    assert host.logprobs is not None
    row = 0
    for sequence, start, count in prompt_rows:
        own_k = sequence.params.top_logprobs
        top = None
        if own_k and host.top is not None:
            top = [entries[:own_k] for entries in host.top[row : row + count]]
        sequence.record_prompt_logprobs(start, host.logprobs[row : row + count], top)
        row += count
