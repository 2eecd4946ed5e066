"""The gated MLP of the Llama family (SwiGLU)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.nn import functional

from dpserve.engine.kernels import triton_layer_ops
from dpserve.engine.layers.kernel_choice import KernelChoice
from dpserve.engine.layers.linear import Linear, detached_weights, fused_weights, uses_onednn


class FeedForward(Protocol):
    """A layer's feed-forward block (``GatedMLP``, ``moe.SparseMoE``)."""

    def plus(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + block(normed)``."""
        ...


class GatedMLP:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, the residual added by the down projection.

    With oneDNN the gate and up projections stay separate so SiLU and the product ride in
    their epilogues (three operations in all); otherwise they are one fused matmul followed
    by SiLU and a product, one Triton kernel where the glue is Triton (CUDA)."""

    def __init__(self, mlp: Any, kernels: KernelChoice) -> None:
        self.fused = kernels.triton_layers
        if uses_onednn(mlp.gate_proj.weight):
            self.gate: Linear | None = Linear(*detached_weights(mlp.gate_proj))
            self.up: Linear | None = Linear(*detached_weights(mlp.up_proj))
            self.gate_up: Linear | None = None
        else:
            self.gate = self.up = None
            self.gate_up = Linear(*fused_weights(mlp.gate_proj, mlp.up_proj))
        self.down = Linear(*detached_weights(mlp.down_proj))

    def plus(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(normed)``."""
        if self.gate is not None and self.up is not None:
            activated = self.up.times(normed, self.gate.silu(normed))
        else:
            assert self.gate_up is not None
            if self.fused:
                activated = triton_layer_ops.silu_times_up(self.gate_up(normed))
            else:
                gate, up = self.gate_up(normed).chunk(2, dim=-1)
                activated = functional.silu(gate).mul_(up)
        return self.down.plus(activated, residual)
