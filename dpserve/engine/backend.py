"""What ``ModelRunner`` needs of the part that owns the KV cache and runs the model.

Two implementations: ``paged_runner.PagedRunner`` (our Llama executor over the paged cache) and
``hf_runner.HFBatchRunner`` (transformers' forward, for every other architecture). The runner
keeps what is common: request validation, sampling, the finishing rules and the updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dpserve.engine.sequences import Sequence

# Called with the sequences whose next token is due and their logits ([rows, vocab]); samples,
# applies the finishing rules and returns the rows that finished.
Consume = Callable[[list[Sequence], torch.Tensor], set[int]]


class Backend(Protocol):
    capacity: int  # sequences decoded together at most
    context_size: int  # tokens a sequence may hold (prompt + generated)

    def add(self, sequence: Sequence) -> None: ...

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running sequence; False if unknown."""

    def has_work(self) -> bool: ...

    def step(self, consume: Consume) -> None:
        """One forward (or two) over the sequences it schedules; ``consume`` gets the logits."""

    def release(self) -> None:
        """Free the model's and the cache's memory; running sequences wait again and are
        recomputed (prompt + generated) after ``reload``."""

    def reload(self, model: Any) -> None: ...

    def describe(self) -> dict[str, Any]:
        """Static facts for the start-up log and ``stats()`` (executor, pool sizes)."""

    def stats(self) -> dict[str, Any]: ...
