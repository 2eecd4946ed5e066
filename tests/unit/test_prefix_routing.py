"""The prefix index under events, gaps, restarts and deaths, and the prefix-aware policy."""

from __future__ import annotations

import random

import pytest

from dpserve import protocol
from dpserve.block_hash import ROOT_HASH, BlockHashCache, block_hashes, extra_keys, pack_hashes
from dpserve.coordinator.prefix_index import PrefixIndex
from dpserve.coordinator.registry import Engine, EngineRegistry
from dpserve.coordinator.requests import InflightRequest
from dpserve.coordinator.router import Router
from dpserve.coordinator.routing import (
    DEFAULT_PREFIX_ROUTING,
    Candidate,
    Reason,
    RoutingPolicy,
    choose_by_prefix,
)
from dpserve.engine.fake_cache import SimulatedPrefixCache
from dpserve.protocol import KvEvent, KvEvents, ProtocolError, decode, encode

A, B = b"engine-a", b"engine-b"


def stored(hashes: list[int], parent: int | None = ROOT_HASH) -> KvEvent:
    return KvEvent(0, pack_hashes(hashes), parent)


def removed(hashes: list[int]) -> KvEvent:
    return KvEvent(1, pack_hashes(hashes), None)


CLEARED = KvEvent(2, b"", None)


def batch(instance: str, number: int, block_size: int, events: list[KvEvent]) -> KvEvents:
    """A KV_EVENTS batch as the coordinator receives it: through the wire format."""
    received: KvEvents = decode(encode(KvEvents(instance, number, block_size, events)))
    return received


def test_index_follows_events_and_matches_prefixes_only() -> None:
    index = PrefixIndex()
    index.add_engine(A, "a1")
    hashes = block_hashes(list(range(40)), 4)
    assert not index.apply(A, batch("a1", 0, 4, [CLEARED, stored(hashes[:6])]))
    assert index.matched_blocks(hashes, [A, B], now=0.0) == {A: 6, B: 0}
    assert not index.apply(A, batch("a1", 1, 4, [removed([hashes[2]])]))
    assert index.matched_blocks(hashes, [A], now=0.0) == {A: 2}  # a prefix, not a count


def test_a_gap_drops_the_engine_and_waits_for_a_snapshot() -> None:
    index = PrefixIndex()
    index.add_engine(A, "a1")
    index.apply(A, batch("a1", 0, 4, [CLEARED, stored([1, 2])]))
    assert index.apply(A, batch("a1", 2, 4, [stored([3], 2)]))  # batch 1 was lost
    assert index.held(A) == 0 and index.gaps == 1
    assert not index.apply(A, batch("a1", 3, 4, [stored([4], 3)]))  # ignored meanwhile
    assert index.held(A) == 0
    index.apply(A, batch("a1", 4, 4, [CLEARED, stored([1, 2, 3, 4], None)]))
    assert index.held(A) == 4
    assert not index.apply(A, batch("a1", 5, 4, [stored([5], 4)]))
    assert index.held(A) == 5


def test_restart_and_death_drop_entries_and_stale_batches_are_ignored() -> None:
    index = PrefixIndex()
    index.add_engine(A, "a1")
    index.add_engine(B, "b1")
    index.apply(A, batch("a1", 0, 4, [CLEARED, stored([1, 2])]))
    index.apply(B, batch("b1", 0, 4, [CLEARED, stored([1])]))
    index.add_engine(A, "a2")  # restarted: a new process under the same identity
    assert index.held(A) == 0 and index.holders[1] == {B}
    index.apply(A, batch("a1", 1, 4, [stored([3], 2)]))  # from the dead process
    assert index.held(A) == 0 and index.stale_batches == 1
    index.remove_engine(B)
    assert index.holders == {}


