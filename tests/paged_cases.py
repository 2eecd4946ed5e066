"""Random paged-KV inputs for the decode-attention tests (CPU interpreter and GPU alike).

Block 0 and every block no sequence owns are filled with NaN: a kernel that reads a padding
entry of a block table, or a token past a sequence's end, returns NaN and fails the comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCase:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float

    def to(self, device: str) -> PagedCase:
        return PagedCase(
            self.query.to(device),
            self.k_cache.to(device),
            self.v_cache.to(device),
            self.block_tables.to(device),
            self.seq_lens.to(device),
            self.scale,
        )

    def args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.scale,
        )


def make_paged_case(
    lengths: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedCase:
    """Sequences of ``lengths`` tokens scattered over a shuffled pool; each block-table row has
    ``spare_blocks`` padding entries past the longest sequence, pointing at block 0."""
    generator = torch.Generator().manual_seed(seed)
    needed = [math.ceil(length / block_size) for length in lengths]
    width = max(needed, default=0) + spare_blocks
    num_blocks = 1 + sum(needed) + spare_blocks  # block 0 and a few nobody owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    owned = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: sum(needed)].tolist()
    block_tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for row, count in enumerate(needed):
        blocks, owned = owned[:count], owned[count:]
        block_tables[row, :count] = torch.tensor(blocks, dtype=torch.int32)
        for index, block in enumerate(blocks):
            # Only the slots below the sequence's length hold data; the rest stay NaN.
            filled = min(block_size, lengths[row] - index * block_size)
            k_cache[block, :filled] = torch.randn(
                filled, num_kv_heads, head_dim, generator=generator
            )
            v_cache[block, :filled] = torch.randn(
                filled, num_kv_heads, head_dim, generator=generator
            )
    query = torch.randn(len(lengths), num_heads, head_dim, generator=generator)
    return PagedCase(
        query.to(dtype),
        k_cache.to(dtype),
        v_cache.to(dtype),
        block_tables,
        torch.tensor(lengths, dtype=torch.int32),
        head_dim**-0.5,
    )


def random_lengths(count: int, block_size: int, longest: int, seed: int) -> list[int]:
    """Ragged lengths that always include the block-boundary cases (1, a block minus one, a
    block, a block plus one) and random ones up to ``longest``."""
    generator = torch.Generator().manual_seed(seed)
    boundary = [1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size]
    extra = torch.randint(1, longest + 1, (max(0, count - len(boundary)),), generator=generator)
    return (boundary + extra.tolist())[:count] if count >= len(boundary) else boundary[:count]
