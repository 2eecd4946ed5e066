"""The LoRA delta of one step: ``out[rows] += (x[rows] @ A^T) @ (scale * B)^T`` per adapter.

A step mixes requests of several adapters and of the base model: its rows are grouped by
adapter once per step (``StepAdapters``), and every adapted projection of every layer adds, for
each group, two small matmuls (shrink to the rank, expand to the projection's width) to the
base projection's output. Rows of the base model are left alone. This is the torch path (CPU,
and CUDA for now): a step with adapter rows runs eagerly on CUDA, outside the CUDA graphs.

The weights are ``AdapterWeights``: per layer, per projection (``qkv``, ``o_proj``,
``gate_up``, ``down_proj``), A ``[r, in]`` and B ``[out, r]`` with the scale folded into B, the
query and key rows of B already in RoPE pair order; q/k/v and gate/up fused as our layers
compute them, B block-diagonal (``adapter``).
"""

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


@dataclass(frozen=True, slots=True)
class StepAdapters:
    """A step's rows grouped by adapter: ``(weights, rows)`` per adapter with rows in the step,
    ``rows`` an int64 tensor of row indices, or None when the adapter has every row."""

    groups: tuple[tuple[AdapterWeights, torch.Tensor | None], ...]

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the delta of projection ``module`` of layer ``layer`` over input ``x`` to
        ``out`` (the base projection's output)."""
        for weights, rows in self.groups:
            delta = weights.layers[layer].get(module)
            if delta is None:
                continue
            if rows is None:
                out.add_(x.matmul(delta.a.t()).matmul(delta.b.t()))
            else:
                update = x.index_select(0, rows).matmul(delta.a.t()).matmul(delta.b.t())
                out.index_add_(0, rows, update)

    def for_layer(self, layer: int) -> LayerAdapters:
        return LayerAdapters(self, layer)


@dataclass(frozen=True, slots=True)
class LayerAdapters:
    """``StepAdapters`` bound to one layer: what a layer's feed-forward block is handed."""

    step: StepAdapters
    layer: int

    def __call__(self, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.step.add(self.layer, module, x, out)


def group_rows(
    row_slots: list[int], weights_of: dict[int, AdapterWeights], device: torch.device
) -> StepAdapters | None:
    """The step's groups from each row's slot (-1: the base model); None when no row has an
    adapter (the step then runs exactly as without LoRA)."""
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            rows_of.setdefault(slot, []).append(row)
    if not rows_of:
        return None
    total = len(row_slots)
    groups = tuple(
        (
            weights_of[slot],
            None
            if len(rows) == total
            else torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True),
        )
        for slot, rows in sorted(rows_of.items())
    )
    return StepAdapters(groups)
