"""Prefill attention over the paged cache as one Triton ("flash") kernel for a whole step.

A step's prefill chunks (``PrefillSlice``) are packed one after another: chunk ``c``'s query
rows are ``query_starts[c] .. query_starts[c + 1]`` of the step's prefill rows, and its context
is the ``cached`` tokens of its sequence already in the pool followed by the chunk's own
tokens (their keys and values written before attention runs), ``context_slots[context_starts[c]
.. context_starts[c + 1]]`` in order. Query row ``i`` of a chunk sees context tokens ``<=
cached + i``.

One program per (tile of a chunk's query rows, KV head, chunk): the query heads that share the
KV head ride together in the tile's rows (grouped-query attention: K and V are read once per
group, never repeated), keys and values are read straight from the pool through the slot list
(no gather into a padded copy, no mask tensor), and the softmax runs online in fp32. Tiles past
a chunk's rows exit at once, so the grid is sized by the longest chunk only.

The torch version (``layers.attention.varlen_prefill_attention``: one gather of every chunk's
context, padded, and one SDPA call with a mask) runs on CPU and is what this kernel is tested
against. On an H100 (issue 16) that gather alone took 0.4-0.8 ms per layer of a 8,192-token
step, and SDPA with a mask falls back to its memory-efficient kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from dpserve.engine.kernels import triton_layer_ops

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without Triton
    triton = None
    tl = None

_MIN_DOT_DIM = 16  # tl.dot needs every dimension >= 16


@dataclass(frozen=True)
class PrefillLaunch:
    rows: int  # query rows x grouped heads per tile (a power of two, >= 16)
    tokens: int  # context tokens per inner tile
    num_warps: int = 4
    num_stages: int = 2


# The fastest of bench/prefill_attention.py's launches on an H100 (BENCHMARKS.md): for heads of
# 64 dimensions 128 rows in 8 warps; for 128 dimensions the tiles' registers favour 64 rows.
GPU_LAUNCH = PrefillLaunch(rows=128, tokens=64, num_warps=8, num_stages=2)
GPU_LAUNCH_WIDE_HEADS = PrefillLaunch(rows=64, tokens=64, num_warps=4, num_stages=2)
INTERPRETER_LAUNCH = PrefillLaunch(rows=16, tokens=16)


def default_launch(head_dim: int, interpret: bool) -> PrefillLaunch:
    if interpret:
        return INTERPRETER_LAUNCH
    return GPU_LAUNCH if head_dim <= 64 else GPU_LAUNCH_WIDE_HEADS


@dataclass(frozen=True, slots=True)
class VarlenPrefillLayout:
    """A step's prefill chunks for ``varlen_prefill_attention_triton`` (module docstring)."""

    query_starts: torch.Tensor  # [chunks + 1] int32
    context_starts: torch.Tensor  # [chunks + 1] int32
    context_slots: torch.Tensor  # [sum of contexts] int64
    chunks: int
    max_length: int  # the longest chunk's query rows


# Triton reads a kernel's annotations as compile-time meaning: pointers and strides stay bare.
def _prefill_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    query_starts_ptr,
    context_starts_ptr,
    out_ptr,
    scale_log2,
    query_stride_token,
    query_stride_head,
    cache_stride_slot,
    out_stride_token,
    out_stride_head,
    GROUP: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROWS_PER_TILE: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + chunk)
    length = tl.load(query_starts_ptr + chunk + 1) - query_start
    first_row = tile * ROWS_PER_TILE
    if first_row >= length:
        return
    context_start = tl.load(context_starts_ptr + chunk)
    context = tl.load(context_starts_ptr + chunk + 1) - context_start
    cached = context - length

    # Tile row r is query row first_row + r // BLOCK_GROUP of the chunk, head r % BLOCK_GROUP of
    # the KV head's group.
    tile_rows = tl.arange(0, BLOCK_ROWS)
    rows = first_row + tile_rows // BLOCK_GROUP
    heads = kv_head * GROUP + tile_rows % BLOCK_GROUP
    row_mask = (rows < length) & (tile_rows % BLOCK_GROUP < GROUP)
    dims = tl.arange(0, BLOCK_DIM)
    dim_mask = dims < HEAD_DIM
    tokens_of_rows = (query_start + rows).to(tl.int64)
    query = tl.load(
        query_ptr
        + tokens_of_rows[:, None] * query_stride_token
        + heads[:, None] * query_stride_head
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    last_seen = cached + rows  # the last context token each row sees (causal)
    running_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_DIM], tl.float32)
    end = tl.minimum(context, cached + first_row + ROWS_PER_TILE)
    slot_list = slots_ptr + context_start
    for tile_start in range(0, end, BLOCK_TOKENS):
        tokens = tile_start + tl.arange(0, BLOCK_TOKENS)
        token_mask = tokens < end
        slots = tl.load(slot_list + tokens, mask=token_mask, other=0)
        where = slots * cache_stride_slot + kv_head * HEAD_DIM
        load_mask = token_mask[:, None] & dim_mask[None, :]
        keys = tl.load(k_cache_ptr + where[:, None] + dims[None, :], mask=load_mask, other=0.0)
        scores = tl.dot(query.to(keys.dtype), tl.trans(keys), input_precision=DOT_PRECISION)
        visible = (tokens[None, :] <= last_seen[:, None]) & token_mask[None, :]
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # Rows past the chunk's end see nothing in a tile: keep their sums at 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(running_max - safe_max)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        values = tl.load(v_cache_ptr + where[:, None] + dims[None, :], mask=load_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(
            weights.to(values.dtype), values, input_precision=DOT_PRECISION
        )
        running_max = new_max
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr
        + tokens_of_rows[:, None] * out_stride_token
        + heads[:, None] * out_stride_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


