"""A step's attention over the paged cache: its layout, computed once per step for every layer,
and one layer's attention with it (decode rows in one call, the prefill chunks in one), by the
implementations ``kernel_choice`` picked (the torch ones are in ``attention``).

``batch_invariant`` (CPU kernels only): every row's attention is computed as a decode row's, by
``cpu_kernels.decode_attention`` over its own prefix with parts that depend on its length alone,
so that a token's output is the same bits whether a prompt chunk or a decode step computed it,
and whatever else rode the step. A model asks for it where its projections round activations to
bf16 (``weight_format``): there a difference of one unit in the last place before a rounding can
become a whole bf16 step after it, and a resumed stream (its tokens prefilled anew on another
engine) then parts from the uninterrupted one at a near tie; with every step's arithmetic the
same per row it cannot. SDPA's prefill sums in another order than the decode kernel."""

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


@dataclass(frozen=True, slots=True)
class RowwisePrefillLayout:
    """The prefill chunks' rows as decode rows (``batch_invariant``): each row's table is its
    chunk's blocks, its length its position plus one."""

    block_tables: torch.Tensor  # [prefill tokens, width] int32
    seq_lens: torch.Tensor  # [prefill tokens] int32


def rowwise_prefill_layout(
    chunks: Sequence[PrefillChunk], slot_mapping: torch.Tensor, block_size: int
) -> RowwisePrefillLayout:
    """``chunks``' rows as decode rows; ``slot_mapping`` holds the slots of the chunks' own
    tokens (``[prefill tokens]``, in row order), whose blocks are the table of a chunk with
    nothing cached before it (a chunk starting at position 0 starts a block)."""
    tables, lengths = [], []
    width = max(-(-(chunk.cached + chunk.length) // block_size) for chunk in chunks)
    row = 0
    for chunk in chunks:
        blocks = chunk.blocks
        if blocks is None:
            assert chunk.cached == 0
            blocks = slot_mapping[row : row + chunk.length : block_size] // block_size
        table = torch.zeros(width, dtype=torch.int32, device=slot_mapping.device)
        table[: blocks.numel()] = blocks
        tables.append(table.expand(chunk.length, width))
        lengths.append(
            torch.arange(chunk.cached + 1, chunk.cached + chunk.length + 1, dtype=torch.int32)
        )
        row += chunk.length
    return RowwisePrefillLayout(torch.cat(tables), torch.cat(lengths).to(slot_mapping.device))


@dataclass(slots=True)
class AttentionLayout:
    """What a step's attention reads besides the queries and the pool, computed once per step:
    the decode rows' tables and lengths, the prefill chunks' layout."""

    num_decodes: int
    block_tables: torch.Tensor | None
    seq_lens: torch.Tensor | None
    decode: DecodeLayout | None  # None: no decode rows, or a kernel reads the tables
    prefill: PrefillLayout | triton_prefill.VarlenPrefillLayout | RowwisePrefillLayout | None


class StepAttention:
    """Attention of ``num_heads`` query heads over ``num_kv_heads`` cached heads."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kernels: KernelChoice,
        *,
        batch_invariant: bool = False,
    ) -> None:
        if batch_invariant and kernels.glue != "cpu":
            raise ValueError("batch-invariant attention runs on the CPU kernels only")
        self.batch_invariant = batch_invariant
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
        prefill: PrefillLayout | triton_prefill.VarlenPrefillLayout | RowwisePrefillLayout | None
        prefill = None
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
        elif chunks and self.batch_invariant:
            prefill = rowwise_prefill_layout(chunks, slot_mapping[decodes:], block_size)
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
        elif isinstance(layout.prefill, RowwisePrefillLayout):
            parts.append(
                cpu_kernels.decode_attention(
                    query[decodes:],
                    kv_pair,
                    layout.prefill.block_tables,
                    layout.prefill.seq_lens,
                    self.scale,
                    batch_invariant=True,
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
                query,
                kv_pair,
                layout.block_tables,
                layout.seq_lens,
                self.scale,
                batch_invariant=self.batch_invariant,
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
