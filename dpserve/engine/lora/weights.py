"""A loaded LoRA adapter's weights (``AdapterWeights``): what ``adapter`` reads from a PEFT
directory, ``slots`` holds and ``delta`` / ``sorted_rows`` multiply by. Per layer, per
projection (``qkv``, ``o_proj``, ``gate_up``, ``down_proj``), A ``[r, in]`` and B ``[out, r]``
with the scale folded into B, the query and key rows of B already in RoPE pair order; q/k/v and
gate/up fused as our layers compute them, B block-diagonal (``adapter``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class ModuleDelta:
    """One adapted module of one layer: A ``[r, in]`` and the scaled B ``[out, r]``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(slots=True)
class AdapterWeights:
    """A loaded adapter: its deltas per layer (index) and projection."""

    name: str
    path: str
    rank: int
    layers: list[dict[str, ModuleDelta]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(
            delta.a.nbytes + delta.b.nbytes for layer in self.layers for delta in layer.values()
        )
