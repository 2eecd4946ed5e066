"""The paged engine core, on CPU and CUDA alike: a model's forward over the paged KV cache,
scheduled in chunks.

``PagedBackend`` owns the cache's tensors (``layers.kv_cache``) and its block pool
(``block_pool``), the scheduler (``scheduler``), the model (a ``models.base.PagedModel``, the
class ``models.registry`` names for its architecture) and, on CUDA, the graphs of decode steps
(``cuda_graphs``) and of steps with prompt chunks (``piecewise_graphs``). One step = one
forward: the scheduler's decodes and prefill chunks are flattened into one batch (``batch``),
the model writes their keys/values into the pool and returns the logits of the rows whose next
token is due, and those rows are sampled on the device.

Overlap (``PagedConfig.overlap``, on by default on CUDA): the forward and sampling of step N
are submitted to a ``DeviceQueue`` and the host returns the results of step N-1 while step N
runs, then schedules and builds step N+1. Sampled ids stay on the device: a sequence whose fed
token is still there (``Sequence.pending``) gets it on the device (``batch.apply_pending``).
A sequence that step N-1 finished was already scheduled in step N: it finishes one step late
and that extra token is discarded (it is no longer tracked when its result arrives), so the
outputs are those of the sequential engine.

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
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from dpserve.block_hash import BlockHash
from dpserve.engine.backend import Sampled, grammar_matchers, token_histories
from dpserve.engine.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    RESERVED_BLOCKS,
    TOKENS_PER_SEQUENCE,
)
from dpserve.engine.kernels import triton_greedy
from dpserve.engine.kv_events import KVEvent
from dpserve.engine.layers.attention import decode_attention_backend
from dpserve.engine.layers.kv_cache import (
    KVCacheShape,
    PagedKVCache,
    cuda_kv_budget_bytes,
    num_blocks_for_budget,
)
from dpserve.engine.layers.linear import ONEDNN_MIN_ROWS
from dpserve.engine.layers.weight_format import DEFAULT_WEIGHT_FORMAT, WeightFormat
from dpserve.engine.lora.slots import LoraSlots
from dpserve.engine.models import registry
from dpserve.engine.models.base import ForwardBatch, PagedModel
from dpserve.engine.paged.batch import BatchBuilder, PendingTokens, apply_pending, pad_decodes
from dpserve.engine.paged.block_pool import BlockPool
from dpserve.engine.paged.cuda_graphs import DecodeGraphs
from dpserve.engine.paged.device_queue import DeviceQueue, Launched
from dpserve.engine.paged.piecewise_graphs import PiecewiseGraphs
from dpserve.engine.paged.scheduler import Scheduler
from dpserve.engine.sample import grammar, penalties, sampler
from dpserve.engine.sequences import Sequence
from dpserve.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PagedConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int | None = None  # None: derived from the pool
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]  # the device's default
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cuda_graphs: bool = True
    overlap: bool | None = None  # None: on CUDA only (a CPU forward cannot run beside the host)
    prefix_caching: bool = True  # share full blocks of equal prefixes (``block_pool.BlockPool``)
    weight_format: WeightFormat = DEFAULT_WEIGHT_FORMAT  # CPU projections' (layers.weight_format)


@dataclass(slots=True)
class _InFlight:
    sequences: list[Sequence]  # the rows of its sampled tokens
    launched: Launched
    # (sequence, first position, count) of prompt log-prob rows, and where the device step
    # leaves their log-probs (filled before the step's result is ready).
    prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)
    prompt_out: list[sampler.SampleOutput] = field(default_factory=list)
    forgotten: int = 0  # the backend's count of forgotten sequences when it was launched
    # Its sequences count its token as pending (only a step that stays in flight after the
    # call that launched it: one collected at once is never seen pending).
    counted: bool = False


class PagedBackend:
    """Implements ``backend.Backend`` for Llama-family models."""

    computes_prompt_logprobs = True  # logits at prompt positions (build_forward_batch)

    def __init__(self, model: Any, config: PagedConfig) -> None:
        self.config = config
        self.device: torch.device = model.device
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._sequences: dict[int, Sequence] = {}
        self._forgotten = 0  # sequences forgotten so far (finished, cancelled)
        # The tracked sequences whose sampling is more than an argmax (``bare_argmax``): while
        # there are none, a step samples with one argmax and reads nothing per sequence.
        self._sampled_fully: set[int] = set()
        self.scheduler: Scheduler[Sequence] | None = None
        self.prefill_tokens = 0
        overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self._queue = DeviceQueue(self.device, overlap)
        self._in_flight: deque[_InFlight] = deque()
        self._ready: list[Sampled] = []  # collected by release(), returned by the next step
        # The last step the host took in (its sequences and tokens): the next step's decodes
        # are usually those sequences, fed those tokens (``BatchBuilder.build``).
        self._last_sampled: tuple[list[Sequence], list[int]] | None = None
        # KV events of pools already released (their hashes are gone), not yet taken.
        self._released_events: list[KVEvent] = []
        # The engine's LoRA adapters (``enable_lora``); None: every row runs the base model.
        self.adapters: LoraSlots | None = None
        self._build(model)

    # ------------------------------------------------------------------------ construction

    def _build(self, model: Any) -> None:
        with torch.inference_mode():
            self.model: PagedModel | None = registry.build(model, self.config.weight_format)
            shape = self.model.kv_cache_shape(self.config.block_size)
            num_blocks = self._pool_blocks(shape)
            self.cache: PagedKVCache | None = PagedKVCache(shape, num_blocks, self.device)
            self.pool: BlockPool | None = BlockPool(
                num_blocks, enable_caching=self.config.prefix_caching
            )
        self.context_size = min(self.model.context_size, self.cache.token_capacity)
        # oneDNN's kernels for 1-2 rows are slower than for 4: smaller decode steps are padded.
        self._min_decode_rows = ONEDNN_MIN_ROWS if self.model.lm_head.onednn else 0
        # Fewer rows than that are padded up to it, unless the dense matmul takes them as they
        # are (``linear.small_batch_rows``).
        self._unpadded_rows = self.model.lm_head.small_rows
        self.max_num_seqs = self.config.max_num_seqs or max(
            1,
            min(
                DEFAULT_MAX_NUM_SEQS,
                self.cache.token_capacity // min(self.context_size, TOKENS_PER_SEQUENCE),
            ),
        )
        previous = self.scheduler
        waiting = previous.waiting if previous is not None else []
        self.scheduler = Scheduler(
            self.pool,
            self.config.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        self.scheduler.waiting.extend(waiting)
        if previous is not None:  # counters survive a suspend
            self.scheduler.preemptions = previous.preemptions
            self.scheduler.prefix_queries = previous.prefix_queries
            self.scheduler.prefix_hits = previous.prefix_hits
        blocks_per_sequence = shape.blocks_for(self.context_size)
        self.inputs: BatchBuilder[Sequence] | None = BatchBuilder(
            self.max_num_seqs, blocks_per_sequence, shape.block_size, self.device
        )
        with torch.inference_mode():
            self.model.warm_up(
                self.cache, self.max_num_seqs, blocks_per_sequence, self.max_num_batched_tokens
            )
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if not self._use_graphs():
            return
        try:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    self.model, self.cache, self.max_num_seqs, blocks_per_sequence
                )
        except RuntimeError as exc:  # a kernel that syncs with the host cannot be captured
            log.error("CUDA graph capture failed, decoding eagerly: %s", exc)
            torch.cuda.synchronize()
        if self.model.glue == "triton":
            self.piecewise = self._capture_piecewise()

    def _capture_piecewise(self) -> PiecewiseGraphs | None:
        """The graphs of steps with prompt chunks, if they capture and agree with the eager
        forward (checked on the fresh pool, before any sequence holds a block)."""
        assert self.model is not None and self.cache is not None
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                graphs = PiecewiseGraphs(self.model, self.cache, self.max_num_batched_tokens)
                if graphs.verify():
                    log.info(
                        "captured %d pieces for steps with prompt chunks of up to %d tokens "
                        "in %.1f s",
                        graphs.pieces_per_step * len(graphs.sizes),
                        graphs.sizes[-1],
                        time.perf_counter() - started,
                    )
                    return graphs
        except Exception:  # an optional speed-up: serving goes on without it, and says why
            log.exception("piecewise CUDA graph capture failed, prompt steps run eagerly")
            torch.cuda.synchronize()
        return None

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
        facts: dict[str, Any] = {"backend": "paged", "overlap": self._queue.overlap}
        if self.model is not None:  # which class of models/ runs it (models.registry)
            facts["model_class"] = type(self.model).__name__
        if self.cache is not None:
            facts.update(self.cache.describe())
        facts.update(
            {
                "max_num_seqs": self.max_num_seqs,
                "context_size": self.context_size,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "decode_attention": decode_attention_backend(self.device)
                if self.model is None or self.model.glue != "cpu"
                else "cpu",
                # Which code runs the layers' glue: "triton", "cpu" (C++ kernels) or "torch".
                "layer_kernels": self.model.glue if self.model is not None else None,
                "cuda_graphs": self.graphs.sizes if self.graphs is not None else [],
                # Token counts of the steps with prompt chunks replayed piecewise.
                "piecewise_graphs": self.piecewise.sizes if self.piecewise is not None else [],
            }
        )
        if self.model is not None and self.model.lm_head.onednn:
            # Decode steps of at most this many sequences use the dense weights (linear.py).
            facts["small_batch_rows"] = self.model.lm_head.small_rows
        if self.model is not None and self.model.lm_head.weight_format != DEFAULT_WEIGHT_FORMAT:
            facts["cpu_weights"] = self.model.lm_head.arithmetic  # --cpu-weights (linear.py)
            facts["batch_invariant"] = self.model.batch_invariant  # step_attention.py
        if self.device.type == "cuda":  # which code picks greedy tokens (sampler.greedy)
            facts["greedy_argmax"] = "triton" if triton_greedy.verified(self.device) else "torch"
        return facts

    def stats(self) -> dict[str, Any]:
        scheduler = self.scheduler
        assert scheduler is not None
        pool = scheduler.pool
        return {
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
            "prefill_tokens": self.prefill_tokens,
            "preemptions": scheduler.preemptions,
            "kv_free_blocks": pool.free_blocks,
            # vLLM's kv_cache_usage_perc: the share of blocks held by running sequences
            # (cached free blocks do not count: they are evicted when needed).
            "kv_cache_usage": pool.held_blocks / pool.usable_blocks,
            "kv_cached_blocks": pool.cached_blocks,
            # Free and holding nothing cached: the router's measure of what a new prefix
            # would evict here (routing.PrefixRouting.eviction_cost).
            "kv_empty_blocks": pool.empty_blocks,
            "prefix_caching": int(pool.enable_caching),
            # Context tokens looked up in / found in the prefix cache (vLLM's names).
            "prefix_cache_queries": scheduler.prefix_queries,
            "prefix_cache_hits": scheduler.prefix_hits,
            "prefix_cache_evictions": pool.evictions,
        }

    def enable_lora(self, max_loras: int, max_rank: int) -> LoraSlots:
        """LoRA slots for this model (``lora.slots``); a sequence's ``lora_slot`` then picks
        its adapter in every step."""
        assert self.model is not None
        self.adapters = LoraSlots(
            self.model.adapter_layout(),
            max_loras=max_loras,
            max_rank=max_rank,
            dtype=self.model.dtype,
            device=self.device,
        )
        return self.adapters

    def forget_cached_prefixes(self) -> None:
        """Stop sharing every cached block (an adapter was replaced or unloaded: blocks
        computed with its old weights must not be found under its name again)."""
        if self.pool is not None:
            self.pool.clear_cache()

    # ------------------------------------------------------------------------ prefix cache

    @property
    def kv_block_size(self) -> int:
        return self.config.block_size

    def kv_events(self) -> list[KVEvent]:
        """What changed in the pool's cached hashes since the last call."""
        events, self._released_events = self._released_events, []
        if self.pool is not None:
            events += self.pool.take_events()
        return events

    def kv_snapshot(self) -> list[BlockHash]:
        """Every hash the pool holds now (events taken before this are superseded by it)."""
        return [] if self.pool is None else self.pool.snapshot()

    # ---------------------------------------------------------------------------- requests

    def add(self, sequence: Sequence) -> None:
        assert self.scheduler is not None
        self._sequences[sequence.request_id] = sequence
        if not sequence.bare_argmax:
            self._sampled_fully.add(sequence.request_id)
        self.scheduler.add(sequence)

    def cancel(self, request_id: int) -> bool:
        sequence = self._sequences.pop(request_id, None)
        self._sampled_fully.discard(request_id)
        return sequence is not None and self._forget(sequence)

    def has_work(self) -> bool:
        return bool(self._in_flight or self._ready) or (
            self.scheduler is not None and self.scheduler.has_work()
        )

    def _forget(self, sequence: Sequence) -> bool:
        self._forgotten += 1
        if self._sequences.get(sequence.request_id) is sequence:
            del self._sequences[sequence.request_id]
            self._sampled_fully.discard(sequence.request_id)
        assert self.scheduler is not None
        if self.inputs is not None:
            self.inputs.release(sequence)
        return self.scheduler.remove(sequence)

    def release(self) -> None:
        assert self.scheduler is not None
        # What is in flight was computed: it is returned by the first step after reload.
        while self._in_flight:
            self._ready += self._collect(self._in_flight.popleft())
        self._queue.drain()
        self.scheduler.preempt_all()
        if self.pool is not None:
            self.pool.clear_cache()
            self._released_events += self.pool.take_events()
        self.model = self.cache = self.pool = self.graphs = self.piecewise = self.inputs = None
        self._last_sampled = None

    def reload(self, model: Any) -> None:
        self._build(model)

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[Sampled]:
        if self._ready:  # drained by release(): the runner applies them before anything runs
            ready, self._ready = self._ready, []
            return ready
        assert self.scheduler is not None and self.inputs is not None
        plan = self.scheduler.schedule()
        for sequence in plan.preempted:
            self.inputs.release(sequence)
        launched = False
        if plan:
            previous = self._in_flight[-1] if self._in_flight else None
            pending = None
            if previous is not None:
                pending = {s: row for row, s in enumerate(previous.sequences) if s.pending}
            adapter_weights = None if self.adapters is None else self.adapters.weights_of()
            built, late = self.inputs.build(plan, pending, self._last_sampled, adapter_weights)
            sampled = built.sampled
            assert self.model is not None
            # Penalty counts and grammar states are read from the host; such sequences have no
            # token in flight (see ``keep`` below), so nothing changes them until the step is
            # collected. Without any of them (nor temperatures or log-probs) a step is sampled
            # by one argmax, and nothing is read per sequence.
            bare = not self._sampled_fully
            histories = matchers = None
            if not bare:
                histories, matchers = token_histories(sampled), grammar_matchers(sampled)
            prompt_targets = None
            if built.prompt_rows:
                prompt_targets = [
                    token
                    for sequence, start, count in built.prompt_rows
                    for token in sequence.tokens_between(start + 1, start + 1 + count)
                ]
            prompt_out: list[sampler.SampleOutput] = []
            job = partial(
                self._device_step,
                built.batch,
                late,
                previous.launched if previous is not None and late is not None else None,
                len(sampled),
                None if bare else [sequence.params for sequence in sampled],
                None if bare else [sequence.context_length() for sequence in sampled],
                histories,
                matchers,
                prompt_targets,
                max((s.params.top_logprobs for s, _, _ in built.prompt_rows), default=0),
                prompt_out,
            )
            submitted = self._queue.submit(job)
            self.scheduler.commit(plan)
            self.prefill_tokens += sum(chunk.length for chunk in plan.prefills)
            # A sequence whose sampling reads host state (penalties, a grammar) or that
            # records prompt log-probs is taken in before the next step is built.
            launched = not built.prompt_rows and (
                bare or not any(sequence.needs_host_state for sequence in sampled)
            )
            in_flight = _InFlight(
                sampled, submitted, built.prompt_rows, prompt_out, self._forgotten
            )
            if launched and self._queue.overlap:  # stays in flight: its tokens are pending
                in_flight.counted = True
                for sequence in sampled:
                    sequence.pending += 1
            # Tracked even without sampled rows, so that its errors surface here.
            self._in_flight.append(in_flight)
        # With overlap the step just submitted stays in flight while the runner takes in the
        # one before it; the next call prepares its successor.
        keep = 1 if launched and self._queue.overlap else 0
        results: list[Sampled] = []
        while len(self._in_flight) > keep:
            results += self._collect(self._in_flight.popleft())
        # The runner accepts every one of these tokens before the next step is built.
        self._last_sampled = (
            (results[0].sequences, results[0].tokens) if len(results) == 1 else None
        )
        return results

    def _device_step(
        self,
        batch: ForwardBatch,
        late: PendingTokens | None,
        previous: Launched | None,
        rows: int,
        params: list[SamplingParams] | None,
        positions: list[int] | None,
        histories: list[penalties.RowTokens] | None = None,
        matchers: list[grammar.Matcher | None] | None = None,
        prompt_targets: list[int] | None = None,
        prompt_k: int = 0,
        prompt_out: list[sampler.SampleOutput] | None = None,
    ) -> sampler.SampleOutput:
        """The device's part of a step; reads no sequence (the host has moved on). ``rows``
        sampled rows; ``params`` None: every one of them by a bare argmax."""
        if late is not None and previous is not None:
            apply_pending(batch, late, previous.device_tokens())
        if params is None and matchers is None and prompt_targets is None:
            graphs = self.graphs
            if graphs is not None and graphs.can_run(batch) and rows == batch.num_decodes:
                # The argmax is in the graph.
                return sampler.SampleOutput(graphs.run_greedy(batch))
        logits = self._forward(batch)
        # The grammar masks are filled after the forward is launched: on a GPU they are
        # computed while its kernels run (llguidance's threads, outside the GIL), not before.
        allowed = None
        if matchers is not None:
            allowed = grammar.allowed(matchers, logits.shape[1], logits.device)
        if prompt_targets is not None and prompt_out is not None:
            # The rows after the sampled ones are prompt positions (batch.py).
            targets = torch.tensor(prompt_targets, dtype=torch.long).to(logits.device)
            prompt_out.append(sampler.log_probs_of(logits[rows:], targets, prompt_k))
            logits = logits[:rows]
        if not rows:
            return sampler.SampleOutput(logits.new_zeros(0, dtype=torch.long))
        if params is None or positions is None:
            return sampler.SampleOutput(sampler.greedy(logits))
        return sampler.sample(logits, params, positions, histories, allowed)

    def _collect(self, in_flight: _InFlight) -> list[Sampled]:
        """The sampled tokens of a step, for the sequences still tracked (one that finished
        or was cancelled since has its extra token dropped)."""
        host = in_flight.launched.wait()
        if in_flight.prompt_rows:
            _record_prompt_logprobs(in_flight.prompt_rows, in_flight.prompt_out[0].to_host())
        if in_flight.counted:
            for sequence in in_flight.sequences:
                sequence.pending -= 1
        if in_flight.forgotten == self._forgotten:  # every one of them still tracked
            return [Sampled(in_flight.sequences, host.tokens, host.logprobs, host.top)]
        rows = [
            row
            for row, sequence in enumerate(in_flight.sequences)
            if self._sequences.get(sequence.request_id) is sequence
        ]
        if not rows:
            return []
        if len(rows) == len(host.tokens):
            return [Sampled(in_flight.sequences, host.tokens, host.logprobs, host.top)]
        return [
            Sampled(
                [in_flight.sequences[row] for row in rows],
                [host.tokens[row] for row in rows],
                None if host.logprobs is None else [host.logprobs[row] for row in rows],
                None if host.top is None else [host.top[row] for row in rows],
            )
        ]

    def finish(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            self._forget(sequence)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert self.model is not None and self.cache is not None
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        if self.piecewise is not None and self.piecewise.can_run(batch):
            return self.piecewise.run(batch)
        count = batch.num_decodes
        if self._unpadded_rows < count < self._min_decode_rows and not batch.prefills:
            padded = pad_decodes(batch, self._min_decode_rows)
            return self.model.forward(padded, self.cache)[:count]
        return self.model.forward(batch, self.cache)


def _record_prompt_logprobs(
    prompt_rows: list[tuple[Sequence, int, int]], host: sampler.HostSample
) -> None:
    """Hand each sequence the log-probs (and alternatives) of its prompt rows, computed for all
    of them with one log-softmax, one top-k and one copy to the host."""
    assert host.logprobs is not None
    row = 0
    for sequence, start, count in prompt_rows:
        own_k = sequence.params.top_logprobs
        top = None
        if own_k and host.top is not None:
            top = [entries[:own_k] for entries in host.top[row : row + count]]
        sequence.record_prompt_logprobs(start, host.logprobs[row : row + count], top)
        row += count
