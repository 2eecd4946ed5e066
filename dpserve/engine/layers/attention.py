"""Attention over the paged KV cache: the layout, and the plain-torch reference.

Layout (one pair of tensors per layer):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; block 0 is
  never handed out, so padding entries of a block table may point at it harmlessly.
* ``block_tables``: int32 ``[batch, max_blocks_per_sequence]``; row ``b`` lists the blocks of
  sequence ``b`` in order: its token ``t`` lives in block ``block_tables[b, t // block_size]``
  at offset ``t % block_size``.
* ``seq_lens``: int32 ``[batch]``; how many tokens of each sequence are in the cache, the
  current one included (its key and value are written before attention runs).
* ``query``: ``[batch, num_heads, head_dim]`` for decode (one new token a sequence); query head
  ``h`` reads key/value head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).

The reference gathers each sequence's keys and values and runs a plain softmax in float32: it is
what the GPU kernels are tested against. ``paged_decode_attention`` is what the model calls: the
Triton kernel (``dpserve.engine.kernels.triton_decode``) for CUDA tensors when it imports, else
``paged_decode_attention_gathered``, the same computation vectorized over the batch (one gather
of every row's blocks, padded to the block table's width and masked by ``seq_lens``) with no
host synchronisation, so it is CPU-fast and can be captured in a CUDA graph.

``prefill_attention`` is a chunk of one sequence's prompt attending to itself (causally) and to
the sequence's tokens already in the cache, with SDPA; on CUDA only its flash and
memory-efficient backends are allowed (the cuDNN backend rebuilds an execution plan whenever a
length changes, milliseconds of CPU per call).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

log = logging.getLogger(__name__)

DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[batch, num_heads, head_dim]`` attention output for one new token per sequence."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    lengths = seq_lens.tolist()
    for row in range(batch):
        length = lengths[row]
        blocks = block_tables[row, : (length + block_size - 1) // block_size].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        keys = keys.float().repeat_interleave(group, dim=1)  # [length, num_heads, head_dim]
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[row].float(), keys) * scale
        weights = torch.softmax(scores, dim=-1)
        out[row] = torch.einsum("hl,lhd->hd", weights, values).to(query.dtype)
    return out


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """Where each decode row's keys are, computed once per step for every layer.

    ``blocks`` lists every row's block-table entries (``[batch * width]`` int64: the rows of
    the pool to gather); ``bias`` is 0 for the tokens of a row and -inf for the padding of its
    table row past its length (``[batch, 1, 1, width * block_size]`` in the model's dtype)."""

    blocks: torch.Tensor
    bias: torch.Tensor
    batch: int
    span: int  # width * block_size


def decode_layout(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, dtype: torch.dtype
) -> DecodeLayout:
    batch, width = block_tables.shape
    span = width * block_size
    within = torch.arange(span, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    bias = torch.zeros(within.shape, dtype=dtype, device=seq_lens.device)
    bias.masked_fill_(~within, float("-inf"))
    return DecodeLayout(block_tables.reshape(-1).long(), bias[:, None, None, :], batch, span)


def gathered_decode_attention(
    query: torch.Tensor, kv_pair: torch.Tensor, layout: DecodeLayout, scale: float
) -> torch.Tensor:
    """``[batch, num_heads * head_dim]`` decode attention of ``query`` ``[batch, num_heads,
    head_dim]`` over ``kv_pair`` (a layer's keys and values stacked, ``[2, num_blocks,
    block_size, num_kv_heads, head_dim]``).

    Keys and values of every row's table come in one ``index_select`` of whole blocks (a
    memcpy per block, several times faster than advanced indexing); grouped-query attention
    puts the query heads that share a KV head on SDPA's query-length axis (a free view), so
    K and V are never repeated per query head."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_pair.shape[3]
    group = num_heads // num_kv_heads
    gathered = kv_pair.index_select(1, layout.blocks)
    keys = gathered[0].view(batch, layout.span, num_kv_heads, head_dim).transpose(1, 2)
    values = gathered[1].view(batch, layout.span, num_kv_heads, head_dim).transpose(1, 2)
    out = scaled_dot_product_attention(
        query.view(batch, num_kv_heads, group, head_dim),
        keys,
        values,
        attn_mask=layout.bias,
        scale=scale,
    )
    return out.reshape(batch, num_heads * head_dim)


def paged_decode_attention_gathered(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The reference's result for the whole batch at once (``gathered_decode_attention`` over
    separate key and value caches): every row reads all the blocks of its table row and masks
    the positions past its length."""
    layout = decode_layout(block_tables, seq_lens, k_cache.shape[1], query.dtype)
    out = gathered_decode_attention(query, torch.stack((k_cache, v_cache)), layout, scale)
    return out.view(query.shape)


@functools.cache
def _triton_kernel() -> DecodeAttention | None:
    try:
        from dpserve.engine.kernels.triton_decode import paged_decode_attention_triton
    except Exception as exc:  # not written yet, no Triton in this build, no compiler ...
        log.warning("Triton decode attention unavailable (%s): using the torch version", exc)
        return None
    return paged_decode_attention_triton


def decode_attention_backend(device: torch.device) -> str:
    """Which implementation ``paged_decode_attention`` uses for tensors on ``device``."""
    return "triton" if device.type == "cuda" and _triton_kernel() is not None else "torch"


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the paged cache (layout above): Triton on CUDA, torch elsewhere."""
    kernel = _triton_kernel() if query.is_cuda else None
    implementation = kernel or paged_decode_attention_gathered
    return implementation(query, k_cache, v_cache, block_tables, seq_lens, scale)


@contextlib.contextmanager
def _prefill_backends(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        yield


def prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[length, num_heads, head_dim]`` attention of a chunk of ``length`` tokens to the
    ``keys``/``values`` ``[cached + length, num_kv_heads, head_dim]`` of its sequence (the
    chunk's own last): token ``i`` of the chunk sees cached tokens and chunk tokens ``<= i``."""
    length, num_heads, _ = query.shape
    total, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, length, dim]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    mask = None
    if total > length:  # SDPA's is_causal aligns the diagonal top-left: state the offset
        rows = torch.arange(length, device=query.device).unsqueeze(1) + (total - length)
        mask = torch.arange(total, device=query.device).unsqueeze(0) <= rows
    with _prefill_backends(query.device):
        out = scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
        )
    return out.squeeze(0).transpose(0, 1)


