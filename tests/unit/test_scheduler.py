"""The block pool and the scheduler without a model: budgets, admission by free blocks,
preemption of the newest sequences, and no block ever leaked or shared."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from dpserve.engine.paged.block_pool import BlockPool
from dpserve.engine.paged.scheduler import Scheduler, StepPlan

BLOCK_SIZE = 4


@dataclass(eq=False)
class FakeSequence:
    prompt: int
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    block_hashes: list[int] = field(default_factory=list)
    cache_extra: bytes = b""
    cached_prompt_tokens: int | None = None
    pending: int = 0
    wants_prompt_logprobs: bool = False

    def context_length(self) -> int:
        return self.prompt + self.generated

    def tokens_between(self, start: int, end: int) -> list[int]:
        return list(range(start, end))


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def make(num_blocks: int, *, seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(
        # Without prefix caching: these tests are about blocks never being shared.
        BlockPool(num_blocks, enable_caching=False),
        BLOCK_SIZE,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
    )


def sampled(plan: StepPlan) -> list[FakeSequence]:
    chunks = [c.sequence for c in plan.prefills if c.completes_prefill]
    return [*plan.decodes, *chunks]  # type: ignore[list-item]


def test_pool_hands_out_each_block_once_and_refuses_double_free() -> None:
    pool = BlockPool(6)
    taken = pool.allocate(5)
    assert sorted(taken) == [1, 2, 3, 4, 5] and pool.free_blocks == 0  # block 0 is reserved
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(taken[:2])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(taken[:1])
    assert pool.free_blocks == 2


def test_decodes_run_first_and_prefill_is_chunked_under_the_budget() -> None:
    scheduler = make(64, budget=10)
    first, second = FakeSequence(prompt=3), FakeSequence(prompt=25)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    # First: whole 3-token prompt; second: the 7 tokens left in the budget.
    assert [(c.start, c.length) for c in plan.prefills] == [(0, 3), (0, 7)]
    assert sampled(plan) == [first]
    scheduler.commit(plan)
    first.generated += 1
    plan = scheduler.schedule()
    assert plan.decodes == [first]
    assert [(c.start, c.length) for c in plan.prefills] == [(7, 9)]  # 10 - 1 decode
    # Blocks for a whole prompt are taken at admission: a prefill never waits for memory.
    assert len(second.blocks) == blocks_for(25)


def test_admission_waits_for_free_blocks() -> None:
    scheduler = make(1 + 6)  # 6 usable blocks = 24 tokens
    big, small = FakeSequence(prompt=20), FakeSequence(prompt=9)
    scheduler.add(big)
    scheduler.add(small)
    plan = scheduler.schedule()
    assert [c.sequence for c in plan.prefills] == [big]  # small needs 3 blocks, 1 is free
    assert list(scheduler.waiting) == [small]
    scheduler.commit(plan)
    scheduler.remove(big)
    assert scheduler.schedule().prefills[0].sequence is small


def test_pool_running_dry_preempts_the_newest_sequence() -> None:
    scheduler = make(1 + 4)  # 16 tokens
    old, new = FakeSequence(prompt=8), FakeSequence(prompt=8)
    scheduler.add(old)
    scheduler.add(new)
    plan = scheduler.schedule()
    scheduler.commit(plan)
    old.generated = new.generated = 1  # both sampled a token; the pool is full
    plan = scheduler.schedule()
    # old's 9th token needs a block: new (the newest) gives back its blocks and waits, first.
    assert plan.decodes == [old] and plan.preempted == [new]
    assert new.blocks == [] and new.num_cached == 0
    assert list(scheduler.waiting) == [new] and scheduler.running == [old]
    assert scheduler.preemptions == 1
    assert not plan.prefills  # nothing is admitted in a step that had to preempt


def test_random_operations_never_leak_or_share_a_block() -> None:
    rng = random.Random(10)
    num_blocks, max_context = 41, 64  # 160 usable tokens: several sequences fit, not many
    scheduler = make(num_blocks, seqs=6, budget=24)
    live: list[FakeSequence] = []
    for _ in range(10_000):
        operation = rng.random()
        if operation < 0.25:
            sequence = FakeSequence(prompt=rng.randint(1, 40))
            scheduler.add(sequence)
            live.append(sequence)
        elif operation < 0.35 and live:  # cancel, waiting or running
            victim = live.pop(rng.randrange(len(live)))
            assert scheduler.remove(victim)
        else:
            plan = scheduler.schedule()
            assert plan.num_tokens <= max(24, len(plan.decodes))
            assert len(scheduler.running) <= 6
            scheduler.commit(plan)
            for sequence in sampled(plan):
                if rng.random() < 0.05 or sequence.context_length() >= max_context:
                    live.remove(sequence)
                    assert scheduler.remove(sequence)
                else:
                    sequence.generated += 1
        assert_consistent(scheduler, live, num_blocks)
    assert scheduler.preemptions > 0  # the pool really ran dry along the way
    for sequence in live:
        assert scheduler.remove(sequence)
    assert scheduler.pool.free_blocks == num_blocks - 1
    assert not scheduler.has_work()


def assert_consistent(scheduler: Scheduler, live: list[FakeSequence], num_blocks: int) -> None:
    held = [block for sequence in scheduler.running for block in sequence.blocks]
    assert len(held) == len(set(held)), "a block is in two block tables"
    assert 0 not in held
    assert len(held) + scheduler.pool.free_blocks == num_blocks - 1, "a block leaked"
    assert all(not s.blocks and s.num_cached == 0 for s in scheduler.waiting)
    for sequence in scheduler.running:
        assert len(sequence.blocks) * BLOCK_SIZE >= sequence.num_cached
    assert {id(s) for s in live} == {id(s) for s in [*scheduler.waiting, *scheduler.running]}
