"""The gated MLP of the Llama family (SwiGLU)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.nn import functional

from dpserve.engine.kernels import triton_layer_ops
from dpserve.engine.layers.kernel_choice import KernelChoice
from dpserve.engine.layers.linear import Linear, detached_weights, fused_weights, uses_onednn
from dpserve.engine.layers.weight_format import DEFAULT_WEIGHT_FORMAT, WeightFormat


class ProjectionDelta(Protocol):
    """What a LoRA adapter adds to one projection of this layer (``lora.delta.LayerAdapters``):
    ``out += delta of module(x)``, for the rows of the step that have an adapter."""

    def __call__(self, module: str, x: torch.Tensor, out: torch.Tensor) -> None: ...


class FeedForward(Protocol):
    """A layer's feed-forward block (``GatedMLP``, ``moe.SparseMoE``)."""

    def plus(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + block(normed)``."""
        ...


class GatedMLP:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, the residual added by the down projection.

    With oneDNN the gate and up projections stay separate so SiLU and the product ride in
    their epilogues (three operations in all); otherwise they are one fused matmul followed
    by SiLU and a product, one Triton kernel where the glue is Triton (CUDA). ``weight_format``
    and ``rounds_activations``: how the three weights are held and multiplied (``Linear``);
    ``kernels.small_batch_rows`` which steps they run on the small-batch path."""

    def __init__(
        self,
        mlp: Any,
        kernels: KernelChoice,
        weight_format: WeightFormat = DEFAULT_WEIGHT_FORMAT,
        *,
        rounds_activations: bool | None = None,
    ) -> None:
        self.fused = kernels.triton_layers
        small = kernels.small_batch_rows

        def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            return Linear(weight, bias, weight_format, small, rounds_activations=rounds_activations)

        if uses_onednn(mlp.gate_proj.weight):
            self.gate: Linear | None = linear(*detached_weights(mlp.gate_proj))
            self.up: Linear | None = linear(*detached_weights(mlp.up_proj))
            self.gate_up: Linear | None = None
        else:
            self.gate = self.up = None
            self.gate_up = linear(*fused_weights(mlp.gate_proj, mlp.up_proj))
        self.down = linear(*detached_weights(mlp.down_proj))

    def plus(
        self, normed: torch.Tensor, residual: torch.Tensor, delta: ProjectionDelta | None = None
    ) -> torch.Tensor:
        """``residual + mlp(normed)``; with ``delta`` (a step with LoRA rows) each projection's
        adapter delta is added to its output, the gate's and up's before SiLU and the product,
        so those run outside oneDNN's epilogues."""
        if delta is not None:
            return self._plus_adapted(normed, residual, delta)
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

    def _plus_adapted(
        self, normed: torch.Tensor, residual: torch.Tensor, delta: ProjectionDelta
    ) -> torch.Tensor:
        if self.gate is not None and self.up is not None:
            gate_up = torch.cat((self.gate(normed), self.up(normed)), dim=-1)
        else:
            assert self.gate_up is not None
            gate_up = self.gate_up(normed)
        delta("gate_up", normed, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        activated = functional.silu(gate).mul_(up)
        out = self.down.plus(activated, residual)
        delta("down_proj", activated, out)
        return out