@dataclass(frozen=True, slots=True)
class PrefillLayout:
    """A step's prefill chunks padded into one batch, computed once per step for every layer.

    Chunk ``c`` has ``lengths[c]`` query rows and a context of ``cached[c] + lengths[c]``
    tokens (its sequence's cached tokens, then its own). Padded to ``max_length`` query rows
    and ``max_context`` context tokens, every chunk is one item of one SDPA call."""

    query_rows: torch.Tensor  # [chunks * max_length]: a row of the step's prefill queries
    context_slots: torch.Tensor  # [chunks * max_context]: pool slots (padding: slot 0)
    bias: torch.Tensor  # [chunks, 1, group * max_length, max_context]: 0 or -inf
    output_rows: torch.Tensor  # [prefill tokens]: rows of the padded output, in step order
    chunks: int
    max_length: int
    max_context: int


def prefill_layout(
    offsets: list[int],
    lengths: list[int],
    cached: list[int],
    cached_blocks: list[torch.Tensor | None],
    slot_mapping: torch.Tensor,
    block_size: int,
    group: int,
    dtype: torch.dtype,
) -> PrefillLayout:
    """The layout of chunks whose queries start at ``offsets`` (rows of the step's prefill
    queries) with ``lengths`` rows each and ``cached`` tokens already in the pool, in the
    blocks ``cached_blocks`` (None when nothing is cached); ``slot_mapping`` holds the slots
    the chunks' own keys were written to (``[prefill tokens]``, in row order)."""
    device = slot_mapping.device
    count, max_length = len(lengths), max(lengths)
    totals = [done + length for done, length in zip(cached, lengths, strict=True)]
    max_context = max(totals)
    query_rows: list[int] = []
    output_rows: list[int] = []
    limits: list[int] = []  # the last context token each padded query row may see
    pieces: list[torch.Tensor] = []
    within_block = torch.arange(block_size, device=device)
    for chunk in range(count):
        offset, length, done = offsets[chunk], lengths[chunk], cached[chunk]
        query_rows += [offset + row for row in range(length)] + [offset] * (max_length - length)
        output_rows += range(chunk * max_length, chunk * max_length + length)
        # Padding rows see what the chunk's last row sees: finite scores, output dropped.
        limits += [done + min(row, length - 1) for row in range(max_length)]
        blocks = cached_blocks[chunk]
        if done:
            assert blocks is not None
            slots = blocks.long().unsqueeze(1) * block_size + within_block
            pieces.append(slots.reshape(-1)[:done])
        pieces.append(slot_mapping[offset : offset + length])
        if totals[chunk] < max_context:
            pieces.append(slot_mapping.new_zeros(max_context - totals[chunk]))
    limit = torch.tensor(limits, dtype=torch.long).to(device).view(count, 1, max_length, 1)
    visible = torch.arange(max_context, device=device) <= limit
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    bias.masked_fill_(~visible, float("-inf"))
    return PrefillLayout(
        query_rows=torch.tensor(query_rows, dtype=torch.long).to(device),
        context_slots=torch.cat(pieces),
        # Row r of the grouped query layout (varlen_prefill_attention) is query row
        # r % max_length of its chunk: the mask repeats once per query head of a group.
        bias=bias.repeat(1, 1, group, 1),
        output_rows=torch.tensor(output_rows, dtype=torch.long).to(device),
        chunks=count,
        max_length=max_length,
        max_context=max_context,
    )


