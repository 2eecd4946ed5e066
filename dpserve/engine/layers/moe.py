"""Mixture of experts (Qwen3-MoE, Mixtral): a softmax router picks ``top_k`` of the experts for
each token, their weights renormalised to sum to one where the model says so, and each expert is
a SwiGLU MLP.

CPU path: the step's (token, expert) pairs are sorted by expert, and each active expert runs
one matmul over its tokens; the outputs, scaled by the router's weights, are added back per
token in expert order, which is transformers' order, so the sums are the same. It reads each
expert's token count on the host.

CUDA path (where the glue is Triton, ``kernel_choice``): ``kernels.triton_moe``, two grouped
matmuls over the expert-sorted pairs with nothing read on the host, so CUDA graphs hold it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from dpserve.engine.kernels import triton_moe
from dpserve.engine.layers.kernel_choice import KernelChoice


class SparseMoE:
    """A MoE block's router and stacked expert weights (``gate_up`` ``[experts, 2 * inner,
    hidden]``, ``down`` ``[experts, hidden, inner]``), taken from transformers' block."""

    def __init__(self, block: Any, top_k: int, renormalize: bool, kernels: KernelChoice) -> None:
        self.router = block.gate.weight.detach()  # [experts, hidden]
        self.gate_up = block.experts.gate_up_proj.detach()
        self.down = block.experts.down_proj.detach()
        self.num_experts = int(self.router.shape[0])
        self.top_k = top_k
        self.renormalize = renormalize
        self.fused = kernels.triton_layers

    def route(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts ``[tokens, top_k]`` and their weights (softmax in
        fp32, renormalised over the chosen ones if the model says so, in the model's dtype)."""
        probabilities = torch.softmax(functional.linear(normed, self.router), -1, torch.float)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(normed.dtype)

    def plus(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + moe(normed)``."""
        experts, weights = self.route(normed)
        if self.fused:
            return residual + triton_moe.fused_moe(
                normed, experts, weights, self.gate_up, self.down
            )
        pairs = experts.reshape(-1)
        order = torch.argsort(pairs, stable=True)  # (token, choice) pairs grouped by expert
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
        out = torch.zeros_like(normed)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = slice(start, start + count)
            start += count
            hidden = normed.index_select(0, tokens[rows])
            gate, up = functional.linear(hidden, self.gate_up[expert]).chunk(2, dim=-1)
            expert_out = functional.linear(functional.silu(gate) * up, self.down[expert])
            out.index_add_(0, tokens[rows], expert_out * pair_weights[rows])
        return residual + out
