"""From a ``StepPlan`` (block ids, positions) to the tensors of one forward.

Everything is assembled in Python lists and moved to the device in one copy per tensor; the
sequences' block tables stay on the host (the scheduler edits them), the device only ever sees
this step's slice of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dpserve.engine.llama import ForwardBatch, PrefillSlice
from dpserve.engine.scheduler import PagedSequence, StepPlan


class TokenSequence(PagedSequence, Protocol):
    def token_at(self, position: int) -> int: ...

    def tokens_between(self, start: int, end: int) -> list[int]: ...


@dataclass(slots=True)
class BuiltBatch:
    batch: ForwardBatch
    sampled: list[TokenSequence]  # the sequences the logits' rows belong to, in order


def _slots(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_forward_batch(plan: StepPlan, block_size: int, device: torch.device) -> BuiltBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    decodes: list[TokenSequence] = plan.decodes  # type: ignore[assignment]
    for sequence in decodes:
        position = sequence.num_cached
        input_ids.append(sequence.token_at(position))
        positions.append(position)
        slots.append(sequence.blocks[position // block_size] * block_size + position % block_size)
        seq_lens.append(position + 1)
    block_tables = seq_lens_tensor = None
    if decodes:
        width = -(-max(seq_lens) // block_size)
        rows = [(s.blocks + [0] * width)[:width] for s in decodes]
        block_tables = torch.tensor(rows, dtype=torch.int32).to(device)
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32).to(device)

    prefills: list[PrefillSlice] = []
    logit_rows = list(range(len(decodes)))
    sampled: list[TokenSequence] = list(decodes)
    for chunk in plan.prefills:
        sequence: TokenSequence = chunk.sequence  # type: ignore[assignment]
        end = chunk.start + chunk.length
        offset = len(input_ids)
        input_ids += sequence.tokens_between(chunk.start, end)
        positions += range(chunk.start, end)
        slots += _slots(sequence.blocks, chunk.start, end, block_size)
        blocks = None
        if chunk.start:
            covering = sequence.blocks[: -(-end // block_size)]
            blocks = torch.tensor(covering, dtype=torch.long).to(device)
        prefills.append(PrefillSlice(offset, chunk.length, chunk.start, blocks))
        if chunk.completes_prefill:
            logit_rows.append(offset + chunk.length - 1)
            sampled.append(sequence)

    logits_indices = None
    if prefills:
        logits_indices = torch.tensor(logit_rows, dtype=torch.long).to(device)
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long).to(device),
        positions=torch.tensor(positions, dtype=torch.long).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
        num_decodes=len(decodes),
        block_tables=block_tables,
        seq_lens=seq_lens_tensor,
        prefills=prefills,
        logits_indices=logits_indices,
    )
    return BuiltBatch(batch, sampled)
