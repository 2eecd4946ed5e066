"""The LoRA delta of a step that mixes adapters, on CPU: its rows sorted by adapter, each row
multiplied by its own adapter's A and B only.

The stacked form (``delta``: every row against every adapter's columns, the others masked)
does ``adapters x`` the useful work, and q/k/v's block-diagonal B triples the expand again:
with 4 rank-16 adapters on bench/lora.py's 512-wide Llama a decode step of 64 rows took 1.53x
the base step's CPU time (issue 34). Here, per projection:

* with the C++ kernels (fp32), one ``cpu_kernels.lora_delta``: each adapter's rows in groups
  of four, sums in registers, and the all-zero blocks of B skipped (``spans``); 0.31 ms a
  layer on those shapes against the stacked form's 1.33 (one thread, AMD EPYC Zen 4);
* otherwise the rows gathered into an ``[adapters, rows, in]`` batch padded to the adapter
  with the most rows, one ``bmm`` to shrink and one to expand (0.55 ms), added back.

Ranks differ between adapters and a projection may be adapted by some of them only: each
adapter's A and B are zero-padded to the largest rank (rounded up to the kernel's 16 lanes),
absent ones all zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional

from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.lora.weights import AdapterWeights

# Ranks are padded to a multiple of this (the kernel's vector width in floats).
RANK_MULTIPLE = 16


@dataclass(frozen=True, slots=True)
class PaddedDelta:
    """One projection of one layer for a combination of adapters: A^T ``[adapters, in, r]``,
    the scaled B^T ``[adapters, r, out]`` (``r`` the padded rank, the rest zeros), and
    ``spans`` ``[adapters, blocks, 2]``: per block of ``cpu_kernels.LORA_SPAN_COLUMNS``
    columns, the rank rows of B that are not all zero there."""

    a: torch.Tensor
    b: torch.Tensor
    spans: torch.Tensor


def nonzero_spans(b: torch.Tensor, columns: int) -> torch.Tensor:
    """Per adapter and block of ``columns`` columns of ``b`` ``[adapters, r, width]``, the
    first and one past the last rank row not all zero there (``[0, 0]`` where none is)."""
    adapters, rank, width = b.shape
    blocks = -(-width // columns)
    padded = functional.pad(b != 0, (0, blocks * columns - width))
    nonzero = padded.view(adapters, rank, blocks, columns).any(-1).transpose(1, 2)
    some = nonzero.any(-1)
    first = nonzero.int().argmax(-1)
    end = rank - nonzero.flip(-1).int().argmax(-1)
    zero = torch.zeros_like(first)
    return torch.stack((first.where(some, zero), end.where(some, zero)), -1).long().contiguous()


class PaddedAdapters:
    """A combination of adapters as batched weights, built once and kept for the next steps
    of the same combination (``delta``'s cache of combinations)."""

    def __init__(self, adapters: tuple[AdapterWeights, ...]) -> None:
        self.adapters = adapters  # held: the cache's key is their identities
        self.layers: list[dict[str, PaddedDelta]] = []
        for layer in range(len(adapters[0].layers)):
            modules: dict[str, PaddedDelta] = {}
            for module in sorted({m for w in adapters for m in w.layers[layer]}):
                present = [w.layers[layer].get(module) for w in adapters]
                first = next(delta for delta in present if delta is not None)
                rank = max(delta.a.shape[0] for delta in present if delta is not None)
                rank = -(-rank // RANK_MULTIPLE) * RANK_MULTIPLE
                a = first.a.new_zeros(len(adapters), first.a.shape[1], rank)
                b = first.b.new_zeros(len(adapters), rank, first.b.shape[0])
                for index, delta in enumerate(present):
                    if delta is not None:
                        a[index, :, : delta.a.shape[0]] = delta.a.t()
                        b[index, : delta.b.shape[1]] = delta.b.t()
                spans = nonzero_spans(b, cpu_kernels.LORA_SPAN_COLUMNS)
                modules[module] = PaddedDelta(a, b, spans)
            self.layers.append(modules)


@dataclass(frozen=True, slots=True)
class SortedRows:
    """A step's adapted rows, adapter by adapter: ``rows`` ``[n]`` and ``starts``
    ``[adapters + 1]`` (where each adapter's run begins) for the kernel; for the ``bmm``
    path ``index`` ``[adapters * per_adapter]`` the step's row of each place (padding: row 0)
    and ``keep`` ``[adapters, per_adapter, 1]``, one for a real row, zero for padding."""

    weights: PaddedAdapters
    kernel: bool
    rows: torch.Tensor
    starts: torch.Tensor
    index: torch.Tensor
    keep: torch.Tensor
    per_adapter: int

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[row] += x[row] @ A^T @ B^T`` with each adapted row's own adapter."""
        delta = self.weights.layers[layer].get(module)
        if delta is None:
            return
        if self.kernel:
            cpu_kernels.lora_delta(x, out, delta.a, delta.b, delta.spans, self.rows, self.starts)
            return
        # The padding rows repeat row 0 and are zeroed after the shrink: they add exactly zero
        # to row 0 (a non-finite row 0 is already its own row's problem, and no other's).
        adapters = delta.a.shape[0]
        gathered = x.index_select(0, self.index).view(adapters, self.per_adapter, -1)
        shrunk = torch.bmm(gathered, delta.a).mul_(self.keep)
        expanded = torch.bmm(shrunk, delta.b)
        out.index_add_(0, self.index, expanded.view(adapters * self.per_adapter, -1))


def kernel_runs(adapters: tuple[AdapterWeights, ...]) -> bool:
    """Whether ``SortedRows`` of these adapters runs the C++ kernel (fp32 on CPU, built)."""
    sample = next(delta.a for layer in adapters[0].layers for delta in layer.values())
    return cpu_kernels.usable(sample)


def sort_rows(
    weights: PaddedAdapters, rows_of: list[list[int]], device: torch.device
) -> SortedRows:
    """``SortedRows`` for ``rows_of[i]``, the rows of adapter ``i`` of ``weights``."""
    dtype = next(delta.a.dtype for layer in weights.layers for delta in layer.values())
    starts = [0]
    for rows in rows_of:
        starts.append(starts[-1] + len(rows))
    per_adapter = max(len(rows) for rows in rows_of)
    index = [0] * (len(rows_of) * per_adapter)
    keep = [0.0] * len(index)
    for adapter, rows in enumerate(rows_of):
        start = adapter * per_adapter
        index[start : start + len(rows)] = rows
        keep[start : start + len(rows)] = [1.0] * len(rows)
    return SortedRows(
        weights,
        kernel_runs(weights.adapters),
        torch.tensor([row for rows in rows_of for row in rows], dtype=torch.long),
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(index, dtype=torch.long).to(device),
        torch.tensor(keep, dtype=dtype).view(len(rows_of), per_adapter, 1).to(device),
        per_adapter,
    )
