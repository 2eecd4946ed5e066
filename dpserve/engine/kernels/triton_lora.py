"""The LoRA delta of a step mixing adapters as two Triton kernels (CUDA; the interpreter on CPU),
after Punica's SGMV/BGMV as vLLM runs them: ``out[m] += (x[m] @ A_i^T) @ B_i^T`` for each row
``m`` of adapter ``i`` (``lora.delta``'s stacked form).

The adapters' A are stacked ``[R, in]`` and their B ``[out, R]`` (R their ranks together),
adapter ``i`` owning the ``ranks[i]`` columns from ``starts[i]`` (rank 0: the projection is not
in that adapter); ``row_adapter`` gives each row's adapter, -1 for the base model. Where the
torch path multiplies every row by every adapter's columns and masks the others to zero, here
each program multiplies only its adapter's columns:

1. ``shrink``: one program per (block of ``BLOCK_M`` rows, adapter, slice of the input)
   multiplies the rows of its adapter in the block by that adapter's A over its slice of the
   input columns (``tl.dot``, fp32 sums) and writes ``[rows, rank]`` partial sums. A decode
   step has one or two row blocks, so the input (up to ~16k columns) is split into several
   slices to give the GPU more programs than blocks x adapters; the slices' partial sums are
   kept apart (no atomics: the sum does not depend on scheduling) and added by the expand.
2. ``expand``: one program per (row block, adapter, block of ``BLOCK_N`` output columns) adds
   the slices' sums, rounds them to B's dtype (as the torch path's shrink is rounded), times the
   adapter's B columns (q/k/v fused: ``out`` is the fused projection's width, B block-diagonal),
   adds that to its rows of ``out`` in fp32 and writes them back in ``out``'s dtype, in place.

A program whose block has no row of its adapter returns at once; rows of the base model (and of
adapters without the projection) are neither read nor written, so they keep their exact bits.
In fp32 the products are IEEE (no TF32), as the torch path's; the sums run in another order, so
results agree with it to rounding, not bit for bit.

Triton is optional: the module imports without it (``triton_layer_ops.available``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dpserve.engine.kernels import triton_layer_ops

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without Triton (then the torch path runs)
    triton = None
    tl = None

# Rows of one block: tl.dot needs every dimension >= 16; a decode step has a few rows per
# adapter, so larger blocks would be mostly padding (masked, never loaded).
BLOCK_M = 16
_BLOCK_K = 64  # input columns per step of the shrink
_BLOCK_N = 64  # output columns per expand program: an out of 4096 gives 64 of them per block
_MIN_RANK_BLOCK = 16  # the rank as a tile's dimension: at least tl.dot's 16
# The input split into slices of at least this many columns, into at most _MAX_SLICES, and
# only while the row blocks are few (a prefill's many blocks fill the GPU already).
_MIN_SLICE_COLUMNS = 512
_MAX_SLICES = 16
_SLICED_PROGRAMS = 64


# Triton reads a kernel's annotations as compile-time meaning (tl.constexpr), so the pointer,
# size and stride parameters stay unannotated (as in triton_layer_ops).
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    a_ptr,
    partial_ptr,
    row_adapter_ptr,
    starts_ptr,
    ranks_ptr,
    num_rows,
    in_features,
    slice_columns,
    x_stride_row,
    x_stride_col,
    a_stride,
    partial_stride_slice,
    partial_stride_row,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    adapter = tl.program_id(1)
    rank = tl.load(ranks_ptr + adapter)
    if rank == 0:  # the projection is not in this adapter
        return
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    in_step = rows < num_rows
    mine = in_step & (tl.load(row_adapter_ptr + rows, mask=in_step, other=-1) == adapter)
    if tl.max(mine.to(tl.int32), axis=0) == 0:  # no row of this adapter in the block
        return
    start = tl.load(starts_ptr + adapter).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    columns_a = a_ptr + (start + ranks)[None, :] * a_stride
    first = tl.program_id(2).to(tl.int64) * slice_columns
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for offset in range(0, slice_columns, BLOCK_K):
        inner = first + offset + tl.arange(0, BLOCK_K)
        inside = inner < in_features
        x = tl.load(
            x_ptr + rows[:, None] * x_stride_row + inner[None, :] * x_stride_col,
            mask=mine[:, None] & inside[None, :],
            other=0.0,
        )
        a = tl.load(
            columns_a + inner[:, None],
            mask=inside[:, None] & (ranks[None, :] < rank),
            other=0.0,
        )
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    tl.store(
        partial_ptr
        + tl.program_id(2) * partial_stride_slice
        + rows[:, None] * partial_stride_row
        + ranks[None, :],
        acc,
        mask=mine[:, None] & (ranks[None, :] < rank),
    )


def _expand_kernel(  # type: ignore[no-untyped-def]  # unannotated for Triton: see above
    partial_ptr,
    b_ptr,
    out_ptr,
    row_adapter_ptr,
    starts_ptr,
    ranks_ptr,
    num_rows,
    out_features,
    slices,
    partial_stride_slice,
    partial_stride_row,
    b_stride,
    out_stride_row,
    out_stride_col,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    adapter = tl.program_id(1)
    rank = tl.load(ranks_ptr + adapter)
    if rank == 0:
        return
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    in_step = rows < num_rows
    mine = in_step & (tl.load(row_adapter_ptr + rows, mask=in_step, other=-1) == adapter)
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    start = tl.load(starts_ptr + adapter).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    used = mine[:, None] & (ranks[None, :] < rank)
    partial = partial_ptr + rows[:, None] * partial_stride_row + ranks[None, :]
    shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for part in range(0, slices):
        shrunk += tl.load(partial + part * partial_stride_slice, mask=used, other=0.0)
    columns = tl.program_id(2).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.load(
        b_ptr + columns[None, :] * b_stride + (start + ranks)[:, None],
        mask=(ranks[:, None] < rank) & (columns[None, :] < out_features),
        other=0.0,
    )
    shrunk = shrunk.to(b_ptr.dtype.element_ty)  # rounded as the torch path's shrink
    if DOT_IN_FP32:
        shrunk = shrunk.to(tl.float32)
        b = b.to(tl.float32)
    update = tl.dot(shrunk, b, input_precision=DOT_PRECISION)
    written = mine[:, None] & (columns[None, :] < out_features)
    target = out_ptr + rows[:, None] * out_stride_row + columns[None, :] * out_stride_col
    current = tl.load(target, mask=written, other=0.0).to(tl.float32)
    tl.store(target, (current + update).to(out_ptr.dtype.element_ty), mask=written)


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    # Decorated on first use (see triton_layer_ops._kernels: the interpreter is chosen then).
    del interpret
    return triton.jit(_shrink_kernel), triton.jit(_expand_kernel)


def _rank_block(max_rank: int) -> int:
    return max(_MIN_RANK_BLOCK, int(triton.next_power_of_2(max_rank)))


def _dot_args(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The dots' precision: IEEE in fp32 (no TF32, as the torch path). Triton's interpreter
    multiplies bf16 operands' bit patterns in ``tl.dot`` (it keeps bf16 as uint16:
    triton-lang/triton#11584, unsupported there), so on CPU a bf16 dot runs on operands
    widened to fp32, which is exact for the products; CUDA runs the bf16 dot."""
    in_fp32 = dtype == torch.bfloat16 and device.type == "cpu"
    precision = "ieee" if dtype == torch.float32 or in_fp32 else "tf32"  # unused by fp16/bf16
    return {"DOT_PRECISION": precision, "DOT_IN_FP32": in_fp32}


