"""A step's attention over the paged cache: its layout, computed once per step for every layer,
and one layer's attention with it (decode rows in one call, the prefill chunks in one), by the
implementations ``kernel_choice`` picked (the torch ones are in ``attention``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dpserve.engine.kernels import cpu_kernels, triton_prefill
from dpserve.engine.layers.attention import (
    DecodeLayout,
    PrefillLayout,
    decode_layout,
    gathered_decode_attention,
    paged_decode_attention,
    prefill_layout,
    varlen_prefill_attention,
)
from dpserve.engine.layers.kernel_choice import KernelChoice


class PrefillChunk(Protocol):
    """One prefill chunk's rows in a step, as the layout reads them (``models.base.PrefillSlice``
    is one)."""

    @property
    def offset(self) -> int: ...  # first row of the chunk in the flattened tokens
    @property
    def length(self) -> int: ...
    @property
    def cached(self) -> int: ...  # tokens of the sequence already in the cache before it
    @property
    def blocks(self) -> torch.Tensor | None: ...  # block ids covering cached + length


@dataclass(slots=True)
class AttentionLayout:
    """What a step's attention reads besides the queries and the pool, computed once per step:
    the decode rows' tables and lengths, the prefill chunks' layout."""

    num_decodes: int
    block_tables: torch.Tensor | None
    seq_lens: torch.Tensor | None
    decode: DecodeLayout | None  # None: no decode rows, or a kernel reads the tables
    prefill: PrefillLayout | triton_prefill.VarlenPrefillLayout | None


class StepAttention:
    """Attention of ``num_heads`` query heads over ``num_kv_heads`` cached heads."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kernels: KernelChoice,
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.q_size = num_heads * head_dim
        self.scale = head_dim**-0.5
        self.dtype = dtype
        self.kernels = kernels

    def layout(
        self,
        num_decodes: int,
        block_tables: torch.Tensor | None,
        seq_lens: torch.Tensor | None,
        chunks: Sequence[PrefillChunk],
        slot_mapping: torch.Tensor,
        block_size: int,
    ) -> AttentionLayout:
        decode = None
        prefill: PrefillLayout | triton_prefill.VarlenPrefillLayout | None = None
        glue, decodes = self.kernels.glue, num_decodes
        if decodes and self.kernels.decode_attention != "triton" and glue != "cpu":
            assert block_tables is not None and seq_lens is not None
            decode = decode_layout(block_tables, seq_lens, block_size, self.dtype)
        if chunks and self.kernels.triton_layers:
            prefill = triton_prefill.varlen_layout(
                lengths=[chunk.length for chunk in chunks],
                cached=[chunk.cached for chunk in chunks],
                cached_blocks=[chunk.blocks for chunk in chunks],
                slot_mapping=slot_mapping[decodes:],
                block_size=block_size,
            )
        elif chunks:
            prefill = prefill_layout(
                offsets=[chunk.offset - decodes for chunk in chunks],
                lengths=[chunk.length for chunk in chunks],
                cached=[chunk.cached for chunk in chunks],
                cached_blocks=[chunk.blocks for chunk in chunks],
                slot_mapping=slot_mapping[decodes:],
                block_size=block_size,
                group=self.group,
                dtype=self.dtype,
            )
        return AttentionLayout(decodes, block_tables, seq_lens, decode, prefill)

    def __call__(
        self, qkv: torch.Tensor, kv_pair: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor:
        """``[tokens, num_heads * head_dim]`` for the queries at the front of ``qkv``."""
        query = qkv[:, : self.q_size].view(qkv.shape[0], self.num_heads, self.head_dim)
        decodes = layout.num_decodes
        parts = []
        if decodes:
            parts.append(self._decode(query[:decodes], kv_pair, layout))
        if isinstance(layout.prefill, triton_prefill.VarlenPrefillLayout):
            parts.append(
                triton_prefill.varlen_prefill_attention_triton(
                    query[decodes:], kv_pair, layout.prefill, self.scale
                )
            )
        elif layout.prefill is not None:
            parts.append(
                varlen_prefill_attention(query[decodes:], kv_pair, layout.prefill, self.scale)
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(
        self, query: torch.Tensor, kv_pair: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor:
        if layout.decode is not None:
            return gathered_decode_attention(query, kv_pair, layout.decode, self.scale)
        assert layout.block_tables is not None and layout.seq_lens is not None
        if self.kernels.glue == "cpu":
            return cpu_kernels.decode_attention(
                query, kv_pair, layout.block_tables, layout.seq_lens, self.scale
            )
        out = paged_decode_attention(
            query, kv_pair[0], kv_pair[1], layout.block_tables, layout.seq_lens, self.scale
        )
        return out.reshape(query.shape[0], self.q_size)

    def warm_up(
        self, block_size: int, device: torch.device, max_batch: int, max_blocks: int
    ) -> None:
        """Compile the Triton decode kernel's variants a run can hit (CUDA only)."""
        if self.kernels.decode_attention != "triton":
            return
        from dpserve.engine.kernels import triton_decode

        triton_decode.warm_up(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            block_size,
            self.dtype,
            device,
            max_batch,
            max_blocks,
        )
