"""The transformers fallback: continuous batching over a model's own forward.

Serves every architecture our Llama forward (``llama``) does not cover. Why this design: on
CPU, transformers' own continuous batching (``generate_batch``, paged cache) ran at 0.2-1.2x
sequential ``generate``, while a plain batched forward loop over a KV cache reaches 8-12x
sequential and 1.3-1.4x one static ``generate`` batch (32 requests, 2-core CPU), and is exact:

* All running sequences share one batched ``DynamicCache``, **left padded**: every row ends at
  the same column, so one decode step appends one column for everybody. Each row carries its
  own length; the attention mask (``column >= width - length``) hides the padding and explicit
  ``position_ids`` give every row its true positions, so a row computes exactly what it would
  alone.
* Every ``step()``: (1) one decode forward for the running rows, (2) retire the rows that
  finished (``finish``: index-select the batch dimension, then drop leading columns that are
  padding for every remaining row), (3) admit waiting requests up to ``max_num_seqs`` and
  ``max_num_batched_tokens``,
  prefill them as their own left-padded batch and merge that cache into the running one. The
  cache is only re-concatenated when rows join or leave: its layers (``_SlackLayer``) keep
  spare columns, so a decode step writes one column in place.
* No chunked prefill: the tokens one prefill forward may process (rows x longest context,
  padding included) are bounded, so a burst of arrivals is spread over several steps; a single
  prompt over the budget is still admitted, alone.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from dpserve.engine.backend import Sampled, sample
from dpserve.engine.sequences import Sequence

# Spare cache columns allocated beyond the current width: a buffer copy every this many steps
# instead of a full-cache concatenation on every step.
_SLACK_COLUMNS: Final = 64


class HFBackend:
    """Left-padded continuous batching over ``model``'s transformers forward (implements
    ``backend.Backend``)."""

    computes_prompt_logprobs = False  # logits only where a token is sampled

    def __init__(
        self, model: Any, *, max_num_seqs: int, max_num_batched_tokens: int, pad_id: int
    ) -> None:
        self.model = model
        self.device: torch.device = model.device
        self.max_num_seqs = max_num_seqs
        self.context_size: int = int(
            model.config.get_text_config(decoder=True).max_position_embeddings
        )
        self.max_num_batched_tokens = max_num_batched_tokens
        if self.device.type == "cuda":
            # cuDNN's SDPA rebuilds its plan whenever the KV length changes: 2.6x slower
            # end to end on an H100 (issue 10). Process-wide, as this process is one engine.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._pad_id = pad_id
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        # The running batch: one cache row per running sequence, in the same order.
        self._cache: Any = None
        self._width = 0  # columns of the cache (the longest row's length)
        self._padded = False  # some row is shorter than the width (changes on join/leave only)
        self._lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self.prefill_tokens = 0

    def describe(self) -> dict[str, Any]:
        return {"backend": "transformers", "max_num_seqs": self.max_num_seqs}

    def stats(self) -> dict[str, Any]:
        return {
            "waiting": len(self._waiting),
            "running": len(self._running),
            "prefill_tokens": self.prefill_tokens,
            "cache_width": self._width,
        }

    def add(self, sequence: Sequence) -> None:
        self._waiting.append(sequence)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def cancel(self, request_id: int) -> bool:
        for sequence in self._waiting:
            if sequence.request_id == request_id:
                self._waiting.remove(sequence)
                return True
        for row, sequence in enumerate(self._running):
            if sequence.request_id == request_id:
                self._retire({row})
                return True
        return False

    def release(self) -> None:
        """Running sequences go back to the front of the queue; they are prefilled again
        (prompt + generated) on the model passed to ``reload``."""
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self._clear_batch()
        self.model = None

    def reload(self, model: Any) -> None:
        self.model = model

    def step(self) -> list[Sampled]:
        sampled = []
        if self._running:
            sampled.append(sample(list(self._running), self._decode_forward()))
        admitted = self._admit()
        if admitted:
            cache, logits, width = self._prefill_forward(admitted)
            sampled.append(sample(admitted, logits))
            self._merge(admitted, cache, width)
        return sampled

    def finish(self, sequences: list[Sequence]) -> None:
        done = set(map(id, sequences))
        rows = {row for row, sequence in enumerate(self._running) if id(sequence) in done}
        if rows:
            self._retire(rows)

    # ---------------------------------------------------------------------------- forwards

    def _decode_forward(self) -> torch.Tensor:
        batch = len(self._running)
        width = self._width + 1
        mask = None  # no padding: transformers then skips building a mask
        if self._padded:
            # Row r's real columns are its last lengths[r] + 1 (the new token included).
            columns = torch.arange(width, device=self.device)
            mask = (columns.unsqueeze(0) >= (self._width - self._lengths).unsqueeze(1)).long()
        last_tokens = torch.tensor([s.tokens[-1] for s in self._running], dtype=torch.long)
        output = self.model(
            input_ids=last_tokens.to(self.device).view(batch, 1),
            attention_mask=mask,
            position_ids=self._lengths.view(batch, 1),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._width = width
        self._lengths += 1
        logits: torch.Tensor = output.logits[:, -1, :]
        return logits

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        longest = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_num_seqs:
            length = self._waiting[0].context_length()
            new_longest = max(longest, length)
            if admitted and new_longest * (len(admitted) + 1) > self.max_num_batched_tokens:
                break
            longest = new_longest
            admitted.append(self._waiting.popleft())
        return admitted

    def _prefill_forward(self, sequences: list[Sequence]) -> tuple[Any, torch.Tensor, int]:
        contexts = [sequence.context() for sequence in sequences]
        width = max(len(context) for context in contexts)
        input_ids = torch.full((len(contexts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[row, width - len(context) :] = 1
        # Padding columns get position 0; they are masked out and never attended to.
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        output = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=position_ids.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.prefill_tokens += sum(len(context) for context in contexts)
        return cache, output.logits[:, -1, :], width

    # ------------------------------------------------------------------------ batch state

    def _clear_batch(self) -> None:
        self._cache = None
        self._width = 0
        self._padded = False
        self._lengths = torch.zeros(0, dtype=torch.long, device=self.device)

    def _retire(self, rows: set[int]) -> None:
        """Drop rows from the running batch, then the leading columns nobody needs any more."""
        keep = [row for row in range(len(self._running)) if row not in rows]
        self._running = [self._running[row] for row in keep]
        if not keep:
            self._clear_batch()
            return
        index = torch.tensor(keep, device=self.device)
        self._lengths = self._lengths.index_select(0, index)
        new_width = int(self._lengths.max())
        for layer in self._cache.layers:
            layer.select_rows(index)
            layer.drop_leading(self._width - new_width)
        self._width = new_width
        self._padded = int(self._lengths.min()) < new_width

    def _merge(self, sequences: list[Sequence], cache: Any, width: int) -> None:
        """Add freshly prefilled rows to the batch (those that finish on their first token
        leave again through ``finish``)."""
        # Called before the sampled tokens are accepted: the cache holds the whole context,
        # and the token just sampled is fed by the next decode step.
        new_lengths = torch.tensor(
            [sequence.context_length() for sequence in sequences], dtype=torch.long
        ).to(self.device)
        layers = cache.layers
        self._running.extend(sequences)
        if self._cache is None:
            self._cache = DynamicCache()
            self._cache.layers = [_SlackLayer(layer.keys, layer.values) for layer in layers]
            self._cache.layer_class_to_replicate = None
            self._width, self._lengths = width, new_lengths
            self._padded = int(new_lengths.min()) < width
            return
        merged_width = max(self._width, width)
        for old, new in zip(self._cache.layers, layers, strict=True):
            old._reset(
                torch.cat([_pad_left(old.keys, merged_width), _pad_left(new.keys, merged_width)]),
                torch.cat(
                    [_pad_left(old.values, merged_width), _pad_left(new.values, merged_width)]
                ),
            )
        self._width = merged_width
        self._lengths = torch.cat([self._lengths, new_lengths])
        self._padded = int(self._lengths.min()) < merged_width


class _SlackLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values sit in buffers with spare columns on the right.

    ``DynamicLayer.update`` concatenates, copying the whole cache for every generated token;
    here a decode step writes one column in place and the buffers grow by a chunk only when
    full. ``keys`` / ``values`` stay views of the filled part, so everything in transformers
    that reads them (sequence length, mask sizes) works unchanged.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # transformers leaves DynamicLayer.__init__ unannotated (no -> None).
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._key_buffer = self._value_buffer = keys  # replaced by _reset
        self._length = 0
        self._reset(keys, values)

    def _reset(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, length, _ = keys.shape
        capacity = length + _SLACK_COLUMNS
        self._key_buffer = keys.new_empty((batch, heads, capacity, keys.shape[3]))
        self._value_buffer = values.new_empty((batch, heads, capacity, values.shape[3]))
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self._set_length(length)

    def _set_length(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make ``keys`` / ``values`` views of the first ``length`` columns; returns them."""
        self._length = length
        keys, values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]
        self.keys, self.values = keys, values
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._length, self._length + key_states.shape[2]
        if end > self._key_buffer.shape[2]:
            # Copies the filled part into buffers with fresh spare columns.
            self._reset(self._key_buffer[:, :, :start], self._value_buffer[:, :, :start])
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        return self._set_length(end)

    def select_rows(self, index: torch.Tensor) -> None:
        self._key_buffer = self._key_buffer.index_select(0, index)
        self._value_buffer = self._value_buffer.index_select(0, index)
        self._set_length(self._length)

    def drop_leading(self, columns: int) -> None:
        """Forget the first ``columns`` positions (padding for every remaining row)."""
        if columns:
            self._key_buffer = self._key_buffer[:, :, columns:]
            self._value_buffer = self._value_buffer[:, :, columns:]
            self._set_length(self._length - columns)


def _pad_left(states: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad ``[batch, heads, length, dim]`` on the left of the sequence dimension."""
    missing = width - states.shape[2]
    if missing == 0:
        return states
    return torch.nn.functional.pad(states, (0, 0, missing, 0))
