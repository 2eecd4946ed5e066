"""vLLM's penalties on a batch's scores, applied where they change something.

``repetition_penalty`` divides a positive score (multiplies a negative one) of every token in
the prompt or the output; ``frequency_penalty`` x the token's count in the output and
``presence_penalty`` (once) are subtracted. Only the tokens a row has seen can change, so the
scores are gathered and written back at those (row, token) positions alone: a step's cost is
its rows' distinct tokens, not rows x vocabulary. The dense form (counts and masks of
``[rows, vocab]``, about fifteen passes over them) cost ~0.5 ms a penalized row a step on a
CPU, 13-19x what sampling such a row costs without penalties (bench/penalties.py).

A row's tokens come as plain lists (``TokenHistory``), or as what a sequence keeps between
steps (``PenaltyTokens.counts``: its distinct tokens and their counts, grown by the tokens
appended since the last step, so a step's Python work does not grow with the history either).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dpserve.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What a row's penalties count, as lists: its prompt and the tokens generated so far."""

    prompt: Sequence[int]
    generated: Sequence[int]


@dataclass(frozen=True, slots=True)
class PenaltyCounts:
    """A row's tokens as the penalties read them: its distinct generated tokens with their
    counts, and (for a repetition penalty) every distinct token of its prompt and output."""

    generated: torch.Tensor  # int64 [distinct generated]
    counts: torch.Tensor  # float32, parallel to ``generated``
    seen: torch.Tensor  # int64 [distinct of prompt and output]; empty without repetition


RowTokens = TokenHistory | PenaltyCounts

# A row without penalties in a batch with some: nothing to count.
NO_TOKENS = PenaltyCounts(
    torch.empty(0, dtype=torch.long), torch.empty(0), torch.empty(0, dtype=torch.long)
)


class PenaltyTokens:
    """One sequence's tokens as its penalties count them, kept between steps: distinct
    generated tokens and their counts, and with ``repetition`` every distinct token of its
    prompt and output, each in a buffer grown by the tokens appended since the last step.
    Converting the lists every step cost the batch ~0.9 ms a step for a row of 10,000 tokens
    (AMD EPYC Zen 4), paid by every request in it."""

    __slots__ = ("_counts", "_done", "_generated", "_prompt", "_repetition", "_seen", "_slots")

    def __init__(self, prompt: Sequence[int], repetition: bool) -> None:
        # With a repetition penalty: the prompt's distinct tokens, sorted (looked up by
        # bisection when a token is generated for the first time).
        self._prompt = sorted(set(prompt)) if repetition else []
        self._repetition = repetition
        self._reset()

    def _reset(self) -> None:
        self._seen = _Buffer(torch.long, self._prompt)
        self._slots: dict[int, int] = {}  # generated token -> its place in the buffers below
        self._generated = _Buffer(torch.long, [])  # distinct, in ``_slots`` order
        self._counts = _Buffer(torch.float32, [])
        self._done = 0  # the generated tokens counted

    def counts(self, generated: Sequence[int]) -> PenaltyCounts:
        """The row's counts with ``generated``: its tokens so far, those of the last call and
        any appended since (fewer than counted before: counted afresh)."""
        if len(generated) < self._done:
            self._reset()
        for token in generated[self._done :]:
            slot = self._slots.get(token)
            if slot is not None:
                self._counts.add(slot, 1.0)
                continue
            self._slots[token] = len(self._slots)
            self._generated.append(token)
            self._counts.append(1.0)
            if self._repetition and not _in_sorted(self._prompt, token):
                self._seen.append(token)
        self._done = len(generated)
        return PenaltyCounts(self._generated.view(), self._counts.view(), self._seen.view())


def apply_penalties(
    scores: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    tokens: Sequence[RowTokens],
) -> torch.Tensor:
    """``scores`` (a new tensor) with the penalties of ``rows`` (``params`` and ``tokens`` are
    per row of the batch) applied at the tokens each has seen."""
    vocab = scores.shape[1]
    device = scores.device
    counted = [_counted(tokens[row], params[row].repetition_penalty != 1.0) for row in rows]
    flat = scores.reshape(-1).clone()
    row_ids = torch.tensor(rows, dtype=torch.long)
    seen_lengths = torch.tensor([len(row.seen) for row in counted])
    if int(seen_lengths.sum()):
        seen_rows = torch.repeat_interleave(row_ids, seen_lengths)
        where = (seen_rows * vocab + torch.cat([row.seen for row in counted])).to(device)
        repetition = torch.tensor(
            [params[row].repetition_penalty for row in rows], dtype=torch.float32
        )
        factor = torch.repeat_interleave(repetition, seen_lengths).to(device)
        values = flat[where]
        flat[where] = torch.where(values > 0, values / factor, values * factor)
    generated_lengths = torch.tensor([len(row.generated) for row in counted])
    if int(generated_lengths.sum()):
        generated_rows = torch.repeat_interleave(row_ids, generated_lengths)
        where = (generated_rows * vocab + torch.cat([row.generated for row in counted])).to(device)
        settings = torch.tensor(
            [[params[row].frequency_penalty, params[row].presence_penalty] for row in rows],
            dtype=torch.float32,
        )
        per_token = torch.repeat_interleave(settings, generated_lengths, dim=0)
        counts = torch.cat([row.counts for row in counted])
        penalty = (per_token[:, 0] * counts + per_token[:, 1]).to(device)
        flat[where] = flat[where] - penalty
    return flat.view_as(scores)


def _in_sorted(values: list[int], value: int) -> bool:
    at = bisect_left(values, value)
    return at < len(values) and values[at] == value


def _counted(tokens: RowTokens, repetition: bool) -> PenaltyCounts:
    """``tokens`` as counts (lists are counted here; a ``PenaltyCounts`` is as kept)."""
    if isinstance(tokens, PenaltyCounts):
        return tokens
    generated = torch.tensor(list(tokens.generated), dtype=torch.long)
    distinct, counts = torch.unique(generated, return_counts=True)
    seen = (
        torch.unique(torch.cat([torch.tensor(list(tokens.prompt), dtype=torch.long), distinct]))
        if repetition
        else NO_TOKENS.seen
    )
    return PenaltyCounts(distinct, counts.float(), seen)


class _Buffer:
    """A growing 1-D tensor: appends cost O(1) on average, ``view`` shares its memory."""

    __slots__ = ("_data", "_size")

    def __init__(self, dtype: torch.dtype, values: list[int]) -> None:
        self._data = torch.tensor(values, dtype=dtype) if values else torch.empty(16, dtype=dtype)
        self._size = len(values)

    def append(self, value: float) -> None:
        if self._size == len(self._data):
            grown = torch.empty(max(16, 2 * self._size), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size] = value
        self._size += 1

    def add(self, index: int, value: float) -> None:
        self._data[index] += value

    def view(self) -> torch.Tensor:
        return self._data[: self._size]
