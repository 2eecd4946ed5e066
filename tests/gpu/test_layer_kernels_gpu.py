"""GPU checks of the Triton layer kernels (``triton_layer_ops``, ``triton_prefill``) compiled,
on Llama shapes, against the torch code they replace (skipped, with the reason, without CUDA).
CI runs the same kernels in Triton's interpreter (tests/unit/test_triton_layer_kernels.py)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn import functional

from dpserve.engine.kernels import triton_layer_ops, triton_prefill
from dpserve.engine.layers.attention import prefill_attention
from tests.unit.test_triton_layer_kernels import rotated_by_torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: the compiled Triton kernels"
)

TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 5e-2, "atol": 2e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 64), (32, 8, 128)])
def test_rotate_and_write_equals_torch_on_cuda(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(head_dim)
    tokens, block_size, blocks = 300, 16, 64
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device="cuda").to(dtype)
    angles = torch.rand(2048, head_dim // 2, device="cuda") * 6.3
    rotation = torch.polar(torch.ones_like(angles), angles).unsqueeze(1)
    positions = torch.randint(0, 2048, (tokens,), device="cuda")
    slots = torch.randperm(blocks * block_size, device="cuda")[:tokens]
    kv_pair = torch.randn(2, blocks, block_size, kv_heads, head_dim, device="cuda").to(dtype)
    expected_qkv, expected_kv = rotated_by_torch(
        qkv, rotation, positions, slots, kv_pair, heads, kv_heads
    )
    triton_layer_ops.rotate_and_write_kv(
        qkv, rotation, positions, slots, kv_pair, heads, kv_heads, head_dim
    )
    # Both round an fp32 rotation once; at most one unit of the last place apart (FMA).
    ulp = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0}
    torch.testing.assert_close(qkv[:, :q_size], expected_qkv[:, :q_size], **ulp)
    torch.testing.assert_close(kv_pair, expected_kv, **ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_times_up_equals_torch_on_cuda(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(257, 2 * 8192, device="cuda") * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = functional.silu(gate).mul_(up)
    # bf16: SiLU and the product each rounded once, as torch does; an exp that differs in
    # its last fp32 bit can move either rounding by one unit.
    ulp = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 1e-5}
    torch.testing.assert_close(triton_layer_ops.silu_times_up(gate_up), expected, **ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_prefill_equals_the_reference_on_cuda(dtype: torch.dtype, head_dim: int) -> None:
    heads, kv_heads, block_size = 32, 8, 16
    rng = random.Random(head_dim)
    torch.manual_seed(head_dim)
    # A step's worth: fresh prompts, chunks after cached prefixes, one-token chunks, 512s.
    chunks = [(0, 512), (0, 37), (300, 212), (16, 1), (0, 1), (129, 200), (0, 250), (1000, 64)]
    contexts = [c + n for c, n in chunks]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 8
    kv_pair = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device="cuda").to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    slots: list[int] = []
    cached_blocks: list[torch.Tensor | None] = []
    sequences = []
    for cached, length in chunks:
        blocks = [free.pop() for _ in range(-(-(cached + length) // block_size))]
        table = torch.tensor(blocks, device="cuda")
        positions = torch.arange(cached + length, device="cuda")
        context_slots = table[positions // block_size] * block_size + positions % block_size
        flat = kv_pair.view(2, -1, kv_heads, head_dim)
        sequences.append(
            (flat[0, context_slots].float().cpu(), flat[1, context_slots].float().cpu())
        )
        slots += context_slots[cached:].tolist()
        cached_blocks.append(table if cached else None)
    total = sum(n for _, n in chunks)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    query = qkv[:, : heads * head_dim].view(total, heads, head_dim)
    layout = triton_prefill.varlen_layout(
        [n for _, n in chunks],
        [c for c, _ in chunks],
        cached_blocks,
        torch.tensor(slots, device="cuda"),
        block_size,
    )
    scale = head_dim**-0.5
    out = triton_prefill.varlen_prefill_attention_triton(query, kv_pair, layout, scale)
    offset = 0
    for (keys, values), (_, length) in zip(sequences, chunks, strict=True):
        rows = query[offset : offset + length].float().cpu()
        expected = prefill_attention(rows, keys, values, scale)
        got = out[offset : offset + length].view(length, heads, head_dim).float().cpu()
        torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
        offset += length
