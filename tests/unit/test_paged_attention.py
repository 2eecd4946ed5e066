"""Attention over the paged KV cache: the reference equals dense attention on random block
tables (ragged lengths, lengths on and around block boundaries, grouped-query heads), and the
batched torch version and the prefill paths (chunk by chunk, and every chunk of a step in one
call) equal the reference."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from dpserve.engine.layers.attention import (
    paged_decode_attention,
    paged_decode_attention_gathered,
    paged_decode_attention_reference,
    prefill_attention,
    prefill_layout,
    varlen_prefill_attention,
)

BLOCK_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def scatter_into_pool(
    sequences: list[tuple[torch.Tensor, torch.Tensor]], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put each (keys, values) ``[length, kv_heads, dim]`` into randomly chosen, shuffled blocks
    of a pool full of noise; returns (k_cache, v_cache, block_tables)."""
    rng = random.Random(seed)
    needed = [-(-len(keys) // BLOCK_SIZE) for keys, _ in sequences]
    num_blocks = sum(needed) + 5
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)  # noise everywhere
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    width = max(needed) + 2  # wider than any row needs: the rest is padding
    tables = torch.zeros(len(sequences), width, dtype=torch.int32)
    for row, (keys, values) in enumerate(sequences):
        blocks = [free.pop() for _ in range(needed[row])]
        tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for position in range(len(keys)):
            block, offset = blocks[position // BLOCK_SIZE], position % BLOCK_SIZE
            k_cache[block, offset] = keys[position]
            v_cache[block, offset] = values[position]
    return k_cache, v_cache, tables


def dense_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    group = HEADS // KV_HEADS
    q = query.unsqueeze(1)  # [heads, 1, dim]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, length, dim]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    return scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5).squeeze(1)


# Lengths on, just before and just after block boundaries, a single token, and long rows.
LENGTHS = [1, 3, 4, 5, 8, 9, 16, 17, 31, 64]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_equals_dense_attention_on_random_block_tables(seed: int) -> None:
    torch.manual_seed(seed)
    lengths = random.Random(seed).sample(LENGTHS, k=len(LENGTHS))
    sequences = [
        (torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)) for n in lengths
    ]
    k_cache, v_cache, tables = scatter_into_pool(sequences, seed)
    query = torch.randn(len(lengths), HEADS, HEAD_DIM)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    reference = paged_decode_attention_reference(query, k_cache, v_cache, tables, seq_lens, scale)
    for row, (keys, values) in enumerate(sequences):
        expected = dense_decode(query[row], keys, values)
        torch.testing.assert_close(reference[row], expected, rtol=1e-5, atol=1e-5)

    gathered = paged_decode_attention_gathered(query, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(gathered, reference, rtol=1e-5, atol=1e-5)
    # On CPU the dispatcher runs the batched torch version.
    dispatched = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(dispatched, gathered, rtol=0, atol=0)


def test_bfloat16_cache_matches_the_float32_reference_closely() -> None:
    torch.manual_seed(3)
    lengths = [7, 12, 33]
    sequences = [
        (torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)) for n in lengths
    ]
    k_cache, v_cache, tables = scatter_into_pool(sequences, 3)
    query = torch.randn(len(lengths), HEADS, HEAD_DIM)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    exact = paged_decode_attention_reference(query, k_cache, v_cache, tables, seq_lens, 0.25)
    low = paged_decode_attention_gathered(
        query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, seq_lens, 0.25
    )
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), exact, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(("cached", "length"), [(0, 9), (5, 1), (8, 4), (11, 6)])
def test_prefill_chunk_attends_to_cache_and_causally_to_itself(cached: int, length: int) -> None:
    torch.manual_seed(cached * 31 + length)
    total = cached + length
    queries = torch.randn(total, HEADS, HEAD_DIM)
    keys = torch.randn(total, KV_HEADS, HEAD_DIM)
    values = torch.randn(total, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    # The whole sequence at once, causal: the chunk's rows are its last `length` rows.
    full = prefill_attention(queries, keys, values, scale)
    chunk = prefill_attention(queries[cached:], keys, values, scale)
    torch.testing.assert_close(chunk, full[cached:], rtol=1e-5, atol=1e-5)
    # And each row equals decode attention over its prefix.
    for i in range(cached, total):
        expected = dense_decode(queries[i], keys[: i + 1], values[: i + 1])
        torch.testing.assert_close(chunk[i - cached], expected, rtol=1e-5, atol=1e-5)


# (cached, length) per chunk: uncached prompts, chunks after cached tokens, chunks ending on
# and just past block boundaries, a one-token chunk, chunks of very different lengths.
VARLEN_STEPS = [
    [(0, 9)],
    [(5, 1), (0, 3), (8, 4)],
    [(11, 6), (0, 16), (3, 13), (16, 1)],
]


@pytest.mark.parametrize("chunks", VARLEN_STEPS)
def test_varlen_prefill_equals_the_reference_chunk_by_chunk(chunks: list[tuple[int, int]]) -> None:
    """One padded SDPA call over every chunk of a step = ``prefill_attention`` per chunk."""
    seed = sum(cached * 7 + length for cached, length in chunks)
    torch.manual_seed(seed)
    sequences = [
        (torch.randn(c + n, KV_HEADS, HEAD_DIM), torch.randn(c + n, KV_HEADS, HEAD_DIM))
        for c, n in chunks
    ]
    k_cache, v_cache, tables = scatter_into_pool(sequences, seed)
    kv_pair = torch.stack((k_cache, v_cache))
    queries = [torch.randn(n, HEADS, HEAD_DIM) for _, n in chunks]
    offsets, slots, blocks = [], [], []
    for row, (cached, length) in enumerate(chunks):
        offsets.append(sum(n for _, n in chunks[:row]))
        table = tables[row]
        slots += [
            int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(cached, cached + length)
        ]
        blocks.append(table[: -(-(cached + length) // BLOCK_SIZE)].long() if cached else None)
    layout = prefill_layout(
        offsets=offsets,
        lengths=[n for _, n in chunks],
        cached=[c for c, _ in chunks],
        cached_blocks=blocks,
        slot_mapping=torch.tensor(slots),
        block_size=BLOCK_SIZE,
        group=HEADS // KV_HEADS,
        dtype=torch.float32,
    )
    scale = HEAD_DIM**-0.5
    out = varlen_prefill_attention(torch.cat(queries), kv_pair, layout, scale)
    assert out.shape == (sum(n for _, n in chunks), HEADS * HEAD_DIM)
    for row, (keys, values) in enumerate(sequences):
        expected = prefill_attention(queries[row], keys, values, scale)
        rows = out[offsets[row] : offsets[row] + chunks[row][1]].view(-1, HEADS, HEAD_DIM)
        torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)
