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
what CPU runs and what the GPU kernels are tested against.
"""

from __future__ import annotations

import torch


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