def test_predictions_count_until_their_ttl() -> None:
    index = PrefixIndex(prediction_ttl=2.0)
    index.add_engine(A, "a1")
    index.apply(A, batch("a1", 0, 4, [CLEARED]))
    index.predict(A, [7, 8], now=10.0)
    assert index.matched_blocks([7, 8, 9], [A], now=11.0) == {A: 2}
    assert index.matched_blocks([7, 8, 9], [A], now=11.0, confirmed_only=True) == {A: 0}
    index.expire(12.5)
    assert index.matched_blocks([7, 8], [A], now=12.5) == {A: 0}


def test_malformed_events_are_refused_whole() -> None:
    index = PrefixIndex()
    index.add_engine(A, "a1")
    with pytest.raises(ProtocolError, match="multiple of 8"):
        index.apply(A, batch("a1", 0, 4, [KvEvent(0, b"abc", None)]))  # type: ignore[list-item]
    with pytest.raises(ProtocolError, match="kind"):
        index.apply(A, batch("a1", 0, 4, [KvEvent(9, b"", None)]))
    with pytest.raises(ProtocolError, match="block size"):
        index.apply(A, batch("a1", 0, 0, []))
    assert index.held(A) == 0


def test_policy_weighs_cached_prefix_against_load() -> None:
    cached = Candidate(A, cached_tokens=960, outstanding=2)
    idle = Candidate(B, cached_tokens=0, outstanding=0)
    decision = choose_by_prefix([cached, idle], prompt_tokens=1000)
    assert decision is not None and (decision.identity, decision.reason) == (A, Reason.PREFIX)
    # A short cached prefix is not worth queueing behind another prompt's prefill.
    short = Candidate(A, cached_tokens=64, outstanding=2, queued_prefill_tokens=500)
    decision = choose_by_prefix([short, idle], prompt_tokens=1000)
    assert decision is not None and (decision.identity, decision.reason) == (B, Reason.BALANCE)
    # Nothing cached anywhere: the least loaded.
    decision = choose_by_prefix([Candidate(A, 0, 3), Candidate(B, 0, 1)], prompt_tokens=1000)
    assert decision is not None and (decision.identity, decision.reason) == (B, Reason.LOAD)
    assert choose_by_prefix([], prompt_tokens=10) is None


def test_a_miss_that_would_evict_costs_the_evicted_tokens() -> None:
    # A holds the prefix but has prefill queued; B is a little less busy. B wins while it has
    # room for the prompt, not once storing it would evict as many cached tokens, which later
    # requests would prefill again.
    holder = Candidate(A, 960, outstanding=10, queued_prefill_tokens=1000, free_tokens=0)
    roomy = Candidate(B, 0, outstanding=8, free_tokens=5_000)
    decision = choose_by_prefix([holder, roomy], prompt_tokens=1000)
    assert decision is not None and (decision.identity, decision.reason) == (B, Reason.BALANCE)
    assert decision.cost == 1000 + 16 * 8
    full = Candidate(B, 0, outstanding=8, free_tokens=100)
    decision = choose_by_prefix([holder, full], prompt_tokens=1000)
    assert decision is not None and (decision.identity, decision.reason) == (A, Reason.PREFIX)
    # A itself evicts its 40 uncached tokens' worth.
    assert decision.cost == 40 + 1000 + 16 * 10 + 40
    # Room unknown (no heartbeat yet): no eviction cost.
    unknown = Candidate(B, 0, outstanding=8)
    decision = choose_by_prefix([holder, unknown], prompt_tokens=1000)
    assert decision is not None and decision.identity == B


def test_hot_spot_guard_spreads_a_popular_prefix() -> None:
    # However long the cached prefix, an engine far busier than the idlest is passed over.
    bound = DEFAULT_PREFIX_ROUTING.hot_spot_slack  # the idlest has none outstanding
    hot = Candidate(A, cached_tokens=100_000, outstanding=bound + 1)
    decision = choose_by_prefix([hot, Candidate(B, 0, 0)], prompt_tokens=100_001)
    assert decision is not None and (decision.identity, decision.reason) == (B, Reason.HOT_SPOT)
    # At the bound it is still the prefix's engine: an ordinary burst does not move requests.
    busy = Candidate(A, cached_tokens=100_000, outstanding=bound)
    decision = choose_by_prefix([busy, Candidate(B, 0, 0)], prompt_tokens=100_001)
    assert decision is not None and (decision.identity, decision.reason) == (A, Reason.PREFIX)


