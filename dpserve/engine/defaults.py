"""The engine's tuning defaults, importable without torch (the CLI's flags show them)."""

from __future__ import annotations

from typing import Final

DEFAULT_BLOCK_SIZE: Final = 16  # tokens per KV cache block
DEFAULT_CPU_KV_CACHE_BYTES: Final = 1024**3  # the KV pool on CPU unless --kv-cache-bytes
DEFAULT_GPU_MEMORY_UTILIZATION: Final = 0.9
# Tokens one step computes. On CPU a forward is compute bound well below 512 tokens, so a
# larger step only stalls the running requests (and the engine's heartbeats) for longer.
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = {"cpu": 512, "cuda": 8192}
DEFAULT_MAX_NUM_SEQS: Final = 256  # the largest CUDA graph bucket
# What a typical sequence is assumed to hold when the capacity is derived from the pool.
TOKENS_PER_SEQUENCE: Final = 512
# Sequences running at once on the transformers fallback unless --max-batch-size.
DEFAULT_HF_BATCH_SIZE: Final = 8
