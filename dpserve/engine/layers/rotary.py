"""Rotary position embeddings, in the pair order every kernel of ours uses, with the KV write.

transformers rotates dimension ``i`` of a head together with ``i + head_dim / 2``
(``rotate_half``). Our projections put each such pair side by side instead
(``rotary_pair_order``: ``0, h, 1, h + 1, ...``), so a pair is one complex number and RoPE is one
complex product; the query and key projections' rows are permuted once at load
(``pair_rotary_dims``), and so must be anything applied per head dimension before RoPE (Qwen3's
q/k norm weights: ``in_pair_order``), or it is silently wrong. Queries and keys are permuted
alike, so every score q.k is the same sum; the cache holds keys in this order.

The table is the model's own rotary module evaluated once for every position, so each scaling
variant (llama3, linear, yarn, ...) is exactly transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from dpserve.engine.kernels import cpu_kernels, triton_layer_ops
from dpserve.engine.layers.kernel_choice import KernelChoice
from dpserve.engine.layers.norm import head_norm_

# RoPE variants whose tables depend on the sequence length seen so far: not precomputable.
LENGTH_DEPENDENT_ROPE: Final = frozenset({"dynamic", "longrope"})


def rotary_pair_order(head_dim: int) -> torch.Tensor:
    """Dimension ``i`` and ``i + head_dim / 2`` of a head are the two halves RoPE rotates
    together (transformers' ``rotate_half``); this order puts them side by side
    (``0, h, 1, h + 1, ...``), so each pair is one complex number."""
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)


def pair_rotary_dims(
    weight: torch.Tensor, bias: torch.Tensor | None, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A query or key projection whose output heads come out in ``rotary_pair_order``."""
    order = rotary_pair_order(head_dim).to(weight.device)
    weight = weight.view(heads, head_dim, -1).index_select(1, order).reshape(weight.shape)
    if bias is not None:
        bias = bias.view(heads, head_dim).index_select(1, order).reshape(bias.shape)
    return weight, bias


def in_pair_order(per_dimension: torch.Tensor) -> torch.Tensor:
    """A ``[head_dim]`` weight applied per head dimension (a q/k norm), reordered to match the
    projections' ``rotary_pair_order``."""
    return per_dimension.index_select(
        0, rotary_pair_order(per_dimension.shape[0]).to(per_dimension.device)
    )


def rope_rotation(
    rotary: Any, context_size: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[positions, 1, head_dim / 2]`` complex64: cos + i sin of every position, from the
    model's own rotary module (so every scaling variant is transformers')."""
    positions = torch.arange(context_size, device=device).unsqueeze(0)
    probe = torch.empty(0, dtype=dtype, device=device)
    with torch.inference_mode():
        cos, sin = rotary(probe, positions)
    cos, sin = cos[0].float(), sin[0].float()
    half = head_dim // 2
    paired = torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    if not paired:
        raise ValueError("the rotary tables do not rotate dimension pairs (i, i + dim/2)")
    return torch.complex(cos[:, :half], sin[:, :half]).unsqueeze(1)


def rotate_in_place(pairs: torch.Tensor, rotation: torch.Tensor) -> None:
    """RoPE on ``pairs`` ``[tokens, heads, head_dim / 2, 2]`` (a view of the projection's
    output in ``rotary_pair_order``) by ``rotation`` ``[tokens, 1, head_dim / 2]`` complex:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) is a complex product, one operation."""
    if pairs.dtype in (torch.float32, torch.float64):
        torch.view_as_complex(pairs).mul_(rotation)
    else:  # no complex bfloat16: rotate in fp32 and write back rounded
        rotated = torch.view_as_complex(pairs.float()) * rotation
        pairs.copy_(torch.view_as_real(rotated))


@dataclass(frozen=True, slots=True)
class HeadNorms:
    """Qwen3's RMSNorm of every query and key head before RoPE: its weights ``[head_dim]``, in
    RoPE pair order (``in_pair_order``)."""

    query: torch.Tensor
    key: torch.Tensor
    eps: float


@dataclass(slots=True)
class TokenInputs:
    """Each row's position and cache slot, and what the torch path derives from them once per
    step: all a layer reads besides its attention (``piecewise_graphs`` captures on these)."""

    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64
    # The torch path's RoPE ([tokens, 1, head_dim / 2] complex, each row's position) and KV
    # write (index_put_ into a layer's kv pair); None where a kernel does both.
    rotation: torch.Tensor | None
    write_index: tuple[torch.Tensor, torch.Tensor] | None


class RotaryKVWrite:
    """RoPE on a step's queries and keys, in place in the qkv projection's output, and the
    rotated keys with the values written to a layer's cache: one C++ or Triton kernel, or
    torch's complex product and ``index_put_`` (``kernel_choice``)."""

    def __init__(
        self,
        rotation: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kernels: KernelChoice,
    ) -> None:
        self.rotation = rotation
        # The rotation as (cos, sin) pairs, [positions, head_dim / 2, 2], for the C++ kernel.
        self.rotation_pairs = torch.view_as_real(rotation).view(rotation.shape[0], -1, 2)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.glue = kernels.glue

    def token_inputs(self, positions: torch.Tensor, slot_mapping: torch.Tensor) -> TokenInputs:
        if self.glue != "torch":
            return TokenInputs(positions, slot_mapping, rotation=None, write_index=None)
        return TokenInputs(
            positions,
            slot_mapping,
            rotation=self.rotation.index_select(0, positions),
            write_index=(
                torch.arange(2, device=slot_mapping.device).unsqueeze(1),
                slot_mapping.unsqueeze(0),
            ),
        )

    def __call__(
        self,
        qkv: torch.Tensor,
        tokens: TokenInputs,
        kv_pair: torch.Tensor,
        head_norms: HeadNorms | None = None,
    ) -> None:
        """RoPE and the KV write, after ``head_norms`` where given (fused into the C++ or
        Triton kernel where it can be, else in place first)."""
        fused_norms = None
        if head_norms is not None:
            if self.glue == "cpu" or (
                self.glue == "triton" and triton_layer_ops.fuses_head_norm(self.head_dim)
            ):
                fused_norms = (head_norms.query, head_norms.key, head_norms.eps)
            else:
                self._norm_heads(qkv, head_norms)
        if self.glue == "cpu":
            cpu_kernels.rotate_and_write_kv(
                qkv,
                self.rotation_pairs,
                tokens.positions,
                tokens.slot_mapping,
                kv_pair,
                self.num_heads,
                self.num_kv_heads,
                fused_norms,
            )
        elif tokens.rotation is None or tokens.write_index is None:
            triton_layer_ops.rotate_and_write_kv(
                qkv,
                self.rotation,
                tokens.positions,
                tokens.slot_mapping,
                kv_pair,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                fused_norms,
            )
        else:
            rows = qkv.shape[0]
            rotated_heads = self.num_heads + self.num_kv_heads
            rotate_in_place(
                qkv[:, : self.q_size + self.kv_size].view(rows, rotated_heads, -1, 2),
                tokens.rotation,
            )
            key_value = qkv[:, self.q_size :].view(rows, 2, self.num_kv_heads, self.head_dim)
            kv_pair.view(2, -1, self.num_kv_heads, self.head_dim).index_put_(
                tokens.write_index, key_value.transpose(0, 1)
            )

    def _norm_heads(self, qkv: torch.Tensor, head_norms: HeadNorms) -> None:
        rows = qkv.shape[0]
        queries = qkv[:, : self.q_size].view(rows, self.num_heads, self.head_dim)
        keys = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            rows, self.num_kv_heads, self.head_dim
        )
        head_norm_(queries, head_norms.query, head_norms.eps)
        head_norm_(keys, head_norms.key, head_norms.eps)
