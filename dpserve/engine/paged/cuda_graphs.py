"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

An eager decode step launches a few kernels per layer and is CPU bound at every batch size
(issue 10: 11 ms of launches for ~1 ms of GPU work). A decode-only step has the same shapes for
a given batch size, so it is captured once per bucket over static input buffers
(``StaticDecodeInputs``) and replayed; a batch is padded up to its bucket. The buckets are
powers of two up to 16, then every 8 up to 32 and every 16 above: a batch of 129 runs as 144
rows, not 256 (padding rows cost a decode step's worth of GPU work each). Padding rows
feed token 0 at position 0, write their key/value to slot 0 (block 0, never handed out) and
attend to that one slot, so they touch nothing a sequence owns; their logits are ignored.

Each graph ends with the greedy pick of its rows (``sampler.greedy``: one Triton kernel where
``triton_greedy`` verified, else torch's), so a step whose rows all decode greedily with nothing
else read from the logits (``run_greedy``) replays one graph and only copies the ids out; other
steps sample from the logits (``run``), the ids computed beside them unused (~20 us of a
step that reads all the weights).

Only used on CUDA, with the Triton decode kernel (it reads each row up to its own length; the
torch fallback would read every column of the static block table). Steps with prefill chunks,
or more rows than the largest bucket, run eagerly.
"""

from __future__ import annotations

from typing import Final

import torch

from dpserve.engine.kernels import triton_greedy
from dpserve.engine.layers.kv_cache import PagedKVCache
from dpserve.engine.models.base import ForwardBatch, PagedModel
from dpserve.engine.sample import sampler

GRAPH_BATCH_SIZES: Final = (1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16))
_WARMUP_RUNS: Final = 2  # Triton compiles and cuBLAS picks its kernels before capture


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The buckets needed for batches of up to ``max_batch`` rows (the last one covers it)."""
    covering = next((size for size in GRAPH_BATCH_SIZES if size >= max_batch), None)
    if covering is None:  # larger batches run eagerly
        return list(GRAPH_BATCH_SIZES)
    return [size for size in GRAPH_BATCH_SIZES if size <= covering]


class StaticDecodeInputs:
    """The buffers a captured decode step reads; ``fill`` copies a batch in, padded."""

    def __init__(self, max_batch: int, max_blocks_per_sequence: int, device: torch.device):
        self.sizes = graph_batch_sizes(max_batch)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(largest, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            (largest, max_blocks_per_sequence), dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)

    def bucket(self, count: int) -> int:
        return next(size for size in self.sizes if size >= count)

    def batch(self, size: int) -> ForwardBatch:
        """The static batch of ``size`` rows (what a graph is captured on)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            prefills=[],
            logits_indices=None,
        )

    def fill(self, batch: ForwardBatch) -> int:
        """Copy a decode-only batch in and pad it to its bucket; returns the bucket. Block
        table columns past the batch's width keep stale ids: the kernel stops at each row's
        length, and a stale id is still a valid block."""
        assert batch.block_tables is not None and batch.seq_lens is not None
        count = batch.num_decodes
        size = self.bucket(count)
        self.input_ids[:count].copy_(batch.input_ids)
        self.positions[:count].copy_(batch.positions)
        self.slot_mapping[:count].copy_(batch.slot_mapping)
        self.block_tables[:count, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.seq_lens[:count].copy_(batch.seq_lens)
        if count < size:  # padding rows: see the module docstring
            for buffer in (self.input_ids, self.positions, self.slot_mapping):
                buffer[count:size].zero_()
            self.block_tables[count:size].zero_()
            self.seq_lens[count:size].fill_(1)
        return size


class DecodeGraphs:
    def __init__(
        self,
        model: PagedModel,
        cache: PagedKVCache,
        max_batch: int,
        max_blocks_per_sequence: int,
    ) -> None:
        device = cache.keys[0].device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.inputs = StaticDecodeInputs(max_batch, max_blocks_per_sequence, device)
        self.sizes = self.inputs.sizes
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._tokens: dict[int, torch.Tensor] = {}
        with torch.cuda.device(device):
            # Decided before capture: the check synchronizes, which a capture cannot.
            triton_greedy.verified(device)
            self._capture(model, cache)

    def _capture(self, model: PagedModel, cache: PagedKVCache) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in self.sizes:
                for _ in range(_WARMUP_RUNS):
                    sampler.greedy(model.forward(self.inputs.batch(size), cache))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the largest made.
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = model.forward(self.inputs.batch(size), cache)
                self._tokens[size] = sampler.greedy(self._logits[size])
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, batch: ForwardBatch) -> bool:
        # A step with LoRA rows runs eagerly: the graphs hold the base model's kernels only.
        return (
            not batch.prefills
            and batch.adapters is None
            and 0 < batch.num_decodes <= self.sizes[-1]
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[num_decodes, vocab]`` of a decode-only batch; valid until the next run."""
        size = self.inputs.fill(batch)
        self._graphs[size].replay()
        return self._logits[size][: batch.num_decodes]

    def run_greedy(self, batch: ForwardBatch) -> torch.Tensor:
        """The greedy tokens ``[num_decodes]`` of a decode-only batch (``sampler.greedy`` of
        its logits), in a tensor of their own: the graph's buffer is rewritten by the next run,
        while these may still be on their way to the host or fed to the next step."""
        size = self.inputs.fill(batch)
        self._graphs[size].replay()
        return self._tokens[size][: batch.num_decodes].clone()