def test_a_new_prefix_goes_to_the_emptiest_cache() -> None:
    full = Candidate(A, cached_tokens=0, outstanding=0, held_blocks=900)
    empty = Candidate(B, cached_tokens=0, outstanding=0, held_blocks=10)
    decision = choose_by_prefix([full, empty], prompt_tokens=500)
    assert decision is not None and (decision.identity, decision.reason) == (B, Reason.LOAD)


def test_the_fake_engines_cache_hashes_and_reports_like_the_pool() -> None:
    cache = SimulatedPrefixCache(capacity_blocks=4, block_size=4)
    prompt = list(range(10))  # 2 full blocks
    assert cache.admit(prompt, b"") == 0
    assert cache.admit(prompt, b"") == 8
    assert cache.admit(prompt, extra_keys("other tenant")) == 0
    assert cache.queries == 30 and cache.hits == 8
    events = cache.take_events()
    assert events[0].hashes == block_hashes(prompt, 4) and events[0].parent == ROOT_HASH
    assert cache.evictions == 0 and len(cache) == 4
    cache.admit(list(range(100, 105)), b"")  # one more block: the least recently used goes
    assert cache.evictions == 1 and cache.take_events()[-1].kind == 1


def test_the_router_reads_an_engines_room_from_its_heartbeat_stats() -> None:
    prompt = list(range(64))
    hashes = block_hashes(prompt[:60], 4)

    def route(b_empty_blocks: int) -> bytes:
        registry = EngineRegistry()
        router = Router(RoutingPolicy.PREFIX_AWARE, registry)
        for identity, instance in ((A, "a1"), (B, "b1")):
            engine = Engine(identity, len(registry), capacity=8, instance=instance, last_seen=0)
            registry.add(engine)
            router.engine_added(engine)
        # A holds the prompt's first 60 tokens but is busy; B is idle and holds none of it.
        router.on_kv_events(registry.engines[A], batch("a1", 0, 4, [CLEARED, stored(hashes)]))
        router.on_kv_events(registry.engines[B], batch("b1", 0, 4, [CLEARED]))
        registry.engines[A].outstanding = set(range(4))
        registry.engines[B].stats = {"kv_empty_blocks": b_empty_blocks}
        request = InflightRequest(1, b"client", 1, protocol.pack_tokens(prompt), {}, False, 0.0)
        decision = router.choose(request)
        assert decision is not None
        return decision.identity

    assert route(b_empty_blocks=100) == B  # room for the whole prompt: the idle engine
    assert route(b_empty_blocks=0) == A  # full of other cached prefixes: the holder
    # At the margin, in tokens (not the prompt's packed bytes): A costs its 4 uncached tokens
    # + 16 per request x 4 = 68; B 64 tokens to prefill + what it evicts past its free room.
    assert route(b_empty_blocks=16) == B  # 64 free: 64 < 68
    assert route(b_empty_blocks=14) == A  # 56 free: 64 + 8 evicted = 72 > 68


# ------------------------------------------------------------- the router's fast paths


def test_the_hash_cache_gives_the_chain_hashes_and_stays_bounded() -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(1, 600))] for _ in range(4)]
    for max_blocks in (0, 40, 100_000):
        cache = BlockHashCache(max_blocks)
        for _ in range(60):
            tokens = rng.choice(prefixes) + [
                rng.randrange(50_000) for _ in range(rng.randrange(40))
            ]
            size, salt = rng.choice((1, 4, 16)), rng.choice((b"", extra_keys("tenant")))
            packed = protocol.pack_tokens(tokens)
            # Exact inputs only: another block size, salt or parent is never a hit.
            assert cache.packed_block_hashes(packed, size, salt) == block_hashes(tokens, size, salt)
            assert cache.blocks <= max_blocks
    # A prompt after another with the same 600-token prefix: only the run of 16 blocks where
    # they part, and the new tail, are hashed; the 9 whole runs before are found.
    cache = BlockHashCache(100_000)
    prefix = [rng.randrange(50_000) for _ in range(600)]
    first, second = prefix + [1] * 30, prefix + [2] * 30
    cache.packed_block_hashes(protocol.pack_tokens(first), 4)
    hashed = cache.misses
    assert cache.packed_block_hashes(protocol.pack_tokens(second), 4) == block_hashes(second, 4)
    assert cache.hits == 9 * 16 and cache.misses - hashed == len(second) // 4 - 9 * 16
    with pytest.raises(ValueError, match="block_size"):
        BlockHashCache(10).packed_block_hashes(b"", 0)


