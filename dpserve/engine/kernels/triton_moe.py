"""Mixture of experts as two grouped matmuls over expert-sorted tokens (CUDA; the interpreter on
CPU), the fused MoE of vLLM and SGLang.

The CPU path (``layers.moe``) loops over the active experts on the host, which needs each
expert's token count there: a device-to-host sync per layer, and no CUDA graph can hold it.
Here nothing leaves the device:

1. ``expert_blocks`` (torch, sync-free, so a CUDA graph can capture it) sorts the step's
   (token, choice) pairs by expert and pads each expert's run to a whole number of
   ``BLOCK_M``-row blocks, so every block of rows belongs to one expert. The padded layout has
   a fixed size for a given number of pairs, so its grid does too; blocks past the used ones
   are marked ``-1`` and return at once.
2. ``_grouped_matmul_kernel``: one program per (row block, column block) multiplies its rows
   by its expert's weight — the gate/up projection of each pair's token, then (after
   ``triton_layer_ops.silu_times_up``) the down projection of each pair's activation, scaled by
   the pair's router weight.
3. The ``top_k`` outputs of each token are summed (a ``[tokens, top_k, hidden]`` view).

Pairs are numbered ``token * top_k + choice``, as the router's ``[tokens, top_k]`` outputs are
laid out, so a pair's token is ``pair // top_k``. In fp32 the products are IEEE (no TF32), as
the torch path's; the sum over a token's experts runs in a different order than the CPU path's
``index_add_``, so fp32 results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dpserve.engine.kernels import triton_layer_ops

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without Triton (then MoE runs on the CPU path)
    triton = None
    tl = None

# Rows of one block: tl.dot needs every dimension >= 16; decode steps have few pairs per expert
# (Qwen3-30B-A3B: 8 of 128 experts per token), so larger blocks would mostly be padding.
BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


# Triton reads a kernel's annotations as compile-time meaning (tl.constexpr), so the pointer
# and stride parameters stay unannotated (as in triton_layer_ops).
def _grouped_matmul_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    pair_weights_ptr,
    num_pairs,
    a_stride,
    b_stride_expert,
    b_stride_row,
    c_stride,
    N: tl.constexpr,
    K: tl.constexpr,
    PAIRS_PER_A_ROW: tl.constexpr,
    SCALE_BY_PAIR_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:  # a block past the used ones (the grid is sized for the worst case)
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + rows).to(tl.int64)
    used = pairs < num_pairs  # padding rows hold num_pairs
    a_rows = pairs // PAIRS_PER_A_ROW
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weight = b_ptr + expert * b_stride_expert + columns[None, :].to(tl.int64) * b_stride_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        inner = start + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * a_stride + inner[None, :],
            mask=used[:, None] & (inner[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            weight + inner[:, None],
            mask=(inner[:, None] < K) & (columns[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if SCALE_BY_PAIR_WEIGHT:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=used, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + pairs[:, None] * c_stride + columns[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=used[:, None] & (columns[None, :] < N),
    )


@functools.cache
def _kernel(interpret: bool) -> Any:
    # Decorated on first use (see triton_layer_ops._kernels: the interpreter is chosen then).
    del interpret
    return triton.jit(_grouped_matmul_kernel)


def expert_blocks(
    experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs of ``experts`` ``[tokens, top_k]`` grouped by expert, each
    expert's run padded to whole blocks of ``block_m`` rows: ``pair_ids`` (padding = the number
    of pairs) and each block's expert (``-1`` past the used blocks). Sizes depend only on the
    number of pairs, and nothing is read on the host."""
    pairs = experts.reshape(-1)
    num_pairs = pairs.numel()
    # Each expert with tokens wastes under one block: at most min(experts, pairs) extra blocks.
    max_blocks = -(-num_pairs // block_m) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.long, device=pairs.device)
    counts.scatter_add_(0, pairs, torch.ones_like(pairs))  # bincount would sync on CUDA
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks_per_expert, 0)
    padded_starts = (block_ends - blocks_per_expert) * block_m
    order = torch.argsort(pairs, stable=True)
    sorted_experts = pairs.index_select(0, order)
    rank_in_expert = torch.arange(num_pairs, device=pairs.device) - (
        torch.cumsum(counts, 0) - counts
    ).index_select(0, sorted_experts)
    pair_ids = torch.full(
        (max_blocks * block_m,), num_pairs, dtype=torch.int32, device=pairs.device
    )
    pair_ids.index_copy_(
        0,
        padded_starts.index_select(0, sorted_experts) + rank_in_expert,
        order.to(torch.int32),
    )
    block_experts = torch.searchsorted(
        block_ends, torch.arange(max_blocks, device=pairs.device), right=True
    )
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return pair_ids, block_experts


def _grouped_matmul(
    a: torch.Tensor,
    weights: torch.Tensor,
    pair_ids: torch.Tensor,
    block_experts: torch.Tensor,
    num_pairs: int,
    pairs_per_a_row: int,
    pair_weights: torch.Tensor | None,
) -> torch.Tensor:
    """``[pairs, N]``: each pair's row of ``a`` (row ``pair // pairs_per_a_row``) times its
    expert's ``weights[expert]`` ``[N, K]`` transposed, scaled by ``pair_weights`` if given."""
    out_features, in_features = weights.shape[1], weights.shape[2]
    out = a.new_empty(num_pairs, out_features)
    if a.stride(1) != 1 or weights.stride(2) != 1:
        raise ValueError("the activations and the expert weights need contiguous rows")
    grid = (block_experts.numel(), triton.cdiv(out_features, _BLOCK_N))
    _kernel(a.device.type == "cpu")[grid](
        a,
        weights,
        out,
        pair_ids,
        block_experts,
        pair_weights if pair_weights is not None else out,  # unread without the scale
        num_pairs,
        a.stride(0),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        N=out_features,
        K=in_features,
        PAIRS_PER_A_ROW=pairs_per_a_row,
        SCALE_BY_PAIR_WEIGHT=pair_weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return out


def fused_moe(
    normed: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """``moe(normed)`` ``[tokens, hidden]``: each token's ``experts`` ``[tokens, top_k]``
    SwiGLU experts (``gate_up`` ``[experts, 2 * inner, hidden]``, ``down`` ``[experts,
    hidden, inner]``), weighted by ``weights`` ``[tokens, top_k]`` and summed."""
    if not triton_layer_ops.available(normed.device):
        raise RuntimeError(
            f"the Triton MoE kernel does not run on {normed.device} here (no triton, or CPU "
            "tensors without TRITON_INTERPRET=1): use layers.moe's expert loop"
        )
    tokens, top_k = experts.shape
    num_pairs = tokens * top_k
    if not num_pairs:
        return torch.zeros_like(normed)
    pair_ids, block_experts = expert_blocks(experts, gate_up.shape[0])
    projected = _grouped_matmul(
        normed, gate_up, pair_ids, block_experts, num_pairs, top_k, pair_weights=None
    )
    activated = triton_layer_ops.silu_times_up(projected)
    scaled = _grouped_matmul(
        activated,
        down,
        pair_ids,
        block_experts,
        num_pairs,
        1,
        pair_weights=weights.reshape(-1).contiguous(),
    )
    return scaled.view(tokens, top_k, -1).sum(dim=1)
