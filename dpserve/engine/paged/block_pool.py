"""The paged KV cache's allocator: reference-counted block ids with automatic prefix caching.

Host-side bookkeeping only (no tensors, no torch): which blocks each sequence's block table
holds, which full blocks are cached by their prefix hash, and the events that tell the
coordinator what changed. The tensors the ids index are ``layers.kv_cache.PagedKVCache``.
Block 0 is never handed out (``RESERVED_BLOCKS``), so padding entries of a block table may point
at it harmlessly.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from dpserve.block_hash import BlockHash
from dpserve.engine.defaults import RESERVED_BLOCKS
from dpserve.engine.kv_events import KVEvent, KVEventKind


class BlockPool:
    """Reference-counted block ids ``1 .. num_blocks - 1`` (block 0 is reserved), with
    automatic prefix caching.

    A block is *held* while some block table holds it (its reference count), else *free*. A
    full block can be given a hash (``cache_full_block``); then ``lookup`` finds it by that
    hash and ``touch`` shares it. A freed block keeps its content and hash, in an LRU of
    evictable blocks, until the pool needs a block and nothing never-hashed is free: only then
    is its hash forgotten (a REMOVED event). With ``enable_caching`` False nothing is hashed,
    and the pool is a plain free list.

    Every change of which hashes the pool holds is appended to ``events`` (the engine sends
    them to the coordinator and empties the list).
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks <= RESERVED_BLOCKS:
            raise ValueError(f"a pool needs more than {RESERVED_BLOCKS} block(s), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> the block holding that prefix
        # Free blocks with no hash, popped from the end: the lowest ids go out first.
        self._empty: list[int] = list(range(num_blocks - 1, RESERVED_BLOCKS - 1, -1))
        # Free blocks with a hash, least recently freed first: evicted from the front.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.events: list[KVEvent] = []
        self.evictions = 0

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    @property
    def free_blocks(self) -> int:
        """Blocks an ``allocate`` can hand out (never-hashed ones and evictable ones)."""
        return len(self._empty) + len(self._evictable)

    @property
    def empty_blocks(self) -> int:
        """Free blocks that hold no cached content: what can be allocated without evicting."""
        return len(self._empty)

    @property
    def held_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self.cached)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh block ids (no hash, reference count 1); raises ``MemoryError``
        (nothing taken) when fewer are free. Never-hashed blocks go first, then the least
        recently freed cached ones, whose hashes are forgotten."""
        if count > self.free_blocks:
            raise MemoryError(f"{count} blocks wanted, {self.free_blocks} free")
        taken: list[int] = []
        while len(taken) < count and self._empty:
            taken.append(self._empty.pop())
        while len(taken) < count:
            block, _ = self._evictable.popitem(last=False)
            self._forget_hash(block)
            taken.append(block)
        for block in taken:
            self.ref_counts[block] = 1
        return taken

    def touch(self, blocks: list[int]) -> None:
        """Share cached blocks (a prefix hit): one more reference each."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def refresh(self, blocks: list[int]) -> None:
        """Make these cached blocks (a prefix, in order) the most recently freed, so that they
        are evicted after every other free block, the prefix's first block last. Held blocks
        are not evictable and stay as they are."""
        evictable = self._evictable
        for block in reversed(blocks):
            if block in evictable:
                evictable.move_to_end(block)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Pass a block table in order: its tail is made
        evictable first, so a prefix's first blocks (shared most) are evicted last."""
        for block, count in Counter(blocks).items():
            if self.ref_counts[block] < count:
                raise ValueError(f"block {block} is not allocated (double free?)")
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self._empty.append(block)
                else:
                    self._evictable[block] = None

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes`` (not yet shared: ``touch``)."""
        found = []
        cached = self.cached
        for block_hash in hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def cache_full_block(self, block: int, block_hash: BlockHash, parent: BlockHash) -> None:
        """Give a full, held block its hash. A block that already has one keeps it; a hash
        another block already holds (the same prefix computed twice at once) is not taken:
        this block then stays uncached and is freed as such."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        last = self.events[-1] if self.events else None
        if last is not None and last.kind is KVEventKind.STORED and last.hashes[-1] == parent:
            last.hashes.append(block_hash)  # the chain goes on: one event
        else:
            self.events.append(KVEvent(KVEventKind.STORED, [block_hash], parent))

    def clear_cache(self) -> None:
        """Forget every hash (the pool's memory is being released or reset). Held blocks keep
        their content but are no longer found by ``lookup``."""
        for block in self.cached.values():
            self.block_hash[block] = None
        self.cached.clear()
        self._empty.extend(reversed(self._evictable))
        self._evictable.clear()
        self.events.append(KVEvent(KVEventKind.CLEARED))

    def snapshot(self) -> list[BlockHash]:
        """Every hash the pool holds (a full report for the coordinator)."""
        return list(self.cached)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _forget_hash(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is None:
            return
        self.block_hash[block] = None
        del self.cached[block_hash]
        self.evictions += 1
        last = self.events[-1] if self.events else None
        if last is not None and last.kind is KVEventKind.REMOVED:
            last.hashes.append(block_hash)
        else:
            self.events.append(KVEvent(KVEventKind.REMOVED, [block_hash]))

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        """Raise ``AssertionError`` unless the pool agrees with the block tables holding its
        blocks (tests call this after every operation)."""
        holders = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                holders[block] += 1
        empty, evictable = set(self._empty), set(self._evictable)
        if len(empty) != len(self._empty) or empty & evictable:
            raise AssertionError("a free block is listed twice")
        for block in range(RESERVED_BLOCKS, self.num_blocks):
            free = block in empty or block in evictable
            if self.ref_counts[block] != holders[block]:
                raise AssertionError(
                    f"block {block}: reference count {self.ref_counts[block]}, held by "
                    f"{holders[block]} table(s)"
                )
            if free == (holders[block] > 0):
                raise AssertionError(f"block {block}: free={free} but held by {holders[block]}")
            if (block in evictable) != (free and self.block_hash[block] is not None):
                raise AssertionError(f"block {block}: in the wrong free list")
        if holders[0] or 0 in empty or 0 in evictable:
            raise AssertionError("the reserved block 0 was handed out")
        for block_hash, block in self.cached.items():
            if self.block_hash[block] != block_hash:
                raise AssertionError(f"block {block}: hash map and block disagree")
        if sum(h is not None for h in self.block_hash) != len(self.cached):
            raise AssertionError("a block has a hash the map does not know")