def varlen_prefill_attention(
    query: torch.Tensor, kv_pair: torch.Tensor, layout: PrefillLayout, scale: float
) -> torch.Tensor:
    """``[tokens, num_heads * head_dim]``: every prefill chunk of a step in one attention call.

    ``query`` is ``[tokens, num_heads, head_dim]`` (the chunks' rows, one after another);
    ``kv_pair`` a layer's keys and values stacked (``[2, num_blocks, block_size,
    num_kv_heads, head_dim]``), the chunks' own keys and values already written. Same result
    as ``prefill_attention`` chunk by chunk. Grouped-query attention puts a KV head's query
    heads on SDPA's query axis (``[chunks, kv_heads, group * max_length, dim]``), so keys and
    values are gathered once and never repeated per query head."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_pair.shape[3]
    group = num_heads // num_kv_heads
    count, length, context = layout.chunks, layout.max_length, layout.max_context
    padded = query.index_select(0, layout.query_rows).view(
        count, length, num_kv_heads, group, head_dim
    )
    grouped = padded.permute(0, 2, 3, 1, 4).reshape(count, num_kv_heads, group * length, head_dim)
    gathered = kv_pair.view(2, -1, num_kv_heads, head_dim).index_select(1, layout.context_slots)
    keys = gathered[0].view(count, context, num_kv_heads, head_dim).transpose(1, 2)
    values = gathered[1].view(count, context, num_kv_heads, head_dim).transpose(1, 2)
    with _prefill_backends(query.device):
        out = scaled_dot_product_attention(
            grouped, keys, values, attn_mask=layout.bias, scale=scale
        )
    rows = out.view(count, num_kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
    return rows.reshape(count * length, num_heads * head_dim).index_select(0, layout.output_rows)
