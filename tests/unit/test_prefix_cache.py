"""Automatic prefix caching: the pool's bookkeeping, and outputs that do not change with it.

Exactness runs the tiny random Llama on CPU in fp32 with greedy decoding: every scenario is
served once with prefix caching and once without, and the tokens must be equal, token for
token, while the cached side really hit (its counters and ``cached_tokens`` say so)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dpserve.block_hash import (
    ROOT_HASH,
    block_hashes,
    extra_keys,
    hash_block,
    packed_block_hashes,
    unpack_hashes,
)
from dpserve.engine.kv_events import KVEventKind, KVEventPublisher
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.paged.block_pool import BlockPool
from dpserve.engine.paged.scheduler import Scheduler
from dpserve.engine.runner import RunnerRequest as EngineRequest
from dpserve.protocol import pack_tokens
from dpserve.sampling import InvalidSamplingParams, SamplingParams

BLOCK = 4


# ------------------------------------------------------------------------------ hashing


def test_block_hashes_chain_and_are_stable_across_processes() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, BLOCK)
    assert len(hashes) == 2  # the partial third block has none
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # Pinned value: a change of the encoding would split engines and coordinators of
    # different versions (and Python's salted hash() would change it every run).
    assert hashes[0] == 3097706123046003396
    assert all(0 <= h < 2**64 for h in hashes)
    # Same block after a different prefix: a different hash.
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], BLOCK)[1] != hashes[1]
    assert block_hashes(tokens, BLOCK, extra_keys("tenant-a")) != hashes
    assert block_hashes(tokens, BLOCK, start=1, parent=hashes[0]) == hashes[1:]
    # The coordinator hashes a prompt straight from its packed wire bytes: the same hashes.
    for salt in (b"", extra_keys("tenant-a")):
        assert packed_block_hashes(pack_tokens(tokens), BLOCK, salt) == block_hashes(
            tokens, BLOCK, salt
        )


def test_block_hash_is_the_same_in_another_interpreter() -> None:
    import subprocess
    import sys

    code = "from dpserve.block_hash import block_hashes; print(block_hashes(list(range(8)), 4))"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert other.strip() == str(block_hashes(list(range(8)), BLOCK))


# ---------------------------------------------------------------------------- the pool


def test_freed_blocks_stay_cached_until_the_pool_needs_them() -> None:
    pool = BlockPool(1 + 4)
    first = pool.allocate(2)
    pool.cache_full_block(first[0], 11, ROOT_HASH)
    pool.cache_full_block(first[1], 12, 11)
    pool.free(first)
    assert pool.free_blocks == 4 and pool.cached_blocks == 2
    assert pool.lookup([11, 12, 13]) == first  # still there after being freed
    # Never-hashed blocks go first: the cached ones survive an allocation of two.
    other = pool.allocate(2)
    assert set(other).isdisjoint(first) and pool.cached_blocks == 2
    # The pool is dry of empty blocks: the tail of the freed table (block 12) goes first.
    pool.allocate(1)
    assert pool.lookup([11, 12]) == first[:1] and pool.evictions == 1
    events = pool.take_events()
    assert [(e.kind, e.hashes, e.parent) for e in events] == [
        (KVEventKind.STORED, [11, 12], ROOT_HASH),
        (KVEventKind.REMOVED, [12], None),
    ]


def test_a_hit_shares_blocks_and_takes_evictable_ones_out_of_the_free_count() -> None:
    pool = BlockPool(1 + 3)
    [block] = pool.allocate(1)
    pool.cache_full_block(block, 5, ROOT_HASH)
    pool.touch([block])  # a second sequence shares it
    assert pool.ref_counts[block] == 2
    pool.free([block])
    pool.free([block])
    assert pool.free_blocks == 3
    pool.touch([block])  # found again after both let it go
    assert pool.free_blocks == 2 and pool.ref_counts[block] == 1
    with pytest.raises(ValueError, match="double free"):
        pool.free([block, block])
    pool.check_invariants([[block]])


def test_the_same_prefix_computed_twice_is_cached_once() -> None:
    pool = BlockPool(1 + 2)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, 7, ROOT_HASH)
    pool.cache_full_block(b, 7, ROOT_HASH)  # computed concurrently by another sequence
    assert pool.lookup([7]) == [a] and pool.block_hash[b] is None
    pool.free([b])
    pool.check_invariants([[a]])


def test_without_caching_nothing_is_hashed() -> None:
    pool = BlockPool(1 + 2, enable_caching=False)
    [block] = pool.allocate(1)
    pool.cache_full_block(block, 7, ROOT_HASH)
    assert pool.lookup([7]) == [] and not pool.take_events()


def test_refreshed_blocks_are_evicted_after_every_other_free_block() -> None:
    pool = BlockPool(1 + 4)
    older, newer = pool.allocate(2), pool.allocate(2)
    for blocks, first in ((older, 20), (newer, 30)):
        pool.cache_full_block(blocks[0], first, ROOT_HASH)
        pool.cache_full_block(blocks[1], first + 1, first)
        pool.free(blocks)
    # Least recently freed first: the older prefix would go first, its tail before its head.
    pool.refresh(pool.lookup([20, 21]))
    taken = pool.allocate(1)
    assert pool.lookup([30, 31]) == newer[:1] and pool.lookup([20, 21]) == older
    taken += pool.allocate(2)  # the refreshed prefix goes last, tail first
    assert pool.lookup([30]) == [] and pool.lookup([20, 21]) == older[:1]
    taken += pool.allocate(1)
    pool.refresh(taken)  # held blocks are not evictable: nothing moves
    pool.check_invariants([[block] for block in taken])


def test_a_waiting_request_keeps_its_cached_prefix_from_being_evicted_first() -> None:
    # The coordinator routes a request to the engine that holds its prefix; while it waits
    # for a slot, a request admitted before it must evict other free blocks first.
    pool = BlockPool(1 + 6)
    scheduler: Scheduler[TokenSequence] = Scheduler(
        pool, BLOCK, max_num_seqs=1, max_num_batched_tokens=64
    )
    prefix, other = list(range(1, 2 * BLOCK + 1)), list(range(100, 100 + 2 * BLOCK))
    for prompt in ([*prefix, 7], [*other, 7]):  # each leaves 2 cached blocks, prefix oldest
        sequence = TokenSequence(prompt)
        scheduler.add(sequence)
        scheduler.commit(scheduler.schedule())
        assert scheduler.remove(sequence)
    running = TokenSequence([500] * (3 * BLOCK))  # needs 3 blocks: 2 empty + 1 evicted
    waiting = TokenSequence([*prefix, 8, 9])
    scheduler.add(running)
    scheduler.add(waiting)  # no slot for it yet (max_num_seqs 1)
    scheduler.commit(scheduler.schedule())
    assert scheduler.running == [running] and list(scheduler.waiting) == [waiting]
    assert pool.evictions == 1
    assert len(pool.lookup(block_hashes(prefix, BLOCK))) == 2  # the other prefix paid
    assert scheduler.remove(running)
    scheduler.commit(scheduler.schedule())
    assert waiting.cached_prompt_tokens == 2 * BLOCK


def test_publisher_numbers_batches_and_bounds_their_size() -> None:
    pool = BlockPool(1 + 40)
    blocks = pool.allocate(40)
    parent = ROOT_HASH
    for index, block in enumerate(blocks):
        pool.cache_full_block(block, 1000 + index, parent)
        parent = 1000 + index
    publisher = KVEventPublisher("engine-1", BLOCK, max_hashes=16)
    messages = publisher.messages(pool.take_events())
    assert [m.number for m in messages] == [0, 1, 2]
    stored = [h for m in messages for e in m.events for h in unpack_hashes(e.hashes)]
    assert stored == [1000 + i for i in range(40)]
    assert all(sum(len(e.hashes) // 8 for e in m.events) <= 16 for m in messages)
    # A split chain still says what each piece continues from.
    assert [e.parent for m in messages for e in m.events] == [ROOT_HASH, 1015, 1031]
    snapshot = publisher.snapshot(pool.snapshot())
    assert snapshot[0].number == 3 and snapshot[0].events[0].kind == KVEventKind.CLEARED


# ------------------------------------------------------- randomized pool invariants


@dataclass(eq=False)
class TokenSequence:
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    block_hashes: list[int] = field(default_factory=list)
    cache_extra: bytes = b""
    cached_prompt_tokens: int | None = None
    pending: int = 0
    wants_prompt_logprobs: bool = False

    def context_length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def tokens_between(self, start: int, end: int) -> list[int]:
        return (self.prompt + self.generated)[start:end]


def test_random_operations_keep_the_pool_consistent() -> None:
    """Thousands of add / cancel / finish / preempt / step operations over prompts that share
    prefixes, checking after every one: each block's reference count equals the block tables
    holding it, no block is both free and held, and nothing leaks once all finished."""
    rng = random.Random(15)
    prefixes = [[rng.randrange(100) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    num_blocks = 1 + 40
    pool = BlockPool(num_blocks)
    scheduler: Scheduler[TokenSequence] = Scheduler(
        pool, BLOCK, max_num_seqs=6, max_num_batched_tokens=20
    )
    live: list[TokenSequence] = []
    operations = {"add": 0, "cancel": 0, "finish": 0, "preempt": 0, "step": 0}
    for _ in range(6000):
        roll = rng.random()
        if roll < 0.2:
            prefix = rng.choice(prefixes)[: rng.randint(1, 30)]
            tail = [rng.randrange(100) for _ in range(rng.randint(0, 8))]
            sequence = TokenSequence(prefix + tail)
            sequence.cache_extra = extra_keys("x") if rng.random() < 0.1 else b""
            scheduler.add(sequence)
            live.append(sequence)
            operations["add"] += 1
        elif roll < 0.27 and live:
            victim = live.pop(rng.randrange(len(live)))
            assert scheduler.remove(victim)
            operations["cancel"] += 1
        elif roll < 0.3 and scheduler.running:
            scheduler.preempt_all()
            operations["preempt"] += 1
        else:
            plan = scheduler.schedule()
            scheduler.commit(plan)
            operations["step"] += 1
            sampled = [*plan.decodes, *(c.sequence for c in plan.prefills if c.completes_prefill)]
            for sequence in sampled:
                if rng.random() < 0.08 or sequence.context_length() >= 60:
                    live.remove(sequence)
                    assert scheduler.remove(sequence)
                    operations["finish"] += 1
                else:
                    sequence.generated.append(rng.randrange(100))
        pool.check_invariants([s.blocks for s in scheduler.running])
        assert all(not s.blocks and s.num_cached == 0 for s in scheduler.waiting)
        for sequence in scheduler.running:
            # What a sequence reads from the cache is what its tokens hash to.
            full = sequence.num_cached // BLOCK
            expected = block_hashes(sequence.tokens_between(0, full * BLOCK), BLOCK)
            if not sequence.cache_extra:
                held = [pool.block_hash[b] for b in sequence.blocks[:full]]
                assert all(h is None or h == e for h, e in zip(held, expected, strict=True))
    assert scheduler.prefix_hits > 0 and scheduler.preemptions > 0 and pool.evictions > 0
    assert min(operations.values()) > 0, operations
    for sequence in live:
        assert scheduler.remove(sequence)
    pool.check_invariants([])
    assert pool.free_blocks == num_blocks - 1 and not any(pool.ref_counts)


# ------------------------------------------------------------ exactness on the model


def greedy(request_id: int, prompt: list[int], new: int = 12, **params: Any) -> EngineRequest:
    params = {"temperature": 0.0, "num_tokens_to_generate": new, **params}
    return EngineRequest(request_id, prompt, SamplingParams(**params))


Outputs = dict[int, tuple[list[int], int | None]]  # request id -> (tokens, cached tokens)


def serve(runner: ModelRunner, waves: list[list[EngineRequest]]) -> Outputs:
    """Each wave is added at once and run to completion before the next."""
    out: Outputs = {}
    for wave in waves:
        for request in wave:
            out[request.request_id] = ([], None)
            runner.add(request)
        steps = 0
        while runner.has_work():
            for update in runner.step():
                tokens, cached = out[update.request_id]
                if update.cached_tokens is not None:
                    cached = update.cached_tokens
                out[update.request_id] = (tokens + update.tokens, cached)
            steps += 1
            assert steps < 5000
    return out


def runners(path: Path, **kwargs: Any) -> tuple[ModelRunner, ModelRunner]:
    made = []
    for caching in (True, False):
        runner = ModelRunner(str(path), block_size=BLOCK, prefix_caching=caching, **kwargs)
        runner.eos_token_ids = frozenset()  # every request runs all its tokens
        made.append(runner)
    return made[0], made[1]


def both(
    path: Path, waves: list[list[EngineRequest]], **kwargs: Any
) -> tuple[Outputs, ModelRunner]:
    cached_runner, plain_runner = runners(path, **kwargs)
    cached = serve(cached_runner, waves)
    plain = serve(plain_runner, waves)
    for request_id, (tokens, _) in plain.items():
        assert cached[request_id][0] == tokens, f"request {request_id} changed with caching"
        assert plain[request_id][1] == 0
    assert plain_runner.stats()["prefix_cache_hits"] == 0
    return cached, cached_runner


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 380) for _ in range(length)]


def test_prefix_ending_mid_block_and_at_a_block_boundary(tiny_model_path: Path) -> None:
    shared_mid, shared_edge = prompt_of(1, 10), prompt_of(2, 12)
    waves = [
        [greedy(0, shared_mid + prompt_of(3, 7)), greedy(1, shared_edge + prompt_of(4, 5))],
        [greedy(2, shared_mid + prompt_of(5, 9)), greedy(3, shared_edge + prompt_of(6, 6))],
    ]
    out, runner = both(tiny_model_path, waves)
    assert out[2][1] == 8  # 10 shared tokens: the two full blocks before the split
    assert out[3][1] == 12  # the shared prefix is exactly three blocks
    stats = runner.stats()
    assert stats["prefix_cache_hits"] == 20 and stats["prefix_cache_queries"] == 17 + 17 + 19 + 18


def test_whole_prompt_cached_recomputes_only_its_last_block(tiny_model_path: Path) -> None:
    prompt = prompt_of(7, 21)
    exact = prompt_of(8, 16)  # a whole number of blocks: the last block is recomputed
    waves = [[greedy(0, prompt), greedy(1, exact)], [greedy(2, prompt), greedy(3, exact)]]
    out, _ = both(tiny_model_path, waves)
    assert out[2][1] == 20 and out[3][1] == 12
    # Generated tokens are cached too: a prompt that continues a finished request's context.
    follow = prompt + out[0][0]
    again, _ = both(tiny_model_path, [[greedy(0, prompt)], [greedy(4, follow)]])
    # 21 + 12 tokens; the last sampled token was never fed, so 32 are in the cache.
    assert again[4][1] == 32


def test_concurrent_sharing_with_preemption_and_resume(tiny_model_path: Path) -> None:
    system = prompt_of(9, 18)
    requests = [greedy(i, system + prompt_of(100 + i, 3 + i), new=30) for i in range(6)]
    # Resume tokens: a request re-dispatched from another engine continues after them.
    resumed = greedy(6, system + prompt_of(200, 5), new=30)
    resumed.resume_tokens = prompt_of(201, 7)
    out, runner = both(
        tiny_model_path,
        [[requests[0]], [*requests[1:], resumed]],
        kv_cache_bytes=_pool_bytes(tiny_model_path, blocks=1 + 40),
        max_num_seqs=6,
    )
    stats = runner.stats()
    assert stats["preemptions"] > 0, "the pool was meant to run dry"
    assert all(out[i][1] and out[i][1] >= 16 for i in range(1, 7))
    assert stats["kv_free_blocks"] == stats["kv_blocks"] - 1  # everything came back


def test_an_evicted_block_is_recomputed(tiny_model_path: Path) -> None:
    first = prompt_of(11, 30)
    fillers = [greedy(10 + i, prompt_of(300 + i, 40), new=4) for i in range(4)]
    out, runner = both(
        tiny_model_path,
        [[greedy(0, first)], fillers, [greedy(1, first)]],
        kv_cache_bytes=_pool_bytes(tiny_model_path, blocks=1 + 30),
        max_num_seqs=1,
    )
    assert runner.stats()["prefix_cache_evictions"] > 0
    assert out[1][1] == 0, "the fillers should have evicted the first prompt's blocks"


def test_cache_salt_isolates_tenants(tiny_model_path: Path) -> None:
    prompt = prompt_of(12, 20)
    waves = [
        [greedy(0, prompt, cache_salt="tenant-a")],
        [
            greedy(1, prompt, cache_salt="tenant-b"),
            greedy(2, prompt),
        ],
        [greedy(3, prompt, cache_salt="tenant-a")],
    ]
    out, _ = both(tiny_model_path, waves)
    assert out[1][1] == 0 and out[2][1] == 0  # another salt, or none: nothing shared
    assert out[3][1] == 16  # the same salt shares
    with pytest.raises(InvalidSamplingParams, match="cache_salt"):
        SamplingParams(cache_salt=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidSamplingParams, match="at most"):
        SamplingParams(cache_salt="x" * 10_000)


_BLOCK_BYTES: dict[Path, int] = {}


def _pool_bytes(path: Path, blocks: int) -> int:
    if path not in _BLOCK_BYTES:
        probe = ModelRunner(str(path), max_num_seqs=1, block_size=BLOCK, kv_cache_bytes=1 << 20)
        _BLOCK_BYTES[path] = probe.stats()["kv_bytes"] // probe.stats()["kv_blocks"]
    return blocks * _BLOCK_BYTES[path]
