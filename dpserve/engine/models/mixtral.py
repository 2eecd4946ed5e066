"""Mixtral: the Llama layer (Mistral's attention, no sliding window) with a mixture of experts in
place of the MLP on every layer: ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts
per token, the router's weights always renormalised over the chosen ones (``layers.moe``).
"""

from __future__ import annotations

from typing import Any

from dpserve.engine.layers.moe import SparseMoE
from dpserve.engine.models.llama import PagedLlama
from dpserve.engine.models.qwen3_moe import moe_unsupported_reason


class PagedMixtral(PagedLlama):
    """Mixtral's weights and forward: ``PagedLlama`` with ``SparseMoE`` blocks."""

    unsupported_reason = staticmethod(moe_unsupported_reason)
    invariant_feed_forward = False  # fp32 expert products (PagedLlama)

    def convert_mlp(self, mlp: Any) -> SparseMoE:
        return SparseMoE(
            mlp, int(self.config.num_experts_per_tok), renormalize=True, kernels=self.kernels
        )
