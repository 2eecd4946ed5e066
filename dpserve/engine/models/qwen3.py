"""Qwen3 (dense): the Llama layer with an RMSNorm on every query and key head before RoPE.

The q/k norm weights are ``[head_dim]`` vectors over a head's dimensions in transformers'
order; our projections put those dimensions in RoPE pair order (``layers.rotary``), so the
weights are reordered alike at load (``rotary.in_pair_order``) — a norm over a head is the same
sum in any order, only the weight has to follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpserve.engine.layers.rotary import HeadNorms, in_pair_order
from dpserve.engine.models.llama import LlamaLayer, PagedLlama


@dataclass(slots=True)
class Qwen3Layer(LlamaLayer):
    norms: HeadNorms  # weights in RoPE pair order


class PagedQwen3(PagedLlama):
    """Qwen3's weights and forward: ``PagedLlama`` plus the per-head q/k norm (fused into the
    RoPE kernel where the glue is Triton, ``layers.rotary``)."""

    def convert_layer(self, layer: Any) -> Qwen3Layer:
        base = super().convert_layer(layer)
        attention = layer.self_attn
        return Qwen3Layer(
            input_norm=base.input_norm,
            qkv=base.qkv,
            o_proj=base.o_proj,
            post_norm=base.post_norm,
            mlp=base.mlp,
            norms=HeadNorms(
                query=in_pair_order(attention.q_norm.weight.detach()),
                key=in_pair_order(attention.k_norm.weight.detach()),
                eps=self.eps,
            ),
        )

    def head_norms(self, layer: Any) -> HeadNorms:
        return layer.norms  # type: ignore[no-any-return]
