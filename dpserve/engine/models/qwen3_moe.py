"""Qwen3-MoE: Qwen3's attention (per-head q/k norm) with a mixture of experts in place of the
MLP on the layers the config makes sparse (``layers.moe``); the other layers keep a dense MLP.
"""

from __future__ import annotations

from typing import Any

from dpserve.engine.layers.kernel_choice import uses_triton_layers
from dpserve.engine.layers.mlp import FeedForward
from dpserve.engine.layers.moe import SparseMoE
from dpserve.engine.models.llama import unsupported_reason
from dpserve.engine.models.qwen3 import PagedQwen3


def moe_unsupported_reason(model: Any) -> str | None:
    """Why ``PagedQwen3Moe`` cannot run ``model``, or None."""
    if model.device.type != "cpu" and not uses_triton_layers(model.device):
        # Off CPU only the fused Triton kernel runs the experts (the host-side expert loop
        # would sync every layer and no CUDA graph could hold it).
        return f"mixture of experts on {model.device.type} needs Triton"
    return unsupported_reason(model)


class PagedQwen3Moe(PagedQwen3):
    """Qwen3-MoE's weights and forward: ``PagedQwen3`` with ``SparseMoE`` blocks."""

    unsupported_reason = staticmethod(moe_unsupported_reason)
    invariant_feed_forward = False  # fp32 expert products (PagedLlama)

    def convert_mlp(self, mlp: Any) -> FeedForward:
        if not hasattr(mlp, "experts"):  # a dense layer (mlp_only_layers, decoder_sparse_step)
            return super().convert_mlp(mlp)
        config = self.config
        return SparseMoE(
            mlp, int(config.num_experts_per_tok), bool(config.norm_topk_prob), self.kernels
        )