@functools.cache
def _kernel(interpret: bool) -> Any:
    del interpret  # see triton_layer_ops._kernels: decorated under the caller's environment
    # The slot list is a view of the step's slot mapping at any offset, and the starts are
    # tiny: one compiled variant whatever their alignment.
    return triton.jit(
        _prefill_kernel,
        do_not_specialize_on_alignment=["slots_ptr", "query_starts_ptr", "context_starts_ptr"],
    )


def varlen_layout(
    lengths: list[int],
    cached: list[int],
    cached_blocks: list[torch.Tensor | None],
    slot_mapping: torch.Tensor,
    block_size: int,
) -> VarlenPrefillLayout:
    """The layout of chunks of ``lengths`` query rows, in order, each after ``cached`` tokens
    held in ``cached_blocks`` (None when nothing is cached); ``slot_mapping`` is the slots of
    the chunks' own tokens (``[prefill tokens]``, in row order)."""
    device = slot_mapping.device
    pieces: list[torch.Tensor] = []
    within_block = torch.arange(block_size, device=device)
    offset = 0
    for length, done, blocks in zip(lengths, cached, cached_blocks, strict=True):
        if done:
            assert blocks is not None
            pieces.append((blocks.long().unsqueeze(1) * block_size + within_block).view(-1)[:done])
        pieces.append(slot_mapping[offset : offset + length])
        offset += length
    query_starts = [0]
    context_starts = [0]
    for length, done in zip(lengths, cached, strict=True):
        query_starts.append(query_starts[-1] + length)
        context_starts.append(context_starts[-1] + done + length)
    starts = torch.tensor([query_starts, context_starts], dtype=torch.int32).to(device)
    context_slots = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if context_slots.data_ptr() % 16:
        # A step's one chunk after an odd number of decode rows: its slots start mid-way in
        # the step's. Triton compiles a variant per pointer alignment, and the start-up
        # warm-up ran aligned ones: a copy of a few hundred bytes instead of a JIT stall.
        context_slots = context_slots.clone()
    return VarlenPrefillLayout(
        query_starts=starts[0],
        context_starts=starts[1],
        context_slots=context_slots,
        chunks=len(lengths),
        max_length=max(lengths),
    )


def varlen_prefill_attention_triton(
    query: torch.Tensor,
    kv_pair: torch.Tensor,
    layout: VarlenPrefillLayout,
    scale: float,
    launch: PrefillLaunch | None = None,
) -> torch.Tensor:
    """``[tokens, num_heads * head_dim]``: causal attention of every prefill chunk of a step;
    ``query`` ``[tokens, num_heads, head_dim]`` (rows may be strided, as views of the QKV
    projection are), ``kv_pair`` a layer's ``[2, blocks, block_size, kv_heads, head_dim]``."""
    if not triton_layer_ops.available(query.device):
        raise RuntimeError(f"the Triton prefill kernel does not run on {query.device} here")
    tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_pair.shape[3]
    group = num_heads // num_kv_heads
    interpret = query.device.type == "cpu"
    if launch is None:
        launch = default_launch(head_dim, interpret)
    block_group = triton.next_power_of_2(group)
    rows = max(launch.rows, block_group, _MIN_DOT_DIM)
    out = query.new_empty(tokens, num_heads, head_dim)
    if not tokens:
        return out.view(tokens, num_heads * head_dim)
    if query.stride(2) != 1 or kv_pair.stride(-1) != 1:
        raise ValueError("query and cache rows need contiguous head dimensions")
    cache_slot_stride = kv_pair.stride(2)
    tiles = triton.cdiv(layout.max_length, rows // block_group)
    options: dict[str, int] = {}
    if not interpret:
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    _kernel(interpret)[(tiles, num_kv_heads, layout.chunks)](
        query,
        kv_pair[0],
        kv_pair[1],
        layout.context_slots,
        layout.query_starts,
        layout.context_starts,
        out,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        cache_slot_stride,
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_GROUP=block_group,
        HEAD_DIM=head_dim,
        BLOCK_DIM=max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim)),
        BLOCK_ROWS=rows,
        ROWS_PER_TILE=rows // block_group,
        BLOCK_TOKENS=launch.tokens,
        # fp32 caches get exact fp32 products (not TF32): fp32 is the correctness mode.
        DOT_PRECISION="ieee" if kv_pair.dtype == torch.float32 else "tf32",
        **options,
    )
    return out.view(tokens, num_heads * head_dim)
