"""From a ``StepPlan`` (block ids, positions) to the tensors of one forward.

Everything is assembled in Python lists and moved to the device in one copy per tensor; the
sequences' block tables stay on the host (the scheduler edits them), the device only ever sees
this step's slice of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from dpserve.engine.llama import ForwardBatch, PrefillSlice
from dpserve.engine.scheduler import PagedSequence, StepPlan


class TokenSequence(PagedSequence, Protocol):
    def token_at(self, position: int) -> int: ...

    def tokens_between(self, start: int, end: int) -> list[int]: ...

    @property
    def wants_prompt_logprobs(self) -> bool: ...

    def prompt_length(self) -> int: ...


T = TypeVar("T", bound=TokenSequence)


@dataclass(slots=True)
class BuiltBatch(Generic[T]):
    batch: ForwardBatch
    sampled: list[T]  # the sequences the logits' first rows belong to, in order
    # After those, rows at prompt positions of sequences that want prompt log-probs:
    # (sequence, first position, count); position p's row predicts prompt token p + 1.
    prompt_rows: list[tuple[T, int, int]] = field(default_factory=list)


def _slots(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_forward_batch(plan: StepPlan[T], block_size: int, device: torch.device) -> BuiltBatch[T]:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    decodes = plan.decodes
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
    prompt_rows: list[tuple[T, int, int]] = []
    prompt_logit_rows: list[int] = []
    logit_rows = list(range(len(decodes)))
    sampled = list(decodes)
    for chunk in plan.prefills:
        sequence = chunk.sequence
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
        if sequence.wants_prompt_logprobs:
            count = min(end, sequence.prompt_length() - 1) - chunk.start
            if count > 0:
                prompt_rows.append((sequence, chunk.start, count))
                prompt_logit_rows += range(offset, offset + count)

    logits_indices = None
    if prefills:
        logits_indices = torch.tensor(logit_rows + prompt_logit_rows, dtype=torch.long).to(device)
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
    return BuiltBatch(batch, sampled, prompt_rows)
