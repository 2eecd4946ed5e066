"""The decoder layer's element-wise steps as single Triton kernels (CUDA; the interpreter on CPU).

In plain torch, a decode step's glue between the matmuls and attention ran ~20 kernels per
layer on an H100 (issue 16: ~16 % of a 1B decode step): RoPE as three (a copy to fp32, the
complex product, the copy back), the KV write as an ``index_put_`` over a transposed view, SiLU
and the product by the up projection as two more. Each of those reads and writes the whole
activation. Here:

* ``rotate_and_write_kv``: one program per token rotates the query and key heads of its row of
  the fused QKV projection by RoPE (in fp32, rounded once), writes the queries back in place and
  the rotated keys and the values straight into the paged cache at the token's slot; with
  Qwen3's per-head q/k RMSNorm first, in the same pass (the torch path runs it as two more
  reads and writes of the queries and keys per layer);
* ``silu_times_up``: ``silu(gate) * up`` from the fused gate/up projection in one pass.

They round like the torch code they replace (the rotation in fp32, then to the model's dtype;
SiLU rounded to the dtype before the product, as ``silu`` then ``mul_`` do), so the tokens do
not depend on which one ran.

Triton is optional: the module imports without it. On CPU tensors the kernels run only in
Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI tests them against the torch
code.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without Triton (then the torch code runs)
    triton = None
    tl = None

_SILU_BLOCK = 1024  # columns of the intermediate size per program


# Triton reads a kernel's annotations as compile-time meaning (tl.constexpr; others pick the
# argument's specialization), so the pointer and stride parameters stay unannotated.
def _rotate_and_write_kernel(  # type: ignore[no-untyped-def]
    qkv_ptr,
    rotation_ptr,
    positions_ptr,
    slots_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    qkv_stride,
    cache_stride_slot,
    eps,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_ROTATED: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    HEAD_NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    row_ptr = qkv_ptr + row * qkv_stride
    slot_base = slot * cache_stride_slot
    # The query heads, then the key heads, read as one contiguous run of the row. Each head's
    # dimensions come in RoPE pairs (layers/rotary.py's rotary_pair_order): split into the pairs'
    # first and second elements, rotated, and joined back in place.
    columns = tl.arange(0, BLOCK_ROTATED)
    rotated = columns < Q_SIZE + KV_SIZE
    heads = tl.load(row_ptr + columns, mask=rotated, other=0.0).to(tl.float32)
    if HEAD_NORM:
        # RMSNorm of each head (rows of HEAD_DIM = 2 * HALF; the padding heads stay zero),
        # rounded as torch's rms_norm: normalised in fp32 and rounded, then times the weight
        # (the query heads' or the key heads', in RoPE pair order) and rounded again.
        per_head = tl.reshape(heads, [BLOCK_ROTATED // (2 * HALF), 2 * HALF])
        mean_square = tl.sum(per_head * per_head, axis=1) / (2 * HALF)
        per_head = (per_head * tl.rsqrt(mean_square + eps)[:, None]).to(qkv_ptr.dtype.element_ty)
        dims = tl.arange(0, 2 * HALF)
        is_query = (tl.arange(0, BLOCK_ROTATED // (2 * HALF)) < Q_SIZE // (2 * HALF))[:, None]
        weight = tl.where(
            is_query, tl.load(q_norm_ptr + dims)[None, :], tl.load(k_norm_ptr + dims)[None, :]
        )
        per_head = (per_head.to(tl.float32) * weight.to(tl.float32)).to(qkv_ptr.dtype.element_ty)
        heads = tl.reshape(per_head.to(tl.float32), [BLOCK_ROTATED])
    first, second = tl.split(tl.reshape(heads, [BLOCK_ROTATED // 2, 2]))
    # rotation: [positions, half] complex64 read as (cos, sin) float pairs.
    table = rotation_ptr + position * (2 * HALF) + 2 * (tl.arange(0, BLOCK_ROTATED // 2) % HALF)
    cos = tl.load(table)
    sin = tl.load(table + 1)
    out = tl.reshape(
        tl.join(first * cos - second * sin, second * cos + first * sin), [BLOCK_ROTATED]
    ).to(qkv_ptr.dtype.element_ty)
    tl.store(row_ptr + columns, out, mask=columns < Q_SIZE)
    is_key = rotated & (columns >= Q_SIZE)
    tl.store(k_cache_ptr + slot_base + (columns - Q_SIZE), out, mask=is_key)

    kv_columns = tl.arange(0, BLOCK_KV)
    values = tl.load(
        row_ptr + (Q_SIZE + KV_SIZE) + kv_columns, mask=kv_columns < KV_SIZE, other=0.0
    )
    tl.store(v_cache_ptr + slot_base + kv_columns, values, mask=kv_columns < KV_SIZE)


def _silu_times_up_kernel(  # type: ignore[no-untyped-def]  # unannotated for Triton: see above
    gate_up_ptr,
    out_ptr,
    gate_up_stride,
    out_stride,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < WIDTH
    gate = tl.load(gate_up_ptr + row * gate_up_stride + columns, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * gate_up_stride + WIDTH + columns, mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    # As functional.silu then mul_: SiLU rounded to the dtype, then the product rounded.
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available(device: torch.device) -> bool:
    """Whether these kernels run on tensors of ``device``."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    # Decorated on first use, not at import: triton.jit picks the interpreter or the compiler
    # from TRITON_INTERPRET when it decorates (the cache key keeps the two apart).
    del interpret
    rotate = triton.jit(
        _rotate_and_write_kernel,
        # Eager batches hand in views at any offset: one compiled variant for all of them.
        do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"],
    )
    return rotate, triton.jit(_silu_times_up_kernel)


