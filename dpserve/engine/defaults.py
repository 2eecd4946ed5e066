"""The engine's tuning defaults, importable without torch (the CLI's flags show them)."""

from __future__ import annotations

from typing import Final

DEFAULT_BLOCK_SIZE: Final = 16  # tokens per KV cache block
# Block 0 of the pool is never handed out: padding entries of a block table, and the slots that
# padded rows of a CUDA graph write to, point at it harmlessly.
RESERVED_BLOCKS: Final = 1
DEFAULT_CPU_KV_CACHE_BYTES: Final = 1024**3  # the KV pool on CPU unless --kv-cache-bytes
DEFAULT_GPU_MEMORY_UTILIZATION: Final = 0.9
# Tokens one step computes. On CPU a forward is compute bound well below 512 tokens, so a
# larger step only stalls the running requests (and the engine's heartbeats) for longer.
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = {"cpu": 512, "cuda": 8192}
# Sequences running at once (an engine's capacity): the fake runner's, and the most the paged
# backend derives from its pool (the largest CUDA graph bucket).
DEFAULT_MAX_NUM_SEQS: Final = 256
# What a typical sequence is assumed to hold when max_num_seqs is derived from the pool.
TOKENS_PER_SEQUENCE: Final = 512
# Sequences running at once on the transformers fallback unless --max-num-seqs: its left-padded
# cache is not bounded by a pool, so it stays small.
DEFAULT_HF_MAX_NUM_SEQS: Final = 8


def default_max_num_batched_tokens(device_type: str) -> int:
    """Tokens one step computes on a device of this type unless --max-num-batched-tokens."""
    return DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu" if device_type == "cpu" else "cuda"]
