"""The paged KV cache's tensors: one pool of fixed-size blocks per layer, allocated once, and
their sizing.

Every layer has a key and a value tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``
(the layout ``layers.attention`` documents). Sequences own blocks through their block tables
(``paged.block_pool.BlockPool`` hands out ids); nothing is reallocated or concatenated while
serving: new keys and values are written in place through a slot mapping
(``block * block_size + offset``). Block 0 is never handed out (``defaults.RESERVED_BLOCKS``).
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass
from typing import Final

import torch

from dpserve.engine.defaults import DEFAULT_BLOCK_SIZE, RESERVED_BLOCKS

log = logging.getLogger(__name__)

# CUDA memory kept free beyond the activation estimate: allocator fragmentation, cuBLAS
# workspaces, CUDA graph pools.
_CUDA_FIXED_HEADROOM_BYTES: Final = 512 * 1024**2


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
    """The per-layer key/value tensors of the pool (which blocks are free and cached is
    ``paged.block_pool.BlockPool``'s business)."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.block_size = shape.block_size
        self.num_blocks = num_blocks
        size = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # A layer's keys and values are one tensor, so a step writes (and the CPU decode path
        # gathers) both with one operation; each half is still a contiguous cache of its own.
        self.kv = [_zeroed((2, *size), shape.dtype, device) for _ in range(shape.num_layers)]
        self.keys = [pair[0] for pair in self.kv]
        self.values = [pair[1] for pair in self.kv]

    @property
    def token_capacity(self) -> int:
        """Tokens the usable blocks hold (block 0 excluded)."""
        return (self.num_blocks - RESERVED_BLOCKS) * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    def describe(self) -> dict[str, int]:
        return {
            "kv_blocks": self.num_blocks,
            "kv_block_size": self.block_size,
            "kv_bytes": self.nbytes,
            "kv_tokens": self.token_capacity,
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
