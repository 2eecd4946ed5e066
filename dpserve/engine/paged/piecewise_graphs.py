"""Steps that carry prompt chunks, replayed from CUDA graphs piece by piece.

A decode-only step is one graph (``cuda_graphs``). A step with prompt chunks cannot be one:
its attention depends on how many chunks it has, how long each is and how much of each is
already cached, so that layout is rebuilt on the host every step. Everything else in the
step depends only on how many tokens it has. So such a step is cut at attention, as vLLM's
piecewise graphs are: each attention runs eagerly over the step's own rows, and each stretch
between two attentions is one graph per token-count bucket, replayed over static buffers.
A step of T tokens, padded to its bucket B (``token_buckets``):

    ids, positions, slots (B rows)
      -> piece 0: embed, layer 0's norm, QKV, RoPE and KV write   -> qkv
      -> attention of layer 0, eager, T rows                      -> attended
      -> piece 1: layer 0's output projection and MLP, layer 1's norm, QKV, RoPE, KV write
      -> ...
      -> piece L: layer L-1's output projection and MLP, the final norm -> normed
      -> the vocabulary projection of the rows whose logits are due, eager

Eagerly such a step launches every layer's kernels one by one from Python (+6.8 ms for a
1B-shape step that carries a 128-token prompt on an H100, fc290c2); replayed it launches
L + 1 graphs and the attentions.

Padding rows feed token 0 at position 0 and write their key and value to slot 0 (block 0,
never handed out); the attentions skip them, so their rows of ``attended`` keep what an
earlier step left there (finite values, never read back into a real row).

Each piece reads and writes only the static buffers (outputs are copied into them), so the
intermediates of all graphs share one memory pool that holds only the largest piece's.
``verify`` compares one step against the eager forward before the graphs serve.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Final

import torch

from dpserve.engine.layers.kv_cache import PagedKVCache
from dpserve.engine.models.base import ForwardBatch, PagedModel, PrefillSlice

log = logging.getLogger(__name__)

# Above 512 tokens a step's matmuls take long enough that launching eagerly costs little.
MAX_GRAPH_TOKENS: Final = 512
TOKEN_BUCKETS: Final = (*range(16, 129, 16), *range(160, MAX_GRAPH_TOKENS + 1, 32))
_WARMUP_RUNS: Final = 2  # cuBLAS picks its kernels and allocates its workspace before capture
# Mean |graph - eager| over mean |eager| of the check's logits above which the graphs are not
# used. The check's step needs no padding, so both run matmuls of the same shapes; a piece
# that read a tensor of the capture instead of a static buffer is off by the logits' size.
_VERIFY_TOLERANCE: Final = 0.02

# Takes a piece's body and returns what replays it.
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def token_buckets(max_tokens: int) -> list[int]:
    """The buckets needed for steps of up to ``max_tokens`` tokens (at most 512)."""
    covering = next((size for size in TOKEN_BUCKETS if size >= max_tokens), TOKEN_BUCKETS[-1])
    return [size for size in TOKEN_BUCKETS if size <= covering]


def eager(body: Callable[[], None]) -> Callable[[], None]:
    """A ``Capture`` that replays a piece by running it again (CPU tests of the pieces)."""
    return body


class PiecewiseGraphs:
    """Runs steps that carry prompt chunks (``can_run``) through the captured pieces."""

    def __init__(
        self,
        model: PagedModel,
        cache: PagedKVCache,
        max_tokens: int,
        capture: Capture | None = None,
    ) -> None:
        self.model, self.cache = model, cache
        self.sizes = token_buckets(max_tokens)
        device, dtype, largest = model.device, model.dtype, self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(largest, dtype=torch.long, device=device)
        hidden_size = model.embedding.shape[1]
        self.hidden = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        self.normed = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        qkv_width = model.q_size + 2 * model.kv_size
        self.qkv = torch.zeros(largest, qkv_width, dtype=dtype, device=device)
        self.attended = torch.zeros(largest, model.q_size, dtype=dtype, device=device)
        self.pieces_per_step = model.num_layers + 1
        if capture is None:
            capture = _cuda_capture(device, self._warm_up)
        self._pieces: dict[int, list[Callable[[], None]]] = {}
        # Largest first: the smaller pieces' intermediates fit in what the largest took.
        for size in reversed(self.sizes):
            self._pieces[size] = [
                capture(partial(self._piece, size, index)) for index in range(self.pieces_per_step)
            ]

    def _piece(self, size: int, index: int) -> None:
        """Piece ``index`` of a step of ``size`` rows: layer ``index - 1``'s output (the
        embedding for 0), then layer ``index``'s attention input (the final norm for L)."""
        model = self.model
        if index == 0:
            hidden = model.embed(self.input_ids[:size])
        else:
            hidden = model.layer_output(index - 1, self.hidden[:size], self.attended[:size])
        if index == model.num_layers:
            self.normed[:size].copy_(model.final_norm(hidden))
            return
        self.hidden[:size].copy_(hidden)
        tokens = model.token_inputs(self.positions[:size], self.slot_mapping[:size])
        self.qkv[:size].copy_(model.attention_input(index, hidden, tokens, self.cache))

    def _warm_up(self) -> None:
        for size in self.sizes:
            for index in range(self.pieces_per_step):
                self._piece(size, index)

    def can_run(self, batch: ForwardBatch) -> bool:
        # A step with LoRA rows runs eagerly (the pieces hold the base model's layers only).
        return (
            bool(batch.prefills)
            and batch.adapters is None
            and batch.input_ids.shape[0] <= self.sizes[-1]
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of ``batch``, as ``PagedModel.forward`` computes them."""
        model = self.model
        count = batch.input_ids.shape[0]
        size = next(size for size in self.sizes if size >= count)
        for buffer, values in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.slot_mapping, batch.slot_mapping),
        ):
            buffer[:count].copy_(values)
            buffer[count:size].zero_()  # padding rows: see the module docstring
        layout = model.attention_layout(batch, self.cache.block_size)
        pieces = self._pieces[size]
        for index in range(model.num_layers):
            pieces[index]()
            attended = model.attention(index, self.qkv[:count], self.cache, layout)
            self.attended[:count].copy_(attended)
        pieces[-1]()
        normed = self.normed[:count]
        if batch.logits_indices is not None:
            normed = normed.index_select(0, batch.logits_indices)
        return model.lm_head(normed)

    def verify(self) -> bool:
        """Whether a step through the pieces gives the eager forward's logits. It writes
        blocks 1 and up of the pool: call it before any sequence holds one."""
        model = self.model
        # A bucket's worth of tokens: no padding, so every matmul has the eager step's shape.
        tokens = max(size for size in self.sizes if size <= 96)
        batch = _check_batch(self.cache.block_size, tokens, model.device)
        graphed = self.run(batch).float()
        eager_logits = model.forward(batch, self.cache).float()
        error = (graphed - eager_logits).abs().mean() / eager_logits.abs().mean().clamp_min(1e-6)
        if bool(torch.isfinite(graphed).all()) and float(error) <= _VERIFY_TOLERANCE:
            return True
        log.error(
            "piecewise CUDA graphs disagree with the eager forward (mean error %.3g of the "
            "logits' size): steps with prompt chunks run eagerly",
            float(error),
        )
        return False


def _cuda_capture(device: torch.device, warm_up: Callable[[], None]) -> Capture:
    """Captures pieces on ``device`` into one shared memory pool, after running every piece
    ``_WARMUP_RUNS`` times on the capture stream (as ``torch.cuda.graph`` asks)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(_WARMUP_RUNS):
            warm_up()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle()

    def capture(body: Callable[[], None]) -> Callable[[], None]:
        # capture_begin/end, not the torch.cuda.graph context: that one runs gc.collect() and
        # empty_cache() for every graph, seconds over the hundreds of pieces of a model.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                body()
            finally:
                graph.capture_end()
        return graph.replay

    return capture


def _check_batch(block_size: int, tokens: int, device: torch.device) -> ForwardBatch:
    """Three decode rows, each attending to its own one slot, and two prompt chunks from
    position 0 in blocks of their own; ids and positions that no capture saw."""
    decodes = 3
    first, second = (tokens - decodes) // 2, tokens - decodes - (tokens - decodes) // 2
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 100, (tokens,), generator=generator)
    chunk_positions = [torch.arange(first), torch.arange(second)]
    positions = torch.cat([torch.tensor([7, 3, 11]), *chunk_positions])
    # Blocks from 1 on (0 takes padding rows' writes): each decode row one, each chunk its own.
    first_block = 1 + decodes
    second_block = first_block + -(-first // block_size)
    decode_slots = torch.arange(1, 1 + decodes) * block_size
    slot_mapping = torch.cat(
        [
            decode_slots,
            first_block * block_size + torch.arange(first),
            second_block * block_size + torch.arange(second),
        ]
    )
    return ForwardBatch(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        num_decodes=decodes,
        block_tables=torch.arange(1, 1 + decodes, dtype=torch.int32).unsqueeze(1).to(device),
        seq_lens=torch.ones(decodes, dtype=torch.int32, device=device),
        prefills=[
            PrefillSlice(decodes, first, 0, None),
            PrefillSlice(decodes + first, second, 0, None),
        ],
        logits_indices=torch.tensor(
            [0, 1, 2, decodes + first - 1, tokens - 1], dtype=torch.long, device=device
        ),
    )