def _check(device: torch.device) -> None:
    if not available(device):
        raise RuntimeError(
            f"the Triton layer kernels do not run on {device} here (no triton, or CPU tensors "
            "without TRITON_INTERPRET=1): use the torch code of dpserve.engine.layers"
        )


def rotate_and_write_kv(
    qkv: torch.Tensor,
    rotation: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_pair: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """RoPE on the query and key heads of ``qkv`` ``[tokens, (heads + 2 * kv_heads) * dim]``
    (each head's dimensions in RoPE-pair order) at ``positions``; the queries are rotated in
    place, the rotated keys and the values are written to ``kv_pair`` (``[2, blocks,
    block_size, kv_heads, dim]``) at ``slot_mapping``. ``rotation`` is ``[positions, 1, dim /
    2]`` complex64 (cos + i sin). The keys in ``qkv`` are left unrotated. ``head_norms``
    (query weight, key weight, eps; ``[dim]`` in RoPE pair order): each query and key head is
    RMS-normalised first (``fuses_head_norm`` says where)."""
    _check(qkv.device)
    if head_norms is not None and not fuses_head_norm(head_dim):
        raise ValueError(f"the head norm is fused for power-of-two head sizes, not {head_dim}")
    tokens = qkv.shape[0]
    if not tokens:
        return
    if qkv.stride(1) != 1 or kv_pair[0].stride(-1) != 1 or not rotation.is_contiguous():
        raise ValueError("qkv, the cache and the rotation table need contiguous rows")
    half = head_dim // 2
    cache_slot_stride = kv_pair.stride(2)
    if kv_pair.stride(1) != kv_pair.shape[2] * cache_slot_stride:
        raise ValueError("the cache's blocks must be contiguous runs of slots")
    kernel, _ = _kernels(qkv.device.type == "cpu")
    kernel[(tokens,)](
        qkv,
        torch.view_as_real(rotation),
        positions,
        slot_mapping,
        kv_pair[0],
        kv_pair[1],
        head_norms[0] if head_norms is not None else qkv,  # unread without the norm
        head_norms[1] if head_norms is not None else qkv,
        qkv.stride(0),
        cache_slot_stride,
        head_norms[2] if head_norms is not None else 0.0,
        Q_SIZE=num_heads * head_dim,
        KV_SIZE=num_kv_heads * head_dim,
        HALF=half,
        BLOCK_ROTATED=triton.next_power_of_2((num_heads + num_kv_heads) * head_dim),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads * head_dim),
        HEAD_NORM=head_norms is not None,
        **({} if qkv.device.type == "cpu" else {"num_warps": 8}),
    )


def fuses_head_norm(head_dim: int) -> bool:
    """Whether ``rotate_and_write_kv`` can RMS-normalise heads of ``head_dim`` in its pass: it
    splits its power-of-two run of the row into whole heads."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def silu_times_up(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[tokens, 2 * width]`` (gate columns first)."""
    _check(gate_up.device)
    tokens, double = gate_up.shape
    width = double // 2
    out = gate_up.new_empty(tokens, width)
    if not tokens:
        return out
    if gate_up.stride(1) != 1:
        raise ValueError("gate_up needs contiguous rows")
    _, kernel = _kernels(gate_up.device.type == "cpu")
    block = min(_SILU_BLOCK, triton.next_power_of_2(width))
    kernel[(tokens, triton.cdiv(width, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width, BLOCK=block
    )
    return out
