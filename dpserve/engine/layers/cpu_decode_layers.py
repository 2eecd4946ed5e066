"""Every decoder layer of a decode step in one C++ call on CPU (``csrc/decode_layers.cpp``).

A step whose rows all decode, on the C++ glue and the decode kernel, runs per layer the same
kernels with the same operands as the Python layers (RMSNorm, the qkv product, RoPE and the KV
write, decode attention, the output product plus the residual, RMSNorm, the gated MLP): the
same result to the bit, without the host's time between them. From Python a SmolLM2-135M step
of one sequence ran ~270 torch operations, ~1.3 ms of a ~15 ms step outside the kernels on two
Zen 4 cores, where llama.cpp's whole step took about as long as our kernels alone (issue 33).

``DecodeLayers.of`` takes a model's layers where every one fits (the attention of
``step_attention`` over a gated MLP, Qwen3's head norms or none, every projection on the
decode kernel); a mixture of experts, LoRA rows, prompt chunks and steps of more rows than the
decode kernel takes run the Python layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from dpserve import cpu_settings
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers.linear import Linear
from dpserve.engine.layers.mlp import GatedMLP
from dpserve.engine.layers.rotary import HeadNorms


class DecoderLayer(Protocol):
    """What a Llama-family layer holds (``models.llama.LlamaLayer``)."""

    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    mlp: Any


def _kernel_rows(linear: Linear) -> int:
    """Up to how many rows ``linear`` runs the decode kernel on its dense copy (0: none)."""
    return linear.small_rows if linear.decode_kernel and linear.dense is not None else 0


def _operands(linear: Linear | None) -> tuple[torch.Tensor | None, ...]:
    if linear is None:
        return (None, None, None)
    return (linear.dense, linear.bias, linear.scales)


class DecodeLayers:
    """A model's decoder layers as one C++ object; ``runs`` says which steps it takes."""

    def __init__(self, handle: Any, max_rows: int) -> None:
        self._handle = handle
        self.max_rows = max_rows

    @classmethod
    def of(
        cls,
        layers: Sequence[DecoderLayer],
        head_norms: Sequence[HeadNorms | None],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        rotation_pairs: torch.Tensor,
        batch_invariant: bool = False,
    ) -> DecodeLayers | None:
        """The layers as one object, or None where one does not fit (module docstring) or
        ``cpu_settings.FUSED_DECODE_ENV`` is "0"; ``batch_invariant``: the model's attention is
        (``step_attention``)."""
        if not layers or not cpu_settings.fused_decode_setting() or not cpu_kernels.available():
            return None
        projections: list[Linear] = []
        for layer in layers:
            mlp = layer.mlp
            if not isinstance(mlp, GatedMLP):
                return None
            parts: list[Linear | None] = [layer.qkv, layer.o_proj, mlp.down]
            parts += [mlp.gate, mlp.up] if mlp.gate_up is None else [mlp.gate_up]
            if any(part is None for part in parts):
                return None
            projections += [part for part in parts if part is not None]
        if any(norms is not None and norms.eps != eps for norms in head_norms):
            return None
        max_rows = min(_kernel_rows(linear) for linear in projections)
        if max_rows <= 0 or len({linear.bf16_dots for linear in projections}) != 1:
            return None
        handle = torch.classes.dpserve_cpu.DecodeLayers(
            num_heads,
            num_kv_heads,
            head_dim,
            eps,
            scale,
            cpu_kernels.engine_isa(),
            rotation_pairs,
            batch_invariant,
        )
        for layer, norms in zip(layers, head_norms, strict=True):
            mlp = layer.mlp
            gate = mlp.gate if mlp.gate_up is None else mlp.gate_up
            handle.add_layer(
                layer.input_norm,
                layer.post_norm,
                *_operands(layer.qkv),
                *_operands(layer.o_proj),
                *_operands(gate),
                *_operands(mlp.up if mlp.gate_up is None else None),
                *_operands(mlp.down),
                None if norms is None else norms.query,
                None if norms is None else norms.key,
                projections[0].bf16_dots,
            )
        return cls(handle, max_rows)

    def runs(self, rows: int, num_decodes: int, has_adapters: bool) -> bool:
        """Whether a step of ``rows`` rows runs here: every row decoding (no prompt chunk),
        no LoRA row, no more rows than every projection's decode kernel takes."""
        return not has_adapters and 0 < rows == num_decodes <= self.max_rows

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_pairs: list[torch.Tensor],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden`` (the embedded tokens) through every layer, each layer's keys and values
        written to its pool in ``kv_pairs``."""
        out: torch.Tensor = self._handle.run(
            hidden, positions, slot_mapping, kv_pairs, block_tables, seq_lens
        )
        return out
