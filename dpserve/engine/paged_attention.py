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
Triton kernel (``dpserve.engine.triton_decode``) for CUDA tensors when it imports, else
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


def paged_decode_attention_gathered(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The reference's result for the whole batch at once: every row reads all the blocks of
    its table row (``block_tables.shape[1]`` of them) and masks the positions past its length.
    SDPA reads the gathered keys through strides (no copy into a head-major layout), which on
    CPU is 3x faster than an einsum."""
    batch, _, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    span = block_tables.shape[1] * block_size
    index = block_tables.long()
    keys = k_cache[index].view(batch, span, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache[index].view(batch, span, num_kv_heads, head_dim).transpose(1, 2)
    within = torch.arange(span, device=query.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    out = scaled_dot_product_attention(
        query.unsqueeze(2),
        keys,
        values,
        attn_mask=within[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


@functools.cache
def _triton_kernel() -> DecodeAttention | None:
    try:
        from dpserve.engine.triton_decode import paged_decode_attention_triton
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
