"""The paged KV cache: one pool of fixed-size blocks, allocated once, and its sizing.

Every layer has a key and a value tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``
(the layout ``paged_attention`` documents). Sequences own blocks through their block tables
(``BlockPool`` hands out ids); nothing is reallocated or concatenated while serving: new keys
and values are written in place through a slot mapping (``block * block_size + offset``).

Block 0 is never handed out, so padding entries of a block table, and the slots that padded
rows of a CUDA graph write to, may point at it harmlessly.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Final

import torch

from dpserve.block_hash import BlockHash
from dpserve.engine.defaults import DEFAULT_BLOCK_SIZE
from dpserve.engine.kv_events import KVEvent, KVEventKind

log = logging.getLogger(__name__)

# CUDA memory kept free beyond the activation estimate: allocator fragmentation, cuBLAS
# workspaces, CUDA graph pools.
_CUDA_FIXED_HEADROOM_BYTES: Final = 512 * 1024**2
RESERVED_BLOCKS: Final = 1  # block 0


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """What one token costs in the cache, and how tokens are grouped into blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


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


def _zeroed(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor for the pool. Every block must start as zeros, not garbage: a step reads
    whole blocks and masks the slots past a row's length, and a NaN there would still poison
    the row (0 x NaN). On the CPU the memory is an anonymous mapping, which the kernel zeroes
    page by page on first touch: ``torch.zeros`` wrote all of it at start (0.8-2.2 s for the
    default 1 GiB pool on this 2-core machine, on every engine start and scale-up) and made it
    resident before any request used it."""
    if device.type != "cpu":
        return torch.zeros(size, dtype=dtype, device=device)
    count = math.prod(size)
    mapping = mmap.mmap(-1, count * dtype.itemsize)
    # The tensor keeps the mapping alive (``frombuffer`` holds a reference to it).
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(size)


class PagedKVCache:
    """The per-layer key/value tensors of the pool and its allocator."""

    def __init__(
        self,
        shape: KVCacheShape,
        num_blocks: int,
        device: torch.device,
        *,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.shape = shape
        self.block_size = shape.block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        size = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # A layer's keys and values are one tensor, so a step writes (and the CPU decode path
        # gathers) both with one operation; each half is still a contiguous cache of its own.
        self.kv = [_zeroed((2, *size), shape.dtype, device) for _ in range(shape.num_layers)]
        self.keys = [pair[0] for pair in self.kv]
        self.values = [pair[1] for pair in self.kv]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def token_capacity(self) -> int:
        """Tokens the usable blocks hold (block 0 excluded)."""
        return self.pool.usable_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    def describe(self) -> dict[str, int]:
        return {
            "kv_blocks": self.num_blocks,
            "kv_block_size": self.block_size,
            "kv_bytes": self.nbytes,
            "kv_tokens": self.token_capacity,
            "kv_free_blocks": self.pool.free_blocks,
        }


def cuda_kv_budget_bytes(
    device: torch.device, gpu_memory_utilization: float, activation_bytes: int
) -> int:
    """Bytes the pool may take on a CUDA device: the allowed share of the device minus what
    is already allocated (weights) and the activations a step may need; never more than is
    free now (other processes may hold memory)."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    # Memory freed while loading (the unfused weights) sits in torch's cache, not counted free.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    allowed = int(total * gpu_memory_utilization) - torch.cuda.memory_allocated(device)
    headroom = activation_bytes + _CUDA_FIXED_HEADROOM_BYTES
    return min(allowed, free) - headroom


def num_blocks_for_budget(shape: KVCacheShape, budget_bytes: int) -> int:
    """Blocks (block 0 included) that fit in ``budget_bytes``; raises when not even one usable
    block fits, with the numbers that explain why."""
    blocks = budget_bytes // shape.bytes_per_block
    if blocks <= RESERVED_BLOCKS:
        raise ValueError(
            f"the KV cache budget of {max(budget_bytes, 0)} bytes holds no usable block of "
            f"{shape.bytes_per_block} bytes ({shape.block_size} tokens); raise "
            "--gpu-memory-utilization / --kv-cache-bytes or use a smaller model"
        )
    return int(blocks)
