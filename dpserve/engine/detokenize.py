"""Text for what an engine sends: each request's tokens become text deltas on the engine, so
the coordinator only forwards them (its one loop carries every engine's streams).

The tokenizer is the runner's own (a model runner's transformers tokenizer); a runner without
one (the fake runner, whose tokens are ASCII letters) is read with the byte tokenizer, as the
coordinator's default reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpserve.engine.runner import Runner
from dpserve.tokenizer import BatchTokenizer, IncrementalDetokenizer, as_batch_tokenizer


class RequestText:
    """Makes an ``IncrementalDetokenizer`` per request with the runner's tokenizer."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._tokenizer: BatchTokenizer | None = None

    @property
    def tokenizer(self) -> BatchTokenizer:
        # Resolved on first use: a model runner holds its tokenizer once its model loaded.
        if self._tokenizer is None:
            self._tokenizer = as_batch_tokenizer(self.runner.tokenizer)
        return self._tokenizer

    def start(self, resume_tokens: Sequence[int]) -> IncrementalDetokenizer:
        """The text state of a request that continues after ``resume_tokens``."""
        return IncrementalDetokenizer(self.tokenizer, resume_tokens)
