"""Which tokens each step computes: running decodes first, then chunks of prefill.

A sequence's *context* is its prompt plus the tokens generated so far; ``num_cached`` of them
have their keys and values in the paged cache. A sequence with exactly one uncached token is
*decoding* (that token is fed, the next one sampled); one with more is *prefilling*, and gets a
chunk of its uncached tokens. Every step:

1. every decoding sequence gets its token (oldest first), and a new block when its last one is
   full. When the pool has no free block, the newest running sequences are **preempted**: their
   blocks are freed and they go back to the front of the waiting queue with ``num_cached = 0``,
   to be recomputed later with their generated tokens as context. Nothing ever fails for lack
   of memory;
2. sequences part-way through their prefill continue, then waiting sequences are admitted
   (first come, first served), each with a chunk, until ``max_num_batched_tokens`` tokens are
   scheduled or ``max_num_seqs`` sequences run. A sequence is admitted only when the blocks for
   its whole context are free, and takes them at once, so a prefill never stalls half-way for
   memory; no sequence is admitted in a step that had to preempt.

Prefix caching (when the pool has it on): at admission the longest run of the context's full
blocks whose hashes the pool holds is shared instead of computed (``num_cached`` starts after
it), so the prefill begins there. At most ``context - 1`` tokens are taken from the cache: the
last one is always computed, for its logits. Hits are whole blocks, so a sequence only ever
writes into blocks of its own. When a step's tokens are committed, every block they filled gets
its hash and becomes findable. A preempted sequence keeps its hashes: readmitted, it finds its
own blocks again unless they were evicted meanwhile.

Decodes are never held back by the token budget (a step with more running sequences than the
budget still decodes all of them); prefill then waits for the next step. So inter-token latency
stays one step, and a burst of long prompts is spread over steps of bounded size.

The scheduler only moves block ids around; the runner builds the tensors (``batch``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from dpserve.block_hash import ROOT_HASH, BlockHash, block_hashes, hash_block
from dpserve.engine.paged.block_pool import BlockPool


class PagedSequence(Protocol):
    """What the scheduler needs of a sequence (the runner's sequences provide it)."""

    blocks: list[int]  # the block table: token t lives in blocks[t // block_size]
    num_cached: int  # context tokens whose keys and values are in the cache
    # Prefix caching: the hashes of the context's full blocks computed so far, the extra keys
    # (``block_hash.extra_keys``) they mix in, and how many context tokens the first
    # admission found in the cache (None until admitted).
    block_hashes: list[BlockHash]
    cache_extra: bytes
    cached_prompt_tokens: int | None
    # Context tokens sampled on the device and not on the host yet (overlap): counted in
    # ``context_length`` but neither hashable nor readable.
    pending: int

    def context_length(self) -> int: ...

    def tokens_between(self, start: int, end: int) -> list[int]: ...

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Logits are due at every prompt position: the sequence computes its whole prompt
        and takes no cached prefix blocks."""


# The runner's own sequence type: plans hand back the objects the runner added.
S = TypeVar("S", bound=PagedSequence)


@dataclass(slots=True)
class PrefillChunk(Generic[S]):
    sequence: S
    start: int  # first context position of the chunk (tokens before it are cached)
    length: int

    @property
    def completes_prefill(self) -> bool:
        """True when the chunk ends the context: the step samples the next token."""
        return self.start + self.length == self.sequence.context_length()


@dataclass(slots=True)
class StepPlan(Generic[S]):
    decodes: list[S] = field(default_factory=list)
    prefills: list[PrefillChunk[S]] = field(default_factory=list)
    preempted: list[S] = field(default_factory=list)
    # Decodes that got a new block this step: with the prefills, the only sequences whose
    # block tables changed (the batch builder appends only theirs).
    grown: list[S] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(chunk.length for chunk in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler(Generic[S]):
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[S] = deque()
        self.running: list[S] = []  # in admission order: the newest last
        self.preemptions = 0
        # Context tokens looked up in the prefix cache at admission, and those found.
        self.prefix_queries = 0
        self.prefix_hits = 0

    def add(self, sequence: S) -> None:
        self.waiting.append(sequence)
        if self.pool.enable_caching:
            # Its cached prefix is what the coordinator sent it here for: keep those blocks
            # from being the next evicted while it waits (requests admitted meanwhile may
            # need room), or a routed hit turns into a miss that evicts in its turn.
            self.pool.refresh(self._prefix_hit(sequence))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, sequence: S) -> bool:
        """Forget a sequence (finished or cancelled) and free its blocks; False if unknown."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        elif sequence in self.running:
            self.running.remove(sequence)
        else:
            return False
        self._free_blocks(sequence)
        return True

    def preempt_all(self) -> None:
        """Every running sequence back to the front of the queue (oldest first), blocks freed."""
        while self.running:
            self._preempt(self.running[-1])

    # ------------------------------------------------------------------------- scheduling

    def schedule(self) -> StepPlan[S]:
        plan: StepPlan[S] = StepPlan()
        decodes = plan.decodes
        block_size = self.block_size
        preempted = plan.preempted
        for sequence in list(self.running):
            if preempted and sequence in preempted:  # made room for an older one
                continue
            cached = sequence.num_cached
            if sequence.context_length() - cached != 1:
                continue
            # A new block only when the fed token starts one (every block_size tokens).
            if cached < len(sequence.blocks) * block_size:
                decodes.append(sequence)
            elif self._reserve(sequence, plan):
                decodes.append(sequence)
                plan.grown.append(sequence)
        budget = self.max_num_batched_tokens - len(plan.decodes)
        for sequence in self.running if len(decodes) < len(self.running) else ():
            remaining = sequence.context_length() - sequence.num_cached
            if remaining > 1 and budget > 0:
                chunk = PrefillChunk(sequence, sequence.num_cached, min(remaining, budget))
                plan.prefills.append(chunk)
                budget -= chunk.length
        while budget > 0 and self.waiting and not plan.preempted:
            if len(self.running) >= self.max_num_seqs or not self._admit(self.waiting[0]):
                break
            sequence = self.waiting.popleft()
            remaining = sequence.context_length() - sequence.num_cached
            chunk = PrefillChunk(sequence, sequence.num_cached, min(remaining, budget))
            plan.prefills.append(chunk)
            budget -= chunk.length
        return plan

    def commit(self, plan: StepPlan[S]) -> None:
        """The step's forward ran: its tokens are in the cache now, and the blocks they
        filled can be found by their hashes."""
        block_size = self.block_size
        caching = self.pool.enable_caching
        if caching:
            for sequence in plan.decodes:
                sequence.num_cached = cached = sequence.num_cached + 1
                # A block is hashed once its last token is cached and known on the host: at
                # once without overlap (its fed token filled it), a step later with it (the
                # token was still on the device).
                if not cached % block_size or sequence.pending:
                    # A decoding sequence's hashes are those of the blocks the pool has (its
                    # prompt's were given at prefill).
                    self._cache_filled_blocks(sequence, len(sequence.block_hashes))
        else:
            for sequence in plan.decodes:
                sequence.num_cached += 1
        for chunk in plan.prefills:
            chunk.sequence.num_cached = chunk.start + chunk.length
            if caching:
                self._cache_filled_blocks(chunk.sequence, chunk.start // block_size)

    # ---------------------------------------------------------------------------- blocks

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _admit(self, sequence: S) -> bool:
        pool, length = self.pool, sequence.context_length()
        hit = self._prefix_hit(sequence) if pool.enable_caching else []
        needed = self._blocks_for(length) - len(hit)
        # A hit on an evictable block takes it out of the free count too.
        if needed + sum(1 for block in hit if pool.ref_counts[block] == 0) > pool.free_blocks:
            return False
        pool.touch(hit)
        sequence.blocks = hit + pool.allocate(needed)
        sequence.num_cached = len(hit) * self.block_size
        if pool.enable_caching:
            self.prefix_queries += length
            self.prefix_hits += sequence.num_cached
        if sequence.cached_prompt_tokens is None:
            sequence.cached_prompt_tokens = sequence.num_cached
        self.running.append(sequence)
        return True

    def _prefix_hit(self, sequence: S) -> list[int]:
        """The cached blocks the sequence's context starts with (not shared yet)."""
        # A sequence that wants its prompt's log-probs needs logits at every prompt position,
        # so it computes its whole prompt (its blocks are still stored for others).
        if sequence.wants_prompt_logprobs:
            return []
        # Whole blocks only, and never the last token: its logits are needed.
        # Tokens still on the device (overlap) cannot be hashed yet.
        length = sequence.context_length()
        known = length - sequence.pending
        usable = min(length - 1, known) // self.block_size
        return self.pool.lookup(self._hashes(sequence, usable)[:usable])

    def _hashes(self, sequence: S, full_blocks: int) -> list[BlockHash]:
        """The sequence's block hashes, computed up to ``full_blocks`` blocks."""
        hashes = sequence.block_hashes
        done = len(hashes)
        if done < full_blocks:
            size = self.block_size
            tokens = sequence.tokens_between(done * size, full_blocks * size)
            parent = hashes[-1] if hashes else ROOT_HASH
            if done + 1 == full_blocks:  # a decode filled one block: hash it directly
                hashes.append(hash_block(parent, tokens, sequence.cache_extra))
            else:
                hashes += block_hashes(tokens, size, sequence.cache_extra, parent=parent)
        return hashes

    def _cache_filled_blocks(self, sequence: S, first: int) -> None:
        """Hash the sequence's full blocks from block ``first`` on whose tokens are cached and
        known on the host, and give them to the pool."""
        known = sequence.context_length() - sequence.pending
        full = min(sequence.num_cached, known) // self.block_size
        if full <= first:
            return
        hashes = self._hashes(sequence, full)
        for index in range(first, full):
            parent = hashes[index - 1] if index else ROOT_HASH
            self.pool.cache_full_block(sequence.blocks[index], hashes[index], parent)

    def _reserve(self, sequence: S, plan: StepPlan[S]) -> bool:
        """Room for the sequence's next token, preempting the newest sequences if the pool is
        dry; False when the sequence itself had to go."""
        needed = self._blocks_for(sequence.num_cached + 1) - len(sequence.blocks)
        while needed > self.pool.free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is sequence:
                return False
        sequence.blocks.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, sequence: S) -> None:
        if self.running[-1] is sequence:
            self.running.pop()
        else:
            self.running.remove(sequence)
        self._free_blocks(sequence)
        self.waiting.appendleft(sequence)
        self.preemptions += 1

    def _free_blocks(self, sequence: S) -> None:
        self.pool.free(sequence.blocks)
        sequence.blocks = []
        sequence.num_cached = 0
