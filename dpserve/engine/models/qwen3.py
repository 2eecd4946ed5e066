"""Qwen3 (dense): the Llama layer with an RMSNorm on every query and key head before RoPE.

The q/k norm weights are ``[head_dim]`` vectors over a head's dimensions in transformers'
order; our projections put those dimensions in RoPE pair order (``layers.rotary``), so the
weights are reordered alike at load (``rotary.in_pair_order``) — a norm over a head is the same
sum in any order, only the weight has to follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpserve.engine.layers.norm import head_norm_
from dpserve.engine.layers.rotary import in_pair_order
from dpserve.engine.models.llama import LlamaLayer, PagedLlama


@dataclass(slots=True)
class Qwen3Layer(LlamaLayer):
    q_norm: torch.Tensor  # [head_dim], in RoPE pair order
    k_norm: torch.Tensor


class PagedQwen3(PagedLlama):
    """Qwen3's weights and forward: ``PagedLlama`` plus the per-head q/k norm."""

    def convert_layer(self, layer: Any) -> Qwen3Layer:
        base = super().convert_layer(layer)
        attention = layer.self_attn
        return Qwen3Layer(
            input_norm=base.input_norm,
            qkv=base.qkv,
            o_proj=base.o_proj,
            post_norm=base.post_norm,
            mlp=base.mlp,
            q_norm=in_pair_order(attention.q_norm.weight.detach()),
            k_norm=in_pair_order(attention.k_norm.weight.detach()),
        )

    def before_rotary(self, layer: Any, qkv: torch.Tensor) -> None:
        rows = qkv.shape[0]
        queries = qkv[:, : self.q_size].view(rows, self.num_heads, self.head_dim)
        keys = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            rows, self.num_kv_heads, self.head_dim
        )
        head_norm_(queries, layer.q_norm, self.eps)
        head_norm_(keys, layer.k_norm, self.eps)
