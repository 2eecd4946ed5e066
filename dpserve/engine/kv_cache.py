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
from dataclasses import dataclass
from typing import Final

import torch

from dpserve.engine.defaults import DEFAULT_BLOCK_SIZE

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
    """Free-list allocator of block ids ``1 .. num_blocks - 1`` (block 0 is reserved)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= RESERVED_BLOCKS:
            raise ValueError(f"a pool needs more than {RESERVED_BLOCKS} block(s), got {num_blocks}")
        self.num_blocks = num_blocks
        # Popped from the end: the lowest ids go out first, which keeps early blocks warm.
        self._free: list[int] = list(range(num_blocks - 1, RESERVED_BLOCKS - 1, -1))
        self._allocated: set[int] = set()

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` block ids; raises ``MemoryError`` (nothing taken) when fewer are free."""
        if count > len(self._free):
            raise MemoryError(f"{count} blocks wanted, {len(self._free)} free")
        if count <= 0:
            return []
        taken = self._free[-count:]
        del self._free[-count:]
        self._allocated.update(taken)
        return taken

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._allocated:
                raise ValueError(f"block {block} is not allocated (double free?)")
            self._allocated.remove(block)
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """The per-layer key/value tensors of the pool and its allocator."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.block_size = shape.block_size
        self.pool = BlockPool(num_blocks)
        size = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # A layer's keys and values are one tensor, so a step writes (and the CPU decode path
        # gathers) both with one operation; each half is still a contiguous cache of its own.
        self.kv = [
            torch.zeros((2, *size), dtype=shape.dtype, device=device)
            for _ in range(shape.num_layers)
        ]
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
