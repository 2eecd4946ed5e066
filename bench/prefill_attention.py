"""A step's prefill attention on a GPU: the Triton varlen kernel against the torch path it
replaced (issue 16: a padded gather of every chunk's context plus a masked SDPA call).

    python bench/prefill_attention.py            # 1B and 8B heads, on CUDA

Each case is one step's worth of prefill chunks (8,192 tokens, the CUDA default of
``max_num_batched_tokens``) in the engine's KV layout, blocks shuffled over the pool, bf16. It
prints the median time of one layer's attention (``triton.testing.do_bench``) for the torch path
(``paged_attention.prefill_layout`` + ``varlen_prefill_attention``, its layout built once as the
model does per step) and for each ``PrefillLaunch`` of the Triton kernel, with the largest
difference between the two (a fast and wrong variant shows here).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_gpu import SHAPES
from dpserve.engine.kernels.triton_prefill import (
    GPU_LAUNCH,
    GPU_LAUNCH_WIDE_HEADS,
    PrefillLaunch,
    varlen_layout,
    varlen_prefill_attention_triton,
)
from dpserve.engine.layers.attention import prefill_layout, varlen_prefill_attention

BLOCK_SIZE = 16
LAUNCHES = [
    GPU_LAUNCH,
    GPU_LAUNCH_WIDE_HEADS,
    PrefillLaunch(rows=128, tokens=32, num_warps=4, num_stages=2),
    PrefillLaunch(rows=128, tokens=64, num_warps=4, num_stages=3),
    PrefillLaunch(rows=128, tokens=128, num_warps=8, num_stages=2),
]


def chunks_of_a_step(tokens: int, cached_share: float, seed: int) -> list[tuple[int, int]]:
    """(cached, length) per chunk: prompts of 32-512 tokens until the step is full; a share of
    them come after a cached prefix of up to 1,000 tokens."""
    rng = random.Random(seed)
    chunks: list[tuple[int, int]] = []
    left = tokens
    while left > 0:
        length = min(left, rng.randint(32, 512))
        cached = rng.randint(16, 1000) if rng.random() < cached_share else 0
        chunks.append((cached, length))
        left -= length
    return chunks


def bench_case(name: str, cached_share: float) -> None:
    import triton.testing

    shape = SHAPES[name]
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.hidden // shape.heads
    chunks = chunks_of_a_step(8192, cached_share, seed=len(name))
    contexts = [c + n for c, n in chunks]
    num_blocks = sum(-(-c // BLOCK_SIZE) for c in contexts) + 8
    kv_pair = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device="cuda").bfloat16()
    free = list(range(1, num_blocks))
    random.Random(1).shuffle(free)
    slots: list[int] = []
    tables: list[torch.Tensor | None] = []
    for cached, length in chunks:
        table = torch.tensor([free.pop() for _ in range(-(-(cached + length) // BLOCK_SIZE))])
        positions = torch.arange(cached, cached + length)
        slots += (table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).tolist()
        tables.append(table.cuda() if cached else None)
    total = sum(n for _, n in chunks)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, device="cuda").bfloat16()
    query = qkv[:, : heads * head_dim].view(total, heads, head_dim)
    slot_mapping = torch.tensor(slots, device="cuda")
    lengths, cached = [n for _, n in chunks], [c for c, _ in chunks]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    padded = prefill_layout(
        offsets, lengths, cached, tables, slot_mapping, BLOCK_SIZE, heads // kv_heads, qkv.dtype
    )
    packed = varlen_layout(lengths, cached, tables, slot_mapping, BLOCK_SIZE)
    scale = head_dim**-0.5
    reference = varlen_prefill_attention(query, kv_pair, padded, scale)
    torch_ms = triton.testing.do_bench(
        lambda: varlen_prefill_attention(query, kv_pair, padded, scale)
    )
    print(
        f"== {name} heads ({heads}/{kv_heads} x {head_dim}), {len(chunks)} chunks, {total} "
        f"tokens, {sum(1 for c in cached if c)} after a cached prefix"
    )
    print(f"   torch (padded gather + masked SDPA): {torch_ms * 1e3:8.1f} us per layer")
    for launch in LAUNCHES:
        out = varlen_prefill_attention_triton(query, kv_pair, packed, scale, launch)
        error = float((out.float() - reference.float()).abs().max())
        ms = triton.testing.do_bench(
            lambda launch=launch: varlen_prefill_attention_triton(
                query, kv_pair, packed, scale, launch
            )
        )
        print(
            f"   triton {launch}: {ms * 1e3:8.1f} us ({torch_ms / ms:.1f}x faster), "
            f"max |diff| {error:.3g}"
        )


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in ("1b", "8b"):
        for share in (0.0, 0.5):
            bench_case(name, share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
