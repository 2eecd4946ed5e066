"""``Router``: the dispatcher's one call for "which engine", under the configured policy.

For ``prefix-aware`` it hashes the request's prompt (``dpserve.block_hash``, the engines' own
definition, at each engine's block size), asks the ``PrefixIndex`` how much of it each routable
engine holds, picks one (``routing.choose_by_prefix``), and counts the decisions and how good
the index's predictions were (predicted cached tokens against what the engine found). It
times each engine's requests (dispatch, first token, finish) for the price of a wait for a slot
there (``engine_pace``)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from dpserve import protocol
from dpserve.block_hash import BlockHash, BlockHashCache, extra_keys
from dpserve.coordinator.adapter_residency import AdapterResidency
from dpserve.coordinator.engine_pace import MIN_PREFILL_SAMPLE_TOKENS, EnginePace
from dpserve.coordinator.prefix_index import PrefixIndex
from dpserve.coordinator.registry import Engine, EngineRegistry
from dpserve.coordinator.requests import InflightRequest
from dpserve.coordinator.routing import (
    DEFAULT_PREFIX_ROUTING,
    Candidate,
    Decision,
    PrefixRouting,
    Reason,
    RoutingPolicy,
    choose_by_prefix,
    choose_engine,
)
from dpserve.limits import DEFAULT_PREFIX_CACHE_LIMITS
from dpserve.protocol import KvEvents

_new_tuple: Final = tuple.__new__


class _Prefill(NamedTuple):
    """A request's prefill sent to an engine and not known to be done."""

    identity: bytes
    uncached: int  # its prompt tokens the engine must compute (as predicted)
    sent_at: float
    ahead: int  # prefill tokens queued there before it, and its own
    # Whether it found a slot free and no prefill queued ahead: its first token then times
    # the engine's prefill (engine_pace).
    alone: bool


