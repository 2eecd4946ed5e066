"""The Triton paged decode-attention kernel on a GPU: launch variants against the bytes it must
read (issue 16: the kernel was 44 % of a 1B-shape decode step at 38 % of the copy bandwidth).

    python bench/decode_attention.py            # every variant, every case, on CUDA

Each case is a batch of sequences in the engine's KV layout (one ``[2, blocks, block_size,
kv_heads, head_dim]`` tensor, blocks shuffled over the pool) filled with random bf16 values.
For each ``SplitLaunch`` variant it prints the median time of one call (``triton.testing.
do_bench``), the share of the copy bandwidth it reaches (K and V read once: the floor), and
the largest difference from the plain-torch reference (a variant that is fast and wrong shows
here). The last lines name the fastest variant per case.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_gpu import SHAPES, LlamaShape
from dpserve.engine.kernels.triton_decode import (
    GPU_LAUNCH,
    SplitLaunch,
    paged_decode_attention_triton,
)
from dpserve.engine.layers.attention import paged_decode_attention_reference


@dataclass(frozen=True)
class Case:
    name: str
    shape: LlamaShape  # the model whose attention heads the case has
    batch: int
    context: int
    block_size: int = 16

    @property
    def heads(self) -> int:
        return self.shape.heads

    @property
    def kv_heads(self) -> int:
        return self.shape.kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.hidden // self.shape.heads

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * 2


CASES = (
    Case("1b batch 256 x 512", SHAPES["1b"], 256, 512),
    Case("8b batch 256 x 512", SHAPES["8b"], 256, 512),
    Case("8b batch 32 x 2048", SHAPES["8b"], 32, 2048),
    Case("8b batch 4 x 8192", SHAPES["8b"], 4, 8192),
)


def make_inputs(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device=device).manual_seed(0)
    blocks_each = -(-case.context // case.block_size)
    num_blocks = 1 + case.batch * blocks_each
    kv = torch.randn(
        (2, num_blocks, case.block_size, case.kv_heads, case.head_dim),
        generator=generator,
        device=device,
        dtype=torch.bfloat16,
    )
    order = torch.randperm(num_blocks - 1, generator=generator, device=device) + 1
    tables = order.view(case.batch, blocks_each).to(torch.int32)
    lengths = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
    query = torch.randn(
        (case.batch, case.heads, case.head_dim),
        generator=generator,
        device=device,
        dtype=torch.bfloat16,
    )
    return query, kv[0], kv[1], tables, lengths


def bandwidth(device: str) -> float:
    source = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    import triton.testing

    ms = triton.testing.do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * source.numel() / (ms * 1e-3)


def variants() -> list[SplitLaunch]:
    grid = itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
    return [SplitLaunch(tile, warps, stages) for tile, warps, stages in grid]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    import triton.testing

    copy = bandwidth(args.device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy / 1e9:,.0f} GB/s", flush=True)
    best: dict[str, tuple[float, SplitLaunch]] = {}
    for case in CASES:
        query, keys, values, tables, lengths = make_inputs(case, args.device)
        scale = case.head_dim**-0.5
        inputs = (query, keys, values, tables, lengths, scale)
        reference = paged_decode_attention_reference(
            query.float(), keys.float(), values.float(), tables, lengths, scale
        )
        print(f"== {case.name}: head_dim {case.head_dim}, {case.kv_bytes / 1e6:,.0f} MB of KV")
        for launch in variants():
            try:
                out = paged_decode_attention_triton(*inputs, launch=launch)
            except Exception as exc:  # a variant that does not compile (shared memory)
                print(f"   {launch}: failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            error = (out.float() - reference).abs().max().item()
            ms = triton.testing.do_bench(
                lambda launch=launch, inputs=inputs: paged_decode_attention_triton(
                    *inputs, launch=launch
                ),
                warmup=10,
                rep=50,
                return_mode="median",
            )
            share = case.kv_bytes / (ms * 1e-3) / copy
            marker = "  (default)" if launch == GPU_LAUNCH else ""
            print(
                f"   tile {launch.tile_tokens:3d} warps {launch.num_warps} stages "
                f"{launch.num_stages}: "
                f"{ms * 1e3:7.1f} us  {share:6.1%} of copy  max err {error:.3g}{marker}",
                flush=True,
            )
            if error < 0.05 and (case.name not in best or ms < best[case.name][0]):
                best[case.name] = (ms, launch)
    print("--- fastest ---")
    for name, (ms, launch) in best.items():
        print(f"{name}: {ms * 1e3:.1f} us {launch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
