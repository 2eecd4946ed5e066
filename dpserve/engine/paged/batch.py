"""From a ``StepPlan`` (block ids, positions) to the tensors of one forward, with host work
proportional to what changed since the last step.

The block tables live on the device, in one persistent ``[rows, max_blocks]`` int32 table
(``BatchBuilder.table``), with a copy on the host (on CPU they are one array): a sequence gets
a row when it first runs and keeps it until it is finished, cancelled or preempted; block ids
the scheduler appended since the last step (``StepPlan.grown``, new sequences) are written into
both with one small copy (usually none: a decode needs a new block every ``block_size``
tokens). Per step the host computes each token's position and slot from its copy with numpy
(a few vector operations, ~1 us each, where each torch operation costs several) and sends
tokens, positions, slots, the decodes' table rows and lengths as one buffer; the decodes' block
tables are gathered from the device's table. Host buffers are pinned on CUDA and copied without
blocking. A fed token still on the device (``pending``) is sent as 0 and patched there. While
the same sequences decode step after step (most steps), their table rows and positions are
carried over from the last step (one position further) and their fed tokens are those the last
step sampled: nothing is read per sequence.

A sequence whose first scheduled token is not position 0 (a chunked prefill continuing, a
prefix-cache hit) is handled like any chunk: its cached part is read through its table row.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from dpserve.engine.lora.delta import StepAdapters, group_rows
from dpserve.engine.lora.weights import AdapterWeights
from dpserve.engine.models.base import ForwardBatch, PrefillSlice
from dpserve.engine.paged.scheduler import PagedSequence, StepPlan


class TokenSequence(PagedSequence, Protocol):
    lora_slot: int  # the slot of its LoRA adapter (``lora.slots``); -1: the base model

    def token_at(self, position: int) -> int: ...

    def last_token(self) -> int: ...

    def tokens_between(self, start: int, end: int) -> list[int]: ...

    def prompt_length(self) -> int: ...


T = TypeVar("T", bound=TokenSequence)


@dataclass(slots=True)
class BuiltBatch(Generic[T]):
    batch: ForwardBatch
    sampled: list[T]  # the sequences the logits' first rows belong to, in order
    # After those, rows at prompt positions of sequences that want prompt log-probs:
    # (sequence, first position, count); position p's row predicts prompt token p + 1.
    prompt_rows: list[tuple[T, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class PendingTokens:
    """Fed tokens that are still on the device: ``input_ids[rows] = tokens[sources]``, applied
    where the forward runs (after the step that samples them)."""

    rows: list[int]  # rows of this batch
    sources: list[int]  # rows of the previous step's sampled tokens


class BatchBuilder(Generic[T]):
    """Persistent inputs for up to ``max_rows`` running sequences of at most ``max_blocks``
    blocks each."""

    def __init__(
        self, max_rows: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.device = device
        self._pin = device.type == "cuda"
        # Row r holds the block ids of the sequence in row r; unused entries point at block 0
        # (reserved, never handed out): a row is cleared before it is handed out again.
        # The host keeps a copy (``_host_table``) to compute slot mappings with numpy, whose
        # small operations cost ~1 us of host time where torch's cost 3-10: on CPU the two are
        # one array.
        self._host_table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.table = torch.from_numpy(self._host_table).to(device)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._row: dict[T, int] = {}
        self._written: dict[T, int] = {}  # block ids of a sequence already in its row
        self._to_clear: list[int] = []  # rows released since the last step
        # The last step's decodes, their table rows and fed positions: while the same
        # sequences decode (most steps), each is one position further and nothing is read
        # per sequence.
        self._decodes: list[T] | None = None  # None: read them from the sequences
        self._decode_rows = np.empty(0, dtype=np.int64)
        self._decode_positions = np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------------------------- rows

    def release(self, sequence: T) -> None:
        """The sequence no longer runs (finished, cancelled, preempted: its blocks were freed,
        new ones will be written from the start): free its row."""
        row = self._row.pop(sequence, None)
        if row is not None:
            self._decodes = None  # its row may be another sequence's by the next step
            del self._written[sequence]
            self._free_rows.append(row)
            self._to_clear.append(row)

    def _sync_rows(self, plan: StepPlan[T]) -> None:
        """Give new sequences a row and append the block ids added since the last step."""
        if self._to_clear:
            self._host_table[self._to_clear] = 0
            if self.device.type != "cpu":
                self.table[self._to_device(self._to_clear)] = 0
            self._to_clear = []
        rows: list[int] = []
        columns: list[int] = []
        ids: list[int] = []
        written_of = self._written
        # Only sequences that are new or got blocks since the last step do any work: decodes
        # get blocks only from the scheduler's ``grown``, new sequences start as prefills.
        sequences = [*plan.grown, *(chunk.sequence for chunk in plan.prefills)]
        for sequence in [s for s in sequences if written_of.get(s) != len(s.blocks)]:
            written = written_of.get(sequence)
            if written is None:
                self._row[sequence] = self._free_rows.pop()
                written = 0
            blocks = sequence.blocks
            if len(blocks) > written:
                row = self._row[sequence]
                new = blocks[written:]
                rows += [row] * len(new)
                columns += range(written, len(blocks))
                ids += new
            written_of[sequence] = len(blocks)
        if ids:
            self._host_table[rows, columns] = ids
            if self.device.type != "cpu":
                update = self._to_device(rows, columns, ids)
                self.table[update[0], update[1]] = update[2].to(torch.int32)

    def _to_device(self, *columns: list[int]) -> torch.Tensor:
        """Equal-length int lists as one int64 tensor on the device: ``[n]`` for one,
        ``[len(columns), n]`` for more. Through an ``array`` buffer: ``torch.tensor`` of a
        Python list costs 3-4x more host time."""
        values = array("q", columns[0])
        for column in columns[1:]:
            values.extend(column)
        host = (
            torch.frombuffer(values, dtype=torch.long)
            if values
            else torch.empty(0, dtype=torch.long)
        )
        if len(columns) > 1:
            host = host.view(len(columns), -1)
        if self._pin:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------------------ build

    def _decode_rows_and_positions(self, decodes: list[T]) -> tuple[np.ndarray, np.ndarray]:
        """The decodes' table rows and fed positions (``num_cached``)."""
        if decodes != self._decodes:  # identity per element: Sequence compares by identity
            self._decodes = decodes
            self._decode_rows = np.array([self._row[s] for s in decodes], dtype=np.int64)
            self._decode_positions = np.array([s.num_cached for s in decodes], dtype=np.int64)
        else:  # the last step committed them: each is one token further
            self._decode_positions = self._decode_positions + 1
        return self._decode_rows, self._decode_positions

    def build(
        self,
        plan: StepPlan[T],
        pending: dict[T, int] | None = None,
        last_sampled: tuple[list[T], list[int]] | None = None,
        adapter_weights: dict[int, AdapterWeights] | None = None,
    ) -> tuple[BuiltBatch[T], PendingTokens | None]:
        """The forward's tensors for ``plan``. ``pending``: decoding sequences whose fed token
        is not on the host yet, and its row in the previous step's sampled tokens.
        ``last_sampled``: the sequences of the last step whose tokens the host took in (all of
        them accepted since), and those tokens: when they are the decodes, in order, those
        are the tokens fed. ``adapter_weights``: slot -> LoRA weights, when the engine has
        adapters (each row then runs with its sequence's)."""
        self._sync_rows(plan)
        block_size = self.block_size
        row_of = self._row
        decodes = plan.decodes
        # One row per decode and per prefill chunk: (token or 0, first position, table row).
        decode_rows, decode_positions = self._decode_rows_and_positions(decodes)
        longest = int(decode_positions.max()) if len(decodes) else 0
        starts: list[int] = []
        table_rows: list[int] = []
        late = PendingTokens([], [])
        if last_sampled is not None and not pending and last_sampled[0] == decodes:
            tokens = list(last_sampled[1])
        elif pending:
            # Their fed token is the one the previous step sampled: 0 here, patched on the
            # device (apply_pending).
            tokens = []
            for index, sequence in enumerate(decodes):
                source = pending.get(sequence)
                if source is None:
                    tokens.append(sequence.token_at(sequence.num_cached))
                else:
                    tokens.append(0)
                    late.rows.append(index)
                    late.sources.append(source)
        else:
            tokens = [sequence.last_token() for sequence in decodes]
        num_decodes = len(decodes)
        sampled = list(decodes)
        logit_rows = list(range(num_decodes)) if plan.prefills else []  # with prefills only
        prompt_rows: list[tuple[T, int, int]] = []
        prompt_logit_rows: list[int] = []
        lengths: list[int] = []
        prefills: list[PrefillSlice] = []
        offset = num_decodes
        for chunk in plan.prefills:
            sequence = chunk.sequence
            end = chunk.start + chunk.length
            tokens += sequence.tokens_between(chunk.start, end)
            starts.append(chunk.start)
            table_rows.append(row_of[sequence])
            lengths.append(chunk.length)
            blocks = None
            if chunk.start:  # the chunk reads what is cached before it
                row = row_of[sequence]
                blocks = self.table[row, : -(-end // block_size)].long()
            prefills.append(PrefillSlice(offset, chunk.length, chunk.start, blocks))
            if sequence.wants_prompt_logprobs:
                count = min(end, sequence.prompt_length() - 1) - chunk.start
                if count > 0:
                    prompt_rows.append((sequence, chunk.start, count))
                    prompt_logit_rows += range(offset, offset + count)
            offset += chunk.length
            if chunk.completes_prefill:
                logit_rows.append(offset - 1)
                sampled.append(sequence)

        # Positions, table rows and slots on the host (numpy), sent with the tokens, the
        # decodes' rows and their lengths as one int64 buffer: one copy, no per-step ops on
        # the device but the block tables' gather.
        total = offset
        if prefills:
            # Each chunk's positions run from its start: repeat per token, add the offsets.
            counts = np.array(lengths, dtype=np.int64)
            chunk_offsets = np.cumsum(counts) - counts
            within = np.arange(total - num_decodes) - np.repeat(chunk_offsets, counts)
            chunk_starts = np.array(starts, dtype=np.int64)
            chunk_rows = np.array(table_rows, dtype=np.int64)
            positions = np.concatenate([decode_positions, np.repeat(chunk_starts, counts) + within])
            token_rows = np.concatenate([decode_rows, np.repeat(chunk_rows, counts)])
        else:
            positions, token_rows = decode_positions, decode_rows
        # [tokens | positions | slots | decodes' table rows | their lengths as int32 pairs],
        # each segment starting on a 16-byte boundary: Triton compiles a kernel once per
        # pointer alignment class, so a segment that started mid-way would make a step of an
        # odd size compile a variant the start-up warm-up never ran (0.4 s stalls, H200).
        sizes = [total, total, total, num_decodes, (num_decodes + 1) // 2]
        ends = np.cumsum([size + (size & 1) for size in sizes])
        starts_at = [0, *ends[:-1].tolist()]
        packed = np.empty(int(ends[-1]), dtype=np.int64)
        segment = [packed[start : start + n] for start, n in zip(starts_at, sizes, strict=True)]
        segment[0][:] = tokens
        segment[1][:] = positions
        slots = segment[2]
        block_index = positions // block_size
        np.multiply(
            self._host_table[token_rows, block_index], block_size, out=slots, dtype=np.int64
        )
        slots += positions - block_index * block_size
        segment[3][:] = decode_rows
        segment[4].view(np.int32)[:num_decodes] = decode_positions + 1
        host = torch.from_numpy(packed)
        if self._pin:
            host = host.pin_memory()
        sent = host.to(self.device, non_blocking=True)
        input_ids, positions_sent, slots_sent, sent_rows, sent_lengths = (
            sent[start : start + n] for start, n in zip(starts_at, sizes, strict=True)
        )

        block_tables = seq_lens = None
        if decodes:
            width = -(-(longest + 1) // block_size)
            if self.device.type == "cpu":  # the host table is the table: gather with numpy
                block_tables = torch.from_numpy(self._host_table[decode_rows, :width])
            else:
                block_tables = self.table[:, :width].index_select(0, sent_rows)
            seq_lens = sent_lengths.view(torch.int32)[:num_decodes]
        # Prompt log-prob rows come after the sampled ones.
        logits_indices = self._to_device(logit_rows + prompt_logit_rows) if prefills else None
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions_sent,
            slot_mapping=slots_sent,
            num_decodes=num_decodes,
            block_tables=block_tables,
            seq_lens=seq_lens,
            prefills=prefills,
            logits_indices=logits_indices,
            adapters=None
            if adapter_weights is None
            else _step_adapters(plan, adapter_weights, self.device),
        )
        return BuiltBatch(batch, sampled, prompt_rows), (late if late.rows else None)


def _step_adapters(
    plan: StepPlan[T], weights: dict[int, AdapterWeights], device: torch.device
) -> StepAdapters | None:
    """The step's rows grouped by LoRA adapter (decode rows first, then each chunk's, as
    ``build`` lays them out); None when none of its sequences has one."""
    row_slots = [sequence.lora_slot for sequence in plan.decodes]
    for chunk in plan.prefills:
        row_slots += [chunk.sequence.lora_slot] * chunk.length
    if max(row_slots, default=-1) < 0:
        return None
    return group_rows(row_slots, weights, device)


def apply_pending(batch: ForwardBatch, late: PendingTokens, tokens: torch.Tensor) -> None:
    """Feed the tokens the previous step sampled on the device into ``batch`` (in stream
    order, after that step)."""
    device = batch.input_ids.device
    rows = torch.tensor(late.rows, dtype=torch.long).to(device, non_blocking=True)
    sources = torch.tensor(late.sources, dtype=torch.long).to(device, non_blocking=True)
    batch.input_ids.index_copy_(0, rows, tokens.index_select(0, sources))


def pad_decodes(batch: ForwardBatch, rows: int) -> ForwardBatch:
    """A decode-only batch padded to ``rows`` rows. Padding rows feed token 0 at position 0,
    write their key/value to slot 0 (block 0, never handed out) and attend to that one slot,
    as the CUDA graphs' padding does: they touch nothing a sequence owns, and their logits
    (the last rows) are dropped by the caller."""
    assert not batch.prefills and batch.block_tables is not None and batch.seq_lens is not None
    extra = rows - batch.num_decodes
    zeros = batch.input_ids.new_zeros(extra)
    return ForwardBatch(
        input_ids=torch.cat([batch.input_ids, zeros]),
        positions=torch.cat([batch.positions, zeros]),
        slot_mapping=torch.cat([batch.slot_mapping, zeros]),
        num_decodes=rows,
        block_tables=torch.cat(
            [batch.block_tables, batch.block_tables.new_zeros(extra, batch.block_tables.shape[1])]
        ),
        seq_lens=torch.cat([batch.seq_lens, batch.seq_lens.new_ones(extra)]),
        prefills=[],
        logits_indices=None,
        adapters=batch.adapters,  # the padding rows are in no adapter's group
    )
