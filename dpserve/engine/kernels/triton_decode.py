"""Paged decode attention as a Triton split-K ("flash-decoding") kernel.

Same inputs and output as ``layers.attention.paged_decode_attention_reference`` (the layout is
documented there). Two launches:

1. ``_split_kernel``, one program per (sequence, KV head, KV split): it loads the queries of
   every query head that reads this KV head (grouped-query attention: K and V are read once for
   the whole group), walks its span of the sequence's tokens through the block table in tiles,
   and keeps an online softmax in fp32. It writes the split's normalised output and its
   log-sum-exp (base 2).
2. ``_reduce_kernel``, one program per (sequence, query head): merges the splits by their
   log-sum-exp. When the grid has one split per sequence (a full batch: enough programs
   without splitting), the split kernel writes the output itself and this launch is skipped.

Splitting the KV span is what keeps the GPU busy when ``batch x KV heads`` is smaller than the
number of SMs (short batches, long contexts). The grid's split count depends only on shapes,
never on ``seq_lens`` values, so a call never synchronises with the device and can be captured
in a CUDA graph; each program then derives its sequence's split from the sequence's actual
length on the device (as many of the grid's splits as keep one at least ``min_split_tokens``
long), so a short sequence in a batch sized for long contexts is one split, not many nearly
empty ones, and the splits beyond it exit at once. ``block_size`` is a compile-time constant
(one compiled variant per block size; ``warm_up`` compiles those a run will use).

Triton is optional: the module imports without it and only the call raises. On CPU tensors the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI tests them.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without Triton; only this kernel needs it
    triton = None
    tl = None

# tl.dot needs every dimension >= 16, so the query group is padded up to 16.
_MIN_DOT_DIM = 16


@dataclass(frozen=True)
class SplitLaunch:
    """How ``_split_kernel`` is compiled and launched (``bench/decode_attention.py`` sweeps
    these on a GPU)."""

    tile_tokens: int
    num_warps: int = 4
    num_stages: int = 2


# The fastest overall on an H100 (BENCHMARKS.md): at batch 256 x 512 tokens it reads the KV at
# 73 % (head dim 64) and 85 % (128) of the copy bandwidth, and on 4 sequences of 8,192 tokens
# a tile of 64 in 2 stages reached only 41 %.
GPU_LAUNCH = SplitLaunch(tile_tokens=128, num_warps=4, num_stages=3)
# The interpreter runs every program in numpy: smaller tiles keep the tests quick.
INTERPRETER_LAUNCH = SplitLaunch(tile_tokens=16)
# A split shorter than this costs more in its merge than it saves in parallelism.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 128
# Aim for this many programs per SM, so tails of uneven sequence lengths overlap.
_PROGRAMS_PER_SM = 2


class TritonUnavailable(RuntimeError):
    """The Triton kernel was called where it cannot run."""


# Triton reads a kernel's annotations as compile-time meaning (tl.constexpr; others pick the
# argument's specialization), so the pointer and stride parameters stay unannotated.
def _split_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    scale_log2,
    min_split_tokens,
    query_stride_batch,
    query_stride_head,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    table_stride_batch,
    part_stride_batch,
    part_stride_head,
    part_stride_split,
    out_stride_batch,
    out_stride_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    sequence = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    length = tl.load(seq_lens_ptr + sequence)
    # This sequence's own split: its length over as many of the grid's splits as keep each at
    # least min_split_tokens long, in whole tiles. Splits past those start beyond the end.
    used = tl.minimum(tl.maximum(tl.cdiv(length, min_split_tokens), 1), num_splits)
    split_tokens = tl.cdiv(tl.cdiv(length, used), BLOCK_TOKENS) * BLOCK_TOKENS
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, length)

    group = tl.arange(0, BLOCK_GROUP)
    dims = tl.arange(0, BLOCK_DIM)
    heads = kv_head * GROUP + group
    group_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    query = tl.load(
        query_ptr
        + sequence.to(tl.int64) * query_stride_batch
        + heads[:, None] * query_stride_head
        + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    running_max = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_GROUP], tl.float32)
    acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], tl.float32)
    table_row = block_tables_ptr + sequence.to(tl.int64) * table_stride_batch
    for tile_start in range(start, end, BLOCK_TOKENS):
        tokens = tile_start + tl.arange(0, BLOCK_TOKENS)
        token_mask = tokens < end
        blocks = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        rows = (
            blocks.to(tl.int64) * cache_stride_block
            + (tokens % BLOCK_SIZE) * cache_stride_token
            + kv_head * cache_stride_head
        )
        load_mask = token_mask[:, None] & dim_mask[None, :]
        keys = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=load_mask, other=0.0)
        scores = tl.dot(query.to(keys.dtype), tl.trans(keys), input_precision=DOT_PRECISION)
        scores = tl.where(token_mask[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        weights = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        values = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=load_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(
            weights.to(values.dtype), values, input_precision=DOT_PRECISION
        )
        running_max = new_max

    # An empty split (it starts past the sequence's end) leaves sum 0: output 0, lse -inf.
    nonempty = running_sum > 0
    out = acc / tl.where(nonempty, running_sum, 1.0)[:, None]
    out_mask = group_mask[:, None] & dim_mask[None, :]
    if SINGLE_SPLIT:
        # Nothing to merge: the output is written here and the reduce kernel is not launched.
        final = sequence.to(tl.int64) * out_stride_batch + heads * out_stride_head
        tl.store(
            out_ptr + final[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
        return
    lse = running_max + tl.log2(tl.where(nonempty, running_sum, 1.0))
    part = (
        sequence.to(tl.int64) * part_stride_batch
        + heads * part_stride_head
        + split * part_stride_split
    )
    tl.store(partial_out_ptr + part[:, None] + dims[None, :], out, mask=out_mask)
    # partial_lse is partial_out without its last dimension (both contiguous).
    tl.store(partial_lse_ptr + part // HEAD_DIM, lse, mask=group_mask)


def _reduce_kernel(  # type: ignore[no-untyped-def]  # unannotated for Triton: see above
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    out_stride_batch,
    out_stride_head,
    part_stride_batch,
    part_stride_head,
    part_stride_split,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    sequence = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_DIM)
    split_mask = splits < num_splits
    dim_mask = dims < HEAD_DIM
    base = sequence.to(tl.int64) * part_stride_batch + head * part_stride_head
    part = base + splits * part_stride_split
    lse = tl.load(partial_lse_ptr + part // HEAD_DIM, mask=split_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    # A sequence with no tokens at all (a padding row) has every lse at -inf: output 0.
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, 0)
    outs = tl.load(
        partial_out_ptr + part[:, None] + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    merged = tl.sum(outs * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + sequence.to(tl.int64) * out_stride_batch + head * out_stride_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    # Decorated on first use, not at import: triton.jit picks the interpreter or the compiler
    # from TRITON_INTERPRET when it decorates, so the choice follows the environment of the
    # first call (and the cache key keeps the two apart).
    del interpret
    return triton.jit(_split_kernel), triton.jit(_reduce_kernel)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """KV splits per sequence: enough programs to fill the device, no split under
    ``_MIN_SPLIT_TOKENS`` tokens. Depends on shapes only (no device synchronisation)."""
    processors = _sm_count(device.index or 0) if device.type == "cuda" else 1
    wanted = math.ceil(_PROGRAMS_PER_SM * processors / max(1, batch * num_kv_heads))
    by_length = math.ceil(max_tokens / _MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def _check_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected query [batch, heads, dim] and caches [blocks, block_size, kv_heads, dim], "
            f"got {tuple(query.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads of dim {head_dim} do not fit {num_kv_heads} KV heads of "
            f"dim {k_cache.shape[3]}"
        )
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables and seq_lens need one row per query")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or query.stride(2) != 1:
        raise ValueError("the caches need the same strides and contiguous head dimensions")
    devices = {t.device for t in (query, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if triton is None:
        raise TritonUnavailable(
            "paged_decode_attention_triton needs the triton package (it ships with torch's CUDA "
            "wheels; `pip install triton` elsewhere); use paged_decode_attention_reference"
        )
    if query.device.type == "cpu" and not _interpreting():
        raise TritonUnavailable(
            "CPU tensors run the Triton kernel only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported, or use paged_decode_attention_reference"
        )


def paged_decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    min_split_tokens: int = _MIN_SPLIT_TOKENS,
    launch: SplitLaunch | None = None,
) -> torch.Tensor:
    """``[batch, num_heads, head_dim]`` attention output for one new token per sequence; the
    layout is ``layers.attention``'s. ``num_splits`` (the grid's splits per sequence) overrides
    ``default_num_splits``; each sequence spreads its own length over as many of them as keep a
    split at least ``min_split_tokens`` long. A row with ``seq_lens == 0`` (batch padding) gets
    zeros. ``launch`` overrides the compiled variant (``GPU_LAUNCH``)."""
    _check_inputs(query, k_cache, v_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    interpret = query.device.type == "cpu"
    if launch is None:
        launch = INTERPRETER_LAUNCH if interpret else GPU_LAUNCH
    tile = launch.tile_tokens
    max_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_tokens, query.device)
    # No sequence can use more splits than its table's width allows (one tile each at least).
    num_splits = max(1, min(num_splits, math.ceil(max(1, max_tokens) / tile)))

    # A single split writes ``out`` itself: its partial buffers are placeholders.
    rows = (batch, num_heads) if num_splits > 1 else (1, 1)
    partial_out = torch.empty(*rows, num_splits, head_dim, device=query.device, dtype=torch.float32)
    partial_lse = torch.empty(*rows, num_splits, device=query.device, dtype=torch.float32)
    out = torch.empty_like(query)
    block_dim = max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    split_kernel, reduce_kernel = _kernels(interpret)
    gpu_options: dict[str, int] = {}
    if not interpret:
        gpu_options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        scale * math.log2(math.e),
        max(1, min_split_tokens),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_GROUP=max(_MIN_DOT_DIM, triton.next_power_of_2(group)),
        BLOCK_DIM=block_dim,
        BLOCK_TOKENS=tile,
        BLOCK_SIZE=block_size,  # a constant: // and % by it compile to shifts for powers of 2
        # fp32 caches get exact fp32 products (not TF32): fp32 is the correctness mode.
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        SINGLE_SPLIT=num_splits == 1,
        **gpu_options,
    )
    if num_splits == 1:
        return out
    reduce_kernel[(batch, num_heads)](
        partial_out,
        partial_lse,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_DIM=block_dim,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        **({} if interpret else {"num_warps": 4}),
    )
    return out


def warm_up(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_batch: int,
    max_blocks_per_sequence: int,
) -> set[tuple[int, int]]:
    """Compile, before serving, every kernel variant a run's eager decode steps can hit, so no
    step waits for Triton's JIT (about a second per variant on a GPU).

    A variant is fixed by the model's shapes (compile-time constants) plus what Triton
    specializes runtime integers on (equal to 1, divisible by 16): here the block table's row
    stride (its width) and the split count, which follows from the batch size and the width
    (``default_num_splits``). Every power-of-two batch up to ``max_batch`` is run at table
    widths 1, 2, 16, 17 and ``max_blocks_per_sequence`` (each a specialization class, clamped to
    the maximum). Returns the (width, splits) pairs run."""
    widths = sorted({min(w, max_blocks_per_sequence) for w in (1, 2, 16, 17)})
    widths = sorted({*widths, max_blocks_per_sequence})
    batches = sorted({1 << i for i in range(max(1, max_batch).bit_length())} | {max_batch})
    cache_shape = (max(widths) + 1, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    ran: set[tuple[int, int]] = set()
    for batch in batches:
        query = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=device)
        for width in widths:
            splits = default_num_splits(batch, num_kv_heads, width * block_size, device)
            tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
            lengths = torch.full((batch,), width * block_size, dtype=torch.int32, device=device)
            paged_decode_attention_triton(query, k_cache, v_cache, tables, lengths, 1.0)
            ran.add((width, splits))
    return ran