def _walk_block_by_block(
    index: PrefixIndex, hashes: list[int], identities: list[bytes], now: float, confirmed: bool
) -> dict[bytes, int]:
    """What ``matched_blocks`` means, one block and one engine at a time."""
    matched = dict.fromkeys(identities, 0)
    for identity in identities:
        cache = index.engines.get(identity)
        if cache is None:
            continue
        for block_hash in hashes:
            predicted = not confirmed and cache.predicted.get(block_hash, 0.0) > now
            if block_hash not in cache.hashes and not predicted:
                break
            matched[identity] += 1
    return matched


def test_the_prefix_walk_equals_a_block_by_block_walk() -> None:
    rng = random.Random(3)
    chains = [block_hashes([rng.randrange(1000) for _ in range(64)], 4) for _ in range(3)]
    engines = [b"e%d" % n for n in range(5)]
    for trial in range(40):
        index = PrefixIndex(prediction_ttl=2.0)
        for identity in engines[:4]:  # the fifth never registered
            index.add_engine(identity, "i")
            # Each holds a random part of each chain: a prefix, then holes.
            held = [h for chain in chains for h in chain if rng.random() < 0.8]
            index.apply(identity, batch("i", 0, 4, [CLEARED, stored(held)]))
        for moment in (0.0, 1.0, 1.5):  # in time order, as the router's monotonic clock
            for identity in engines[:4]:
                chain = rng.choice(chains)
                index.predict(identity, chain[: rng.randrange(len(chain))], now=moment)
        now = rng.choice((0.5, 1.9, 2.5, 3.2, 4.0))
        chain = rng.choice(chains)[: rng.randrange(1, 17)]
        for confirmed in (False, True):
            expected = _walk_block_by_block(index, chain, engines, now, confirmed)
            got = index.matched_blocks(chain, engines, now, confirmed_only=confirmed)
            assert got == expected, (trial, now, confirmed)


def test_a_prediction_made_again_outlives_the_first() -> None:
    index = PrefixIndex(prediction_ttl=2.0)
    index.add_engine(A, "a1")
    index.apply(A, batch("a1", 0, 4, [CLEARED]))
    index.predict(A, [7, 8], now=10.0)
    index.predict(A, [8, 9], now=11.0)
    assert index.matched_blocks([7, 8, 9], [A], now=12.5) == {A: 0}  # 7 expired
    assert index.matched_blocks([8, 9], [A], now=12.5) == {A: 2}  # 8 was predicted again
    assert index.matched_blocks([8, 9], [A], now=13.0) == {A: 0}
    assert index.engines[A].predicted == {}


def test_short_prompts_are_routed_without_hashing() -> None:
    registry = EngineRegistry()
    router = Router(RoutingPolicy.PREFIX_AWARE, registry)
    engine = Engine(A, 0, capacity=8, instance="a1", last_seen=0)
    registry.add(engine)
    router.engine_added(engine)
    router.on_kv_events(engine, batch("a1", 0, 16, [CLEARED]))
    for length in (1, 16, 17, 40):
        request = InflightRequest(
            length, b"c", length, protocol.pack_tokens([5] * length), {}, False, 0.0
        )
        assert router.choose(request) is not None
    # Only the prompts with a token past a whole block were hashed (17 -> 1, 40 -> 2 blocks).
    assert router.hashes.hits + router.hashes.misses == 3
