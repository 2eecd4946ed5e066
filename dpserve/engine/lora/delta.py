"""The LoRA delta of one step: ``out[rows] += (x[rows] @ A^T) @ (scale * B)^T`` per adapter.

A step mixes requests of several adapters and of the base model: its rows are grouped by
adapter once per step (``StepAdapters``), and every adapted projection of every layer adds, for
each group, two small matmuls (shrink to the rank, expand to the projection's width) to the
base projection's output. Rows of the base model are left alone. The stacked form runs on CUDA
as two Triton kernels (``kernels.triton_lora``: shrink and expand over each row's own adapter,
after Punica's SGMV/BGMV); everything else is the torch path (CPU; on CUDA the grouped form, and
the stacked form without Triton). A step with adapter rows runs eagerly on CUDA, outside the
CUDA graphs.

The weights are ``weights.AdapterWeights`` (their layout is described there).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final, TypeVar

import torch

from dpserve.engine.kernels import triton_layer_ops, triton_lora
from dpserve.engine.lora.sorted_rows import PaddedAdapters, SortedRows, kernel_runs, sort_rows
from dpserve.engine.lora.weights import AdapterWeights


@dataclass(frozen=True, slots=True)
class StackedDelta:
    """One projection's deltas of several adapters side by side: A ``[R, in]`` and B
    ``[out, R]`` (R their ranks together) and, per column, the index of its adapter."""

    a: torch.Tensor
    b: torch.Tensor
    owner: torch.Tensor  # [R] int64
    key: tuple[tuple[int, int], ...]  # (adapter index, rank) runs: equal keys, equal masks
    # For the CUDA kernels, per adapter of the stack: its first column and its rank (0 where
    # the projection is not in that adapter), int32; and the largest rank.
    starts: torch.Tensor
    ranks: torch.Tensor
    max_rank: int


# Adapters together, by their total rank, at most: every row is multiplied by every adapter's
# columns (the base rows' and other adapters' zeroed by a mask), which beats gathering and
# scattering each adapter's rows while that product stays small next to the projection.
STACK_MAX_RANK: Final = 128
_COMBINATIONS_KEPT: Final = 8  # combinations of adapters whose weights are kept together


class _Stack:
    """The stacked deltas of a combination of adapters (kept by ``_combination``)."""

    def __init__(self, adapters: tuple[AdapterWeights, ...]) -> None:
        self.adapters = adapters  # held: the cache's key is their identities
        self.layers: list[dict[str, StackedDelta]] = []
        for layer in range(len(adapters[0].layers)):
            modules: dict[str, StackedDelta] = {}
            for module in sorted({m for w in adapters for m in w.layers[layer]}):
                parts = [
                    (index, w.layers[layer][module])
                    for index, w in enumerate(adapters)
                    if module in w.layers[layer]
                ]
                key = tuple((index, delta.a.shape[0]) for index, delta in parts)
                device = parts[0][1].a.device
                owner = torch.tensor(
                    [index for index, rank in key for _ in range(rank)], device=device
                )
                starts, ranks, start = [0] * len(adapters), [0] * len(adapters), 0
                for index, rank in key:
                    starts[index], ranks[index] = start, rank
                    start += rank
                modules[module] = StackedDelta(
                    torch.cat([delta.a for _, delta in parts]),
                    torch.cat([delta.b for _, delta in parts], dim=1),
                    owner,
                    key,
                    torch.tensor(starts, dtype=torch.int32, device=device),
                    torch.tensor(ranks, dtype=torch.int32, device=device),
                    max(ranks),
                )
            self.layers.append(modules)


_Combination = TypeVar("_Combination", _Stack, PaddedAdapters)
_combinations: OrderedDict[tuple[object, ...], _Stack | PaddedAdapters] = OrderedDict()


def _combination(kind: type[_Combination], adapters: tuple[AdapterWeights, ...]) -> _Combination:
    """The weights of ``adapters`` together as ``kind`` lays them out, built once and kept
    for the steps that follow (most steps run the same adapters as the one before)."""
    key = (kind, *(id(weights) for weights in adapters))
    found = _combinations.get(key)
    if isinstance(found, kind):
        _combinations.move_to_end(key)
        return found
    built = kind(adapters)
    _combinations[key] = built
    while len(_combinations) > _COMBINATIONS_KEPT:
        _combinations.popitem(last=False)
    return built


@dataclass(frozen=True, slots=True)
class StepAdapters:
    """A step's rows and their adapters, in one of two forms:

    * grouped: ``(weights, rows)`` per adapter with rows in the step, ``rows`` an int64 tensor
      of row indices, or None when the adapter has every row (then nothing is gathered);
    * stacked (``stack``, with ``row_adapter``: each row's adapter index, -1 for the base
      model): one shrink and one expand per projection for all adapters at once, each row's
      other columns masked to zero; on CUDA the Triton kernels (``kernels.triton_lora``),
      which multiply each row by its own adapter's columns only.

    * sorted (``sorted_rows``, on CPU): each adapter's rows multiplied by its own A and B only
      (``lora.sorted_rows``).

    The grouped form (adapters whose ranks together pass ``STACK_MAX_RANK``, or one adapter
    for every row: then nothing is gathered) stays on torch on CUDA too.
    """

    groups: tuple[tuple[AdapterWeights, torch.Tensor | None], ...] = ()
    sorted_rows: SortedRows | None = None
    stack: _Stack | None = None
    row_adapter: torch.Tensor | None = None
    _masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict)

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the delta of projection ``module`` of layer ``layer`` over input ``x`` to
        ``out`` (the base projection's output)."""
        if self.sorted_rows is not None:
            self.sorted_rows.add(layer, module, x, out)
            return
        if self.stack is not None:
            self._add_stacked(layer, module, x, out)
            return
        for weights, rows in self.groups:
            delta = weights.layers[layer].get(module)
            if delta is None:
                continue
            if rows is None:  # the expand and the add in one call
                out.addmm_(x.matmul(delta.a.t()), delta.b.t())
            else:
                update = x.index_select(0, rows).matmul(delta.a.t()).matmul(delta.b.t())
                out.index_add_(0, rows, update)

    def _add_stacked(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        assert self.stack is not None and self.row_adapter is not None
        delta = self.stack.layers[layer].get(module)
        if delta is None:
            return
        rows = self.row_adapter.shape[0]  # decode steps may be padded past them
        if _kernels_on(x.device):
            triton_lora.add_delta(
                x,
                out,
                delta.a,
                delta.b,
                self.row_adapter,
                delta.starts,
                delta.ranks,
                delta.max_rank,
            )
            return
        mask = self._masks.get(delta.key)
        if mask is None:
            mask = (self.row_adapter.unsqueeze(1) == delta.owner.unsqueeze(0)).to(x.dtype)
            self._masks[delta.key] = mask
        shrunk = x[:rows].matmul(delta.a.t()).mul_(mask)
        out[:rows].addmm_(shrunk, delta.b.t())

    def for_layer(self, layer: int) -> LayerAdapters:
        return LayerAdapters(self, layer)


def _kernels_on(device: torch.device) -> bool:
    """Whether the stacked delta runs as the Triton kernels: on CUDA, where Triton is."""
    return device.type == "cuda" and triton_layer_ops.available(device)


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
    """The step's adapters from each row's slot (-1: the base model); None when no row has
    an adapter (the step then runs exactly as without LoRA). On CPU sorted, or grouped when
    every row is one adapter's and the C++ kernel does not run (nothing is gathered then);
    elsewhere grouped in that case, else stacked while the adapters' ranks together stay
    within ``STACK_MAX_RANK``."""
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            rows_of.setdefault(slot, []).append(row)
    if not rows_of:
        return None
    total = len(row_slots)
    slots = sorted(rows_of)
    adapters = tuple(weights_of[slot] for slot in slots)
    one_for_all = len(slots) == 1 and len(rows_of[slots[0]]) == total
    if device.type == "cpu" and (not one_for_all or kernel_runs(adapters)):
        padded = _combination(PaddedAdapters, adapters)
        return StepAdapters(
            sorted_rows=sort_rows(padded, [rows_of[slot] for slot in slots], device)
        )
    if not one_for_all and sum(weights.rank for weights in adapters) <= STACK_MAX_RANK:
        index_of = {slot: index for index, slot in enumerate(slots)}
        row_adapter = torch.tensor([index_of.get(slot, -1) for slot in row_slots])
        return StepAdapters(
            stack=_combination(_Stack, adapters),
            row_adapter=row_adapter.to(device, non_blocking=True),
        )
    groups = tuple(
        (
            weights_of[slot],
            None
            if len(rows_of[slot]) == total
            else torch.tensor(rows_of[slot], dtype=torch.long).to(device, non_blocking=True),
        )
        for slot in slots
    )
    return StepAdapters(groups)