def _check(device: torch.device) -> None:
    if not triton_layer_ops.available(device):
        raise RuntimeError(
            f"the Triton LoRA kernels do not run on {device} here (no triton, or CPU tensors "
            "without TRITON_INTERPRET=1): use lora.delta's torch path"
        )


def shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    row_adapter: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
) -> torch.Tensor:
    """Each row's product with its adapter's A: ``[slices, rows, max_rank]`` fp32 partial
    sums over slices of the input, whose sum over the slices is, for row ``m`` of adapter
    ``i = row_adapter[m] >= 0``, ``x[m] @ a[starts[i] : starts[i] + ranks[i]].T`` in its first
    ``ranks[i]`` columns. Rows of ``x`` past ``row_adapter``'s are ignored; rows of adapter -1
    (and the columns past a row's rank) are left unwritten: ``expand`` never reads them."""
    _check(x.device)
    if x.dtype != a.dtype:
        raise ValueError(f"x is {x.dtype} and A {a.dtype}: the delta needs one dtype")
    if a.stride(1) != 1:
        raise ValueError("the stacked A needs contiguous rows")
    rows, in_features = row_adapter.shape[0], x.shape[1]
    row_blocks = triton.cdiv(rows, BLOCK_M)
    slices = max(
        1,
        min(_MAX_SLICES, _SLICED_PROGRAMS // max(row_blocks, 1), in_features // _MIN_SLICE_COLUMNS),
    )
    # Whole steps of _BLOCK_K per slice, and no slice left empty.
    slice_columns = triton.cdiv(triton.cdiv(in_features, slices), _BLOCK_K) * _BLOCK_K
    slices = triton.cdiv(in_features, slice_columns)
    partial = torch.empty(slices, rows, max_rank, dtype=torch.float32, device=x.device)
    if rows == 0 or max_rank == 0:
        return partial
    shrink_kernel, _ = _kernels(x.device.type == "cpu")
    shrink_kernel[(row_blocks, starts.numel(), slices)](
        x,
        a,
        partial,
        row_adapter,
        starts,
        ranks,
        rows,
        in_features,
        slice_columns,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        partial.stride(0),
        partial.stride(1),
        **_dot_args(x.dtype, x.device),
        BLOCK_M=BLOCK_M,
        BLOCK_R=_rank_block(max_rank),
        BLOCK_K=_BLOCK_K,
    )
    return partial


def expand(
    partial: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    row_adapter: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """``out[m] += shrunk[m, :ranks[i]] @ b[:, starts[i] : starts[i] + ranks[i]].T`` in place
    for each row ``m`` of adapter ``i = row_adapter[m] >= 0`` (``shrunk``: ``partial`` from
    ``shrink`` summed over its slices, rounded to B's dtype), in fp32, rounded once to
    ``out``'s dtype. Other rows of ``out`` are not touched."""
    _check(out.device)
    if b.stride(1) != 1:
        raise ValueError("the stacked B needs contiguous rows")
    slices, rows, max_rank = partial.shape
    out_features = out.shape[1]
    if rows == 0 or max_rank == 0:
        return
    _, expand_kernel = _kernels(out.device.type == "cpu")
    grid = (triton.cdiv(rows, BLOCK_M), starts.numel(), triton.cdiv(out_features, _BLOCK_N))
    expand_kernel[grid](
        partial,
        b,
        out,
        row_adapter,
        starts,
        ranks,
        rows,
        out_features,
        slices,
        partial.stride(0),
        partial.stride(1),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        **_dot_args(b.dtype, b.device),
        BLOCK_M=BLOCK_M,
        BLOCK_R=_rank_block(max_rank),
        BLOCK_N=_BLOCK_N,
    )


def add_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_adapter: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
) -> None:
    """``out[m] += (x[m] @ A_i^T) @ B_i^T`` in place for each row ``m`` of ``row_adapter``
    with an adapter ``i >= 0`` (A ``[R, in]``, B ``[out, R]`` stacked, adapter ``i`` owning the
    ``ranks[i]`` columns from ``starts[i]``, ``max_rank`` their largest rank): ``shrink`` then
    ``expand``. Rows of ``x`` and ``out`` past ``row_adapter``'s (padding) are left alone."""
    partial = shrink(x, a, row_adapter, starts, ranks, max_rank)
    expand(partial, b, out, row_adapter, starts, ranks)