class Router:
    def __init__(
        self,
        policy: RoutingPolicy,
        registry: EngineRegistry,
        *,
        prediction_ttl: float = 2.0,
        weights: PrefixRouting = DEFAULT_PREFIX_ROUTING,
        request_snapshot: Callable[[bytes], object] = lambda identity: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.registry = registry
        self.weights = weights
        self.index = PrefixIndex(prediction_ttl)
        # Prompts share prefixes: their blocks' hashes are computed once, not per request.
        self.hashes = BlockHashCache(DEFAULT_PREFIX_CACHE_LIMITS.max_cached_block_hashes)
        self.request_snapshot = request_snapshot
        self.clock = clock  # seconds: prediction lifetimes and the engines' pace
        self.decisions: Counter[str] = Counter()
        self.adapters = AdapterResidency()
        self._predicted: dict[int, int] = {}  # request id -> predicted cached tokens
        # Prefill sent to each engine and not known to be done, by request id, and the
        # uncached tokens of it per engine.
        self._prefills: dict[int, _Prefill] = {}
        self._queued: dict[bytes, int] = {}
        self.paces: dict[bytes, EnginePace] = {}  # each engine's measured pace
        self.predicted_tokens = 0  # sums over finished requests with a reported count
        self.actual_tokens = 0
        self.prediction_error_tokens = 0

    # ------------------------------------------------------------------- decisions

    def choose(self, request: InflightRequest) -> Decision | None:
        if self.policy is not RoutingPolicy.PREFIX_AWARE:
            identity = choose_engine(self.registry, self.policy)
            return None if identity is None else Decision(identity, Reason.LOAD, 0, 0.0)
        routable = self.registry.routable
        if not routable:
            return None
        routable.rotate(-1)  # the remaining ties go round
        now = self.clock()
        index = self.index
        index.expire(now)
        # The context as the wire packs it (int32 each): hashed straight from those bytes.
        context = request.prompt_tokens
        if request.generated:
            context += request.generated
        context_tokens = len(context) // protocol.TOKEN_BYTES
        hashes_by_size, cached = self._cached_tokens(context, context_tokens, request, now)
        engines, caches, queued = self.registry.engines, index.engines, self._queued
        paces = self.paces
        adapter = request.params.get("lora_name")
        residency = self.adapters
        candidates = []
        any_held = False
        for identity in routable:
            engine, cache = engines[identity], caches.get(identity)
            queued_tokens = queued.get(identity, 0)
            held, free = 0, None
            if cache is not None:
                held = len(cache.hashes)
                empty = engine.stats.get("kv_empty_blocks")
                if empty is not None and cache.block_size is not None:
                    # Tokens it can store without evicting: its empty blocks at its last
                    # heartbeat less the prefill sent to it since that is not done.
                    free = int(empty) * cache.block_size - queued_tokens
                    free = free if free > 0 else 0
            loads_adapter = False
            if adapter:
                loads_adapter = not residency.holds(engine, adapter, now)
                any_held = any_held or not loads_adapter
            outstanding = len(engine.outstanding)
            slot_wait = 0.0
            pace = paces.get(identity)
            if (
                pace is not None
                and pace.wait_price_tokens
                # (a slot free by the heartbeat last read: no call)
                and (outstanding >= pace.runs_at_once or engine.stats is not pace.stats_read)
            ):
                slot_wait = pace.slot_wait_tokens(outstanding, engine.capacity, engine.stats)
            # A Candidate built as the tuple it is (its generated __new__ is a Python call,
            # and this runs for every engine for every request).
            fields = (
                identity,
                cached.get(identity, 0) if cached else 0,
                outstanding,
                queued_tokens,
                held,
                free,
                loads_adapter,
                slot_wait,
            )
            candidates.append(_new_tuple(Candidate, fields))
        decision = choose_by_prefix(candidates, context_tokens, self.weights)
        if decision is None:
            return None
        if hashes_by_size:
            size = index.block_size(decision.identity)
            if size is not None:
                index.predict(decision.identity, hashes_by_size[size], now)
        if adapter:
            chosen = engines[decision.identity]
            residency.routed(chosen, adapter, residency.holds(chosen, adapter, now), any_held, now)
        return decision

    def _cached_tokens(
        self, context: bytes, context_tokens: int, request: InflightRequest, now: float
    ) -> tuple[dict[int, list[BlockHash]], dict[bytes, int]]:
        """The context's block hashes at each block size of the routable engines, and the
        tokens of it each engine holds (by its events or a live prediction); both empty when
        no engine could hold a block of it (none reported a block size yet, or the context is
        shorter than a block and a token), so a short prompt is never hashed."""
        smallest = self.index.smallest_block_size
        if smallest is None or context_tokens <= smallest:
            return {}, {}
        caches = self.index.engines
        engines_by_size: dict[int, list[bytes]] = {}
        for identity in self.registry.routable:
            cache = caches.get(identity)
            size = None if cache is None else cache.block_size
            # At most context - 1 tokens can come from a cache (the last is computed).
            if size is not None and context_tokens > size:
                engines_by_size.setdefault(size, []).append(identity)
        if not engines_by_size:
            return {}, {}
        extra = extra_keys(request.params.get("cache_salt"), request.params.get("lora_name"))
        hashes_by_size: dict[int, list[BlockHash]] = {}
        cached: dict[bytes, int] = {}
        for size, identities in engines_by_size.items():
            usable = (context_tokens - 1) // size * size * protocol.TOKEN_BYTES
            hashes = self.hashes.packed_block_hashes(context[:usable], size, extra)
            hashes_by_size[size] = hashes
            # One walk along the prompt's blocks for every engine of this block size.
            for identity, blocks in self.index.matched_blocks(hashes, identities, now).items():
                cached[identity] = blocks * size
        return hashes_by_size, cached

    def routed(self, request: InflightRequest, decision: Decision) -> None:
        """The request was sent where ``decision`` said (and counts in its outstanding)."""
        self.decisions[decision.reason] += 1  # a StrEnum: the same key as its value
        if self.policy is RoutingPolicy.PREFIX_AWARE:
            request_id, identity = request.request_id, decision.identity
            self._predicted[request_id] = decision.predicted_cached_tokens
            self._uncharge(request_id)
            context = (len(request.prompt_tokens) + len(request.generated)) // 4
            uncached = context - decision.predicted_cached_tokens
            queued = self._queued.get(identity, 0)
            now = self.clock()
            alone = False
            pace = self.paces.get(identity)
            if pace is not None:
                engine = self.registry.engines[identity]
                before = len(engine.outstanding) - 1
                if not before:
                    pace.started(now)  # the engine was idle: its busy time starts now
                alone = not queued and before < pace.runs(engine.capacity, engine.stats)
            # Built as the tuple it is (its generated __new__ is a Python call per request).
            self._prefills[request_id] = _new_tuple(
                _Prefill, (identity, uncached, now, queued + uncached, alone)
            )
            self._queued[identity] = queued + uncached

    def first_token(self, request_id: int) -> None:
        """The request's first token came: its prefill is done (and, if it was long enough to
        say, how fast its engine prefills)."""
        prefill = self._uncharge(request_id)
        if prefill is None:
            return
        identity, uncached, sent_at, ahead, alone = prefill
        if ahead >= MIN_PREFILL_SAMPLE_TOKENS and (pace := self.paces.get(identity)) is not None:
            if alone:
                pace.prefilled(self.clock() - sent_at, uncached)
            elif not pace.prefill_rates:
                pace.prefilled_queued(self.clock() - sent_at, ahead)

    def _uncharge(self, request_id: int) -> _Prefill | None:
        """Take the request's prefill off its engine's queue (done, or it left)."""
        prefill = self._prefills.pop(request_id, None)
        if prefill is not None:
            identity = prefill.identity
            left = self._queued.get(identity, 0) - prefill.uncached
            if left > 0:
                self._queued[identity] = left
            else:
                self._queued.pop(identity, None)
        return prefill

    def finished(self, request: InflightRequest, cached_tokens: int | None) -> None:
        """The request finished on its engine (that engine's pace), which found
        ``cached_tokens`` of its prompt cached (the index's accuracy)."""
        pace = None if request.engine is None else self.paces.get(request.engine)
        if pace is not None:
            pace.request_finished(self.clock())
        predicted = self._predicted.pop(request.request_id, None)
        if predicted is None or cached_tokens is None:
            return
        self.predicted_tokens += predicted
        self.actual_tokens += cached_tokens
        self.prediction_error_tokens += abs(predicted - cached_tokens)

    def forget(self, request_id: int) -> None:
        self._predicted.pop(request_id, None)
        self._uncharge(request_id)

    # ----------------------------------------------------------------- membership

    def engine_added(self, engine: Engine) -> None:
        self.index.add_engine(engine.identity, engine.instance)
        if self.policy is RoutingPolicy.PREFIX_AWARE:  # the one policy that prices a queue
            self.paces[engine.identity] = EnginePace(self.weights.request_cost_tokens)

    def engine_removed(self, engine: Engine) -> None:
        self.index.remove_engine(engine.identity)
        self.adapters.engine_removed(engine.identity)
        self._queued.pop(engine.identity, None)
        self.paces.pop(engine.identity, None)
        for request_id in [r for r, p in self._prefills.items() if p.identity == engine.identity]:
            del self._prefills[request_id]

    def on_kv_events(self, engine: Engine, batch: KvEvents) -> None:
        if self.index.apply(engine.identity, batch):
            self.request_snapshot(engine.identity)

    # ---------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        engines = self.registry.engines
        by_rank = {
            str(engine.rank): self.index.held(identity) for identity, engine in engines.items()
        }
        paces = {
            str(engine.rank): pace.report()
            for identity, engine in engines.items()
            if (pace := self.paces.get(identity)) is not None
        }
        return {
            "indexed_blocks_by_rank": by_rank,
            "pace_by_rank": paces,
            "decisions": {str(reason): count for reason, count in self.decisions.items()},
            "adapter_decisions": dict(self.adapters.decisions),
            "predicted_cached_tokens": self.predicted_tokens,
            "actual_cached_tokens": self.actual_tokens,
            "prediction_error_tokens": self.prediction_error_tokens,
            "indexed_blocks": len(self.index.holders),
            "event_gaps": self.index.gaps,
            "stale_event_batches": self.index.stale_batches,
        }
