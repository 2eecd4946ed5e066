"""What ``ModelRunner`` needs of the part that owns the KV cache and runs the model: a
``Backend``.

Two implementations: ``paged.backend.PagedBackend`` (our forward, a ``models`` class, over the
paged cache) and ``hf_backend.HFBackend`` (transformers' forward, for every other
architecture). A backend schedules, runs the model and samples; it returns the sampled tokens
(``Sampled``) and never calls back up. The runner keeps what is common: request validation,
the finishing rules (``Sequence.accept``) and the updates; it tells the backend which
sequences finished (``finish``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dpserve.engine.sample import grammar, penalties, sampler
from dpserve.engine.sequences import Sequence


@dataclass(slots=True)
class Sampled:
    """One token per sequence whose next token was due in a step, in the same order."""

    sequences: list[Sequence]
    tokens: list[int]
    logprobs: list[float] | None  # one per token when some sequence asked for them
    # Per token its top_logprobs alternatives, when some sequence asked ([] for one that did not).
    top: list[list[tuple[int, float]]] | None = None


def token_histories(sequences: list[Sequence]) -> list[penalties.RowTokens] | None:
    """Each row's tokens as its penalties count them, when a row has penalties: what each
    penalized sequence keeps between steps (``penalties.PenaltyTokens``)."""
    if not any(sequence.params.has_penalties for sequence in sequences):
        return None
    counted: list[penalties.RowTokens] = []
    for sequence in sequences:
        params = sequence.params
        if not params.has_penalties:
            counted.append(penalties.NO_TOKENS)
            continue
        kept = sequence.penalty_tokens
        if kept is None:
            kept = sequence.penalty_tokens = penalties.PenaltyTokens(
                sequence.request.prompt_tokens, params.repetition_penalty != 1.0
            )
        counted.append(kept.counts(sequence.tokens))
    return counted


def grammar_matchers(sequences: list[Sequence]) -> list[grammar.Matcher | None] | None:
    """Each row's grammar matcher, when a row has structured output."""
    matchers = [sequence.matcher for sequence in sequences]
    return matchers if any(matcher is not None for matcher in matchers) else None


def sample(sequences: list[Sequence], logits: torch.Tensor) -> Sampled:
    """One token per row of ``logits`` and, when a row asks for them, the log-probabilities
    (and alternatives), with one device-to-host copy. A seeded row's noise depends on the
    position of the token it samples, so a preempted or resumed sequence draws the same tokens
    again. Penalties count each row's prompt and generated tokens; a structured row's matcher
    masks what its grammar does not allow."""
    params = [sequence.params for sequence in sequences]
    positions = [sequence.context_length() for sequence in sequences]
    matchers = grammar_matchers(sequences)
    allowed = None
    if matchers is not None:
        allowed = grammar.allowed(matchers, logits.shape[1], logits.device)
    host = sampler.sample(logits, params, positions, token_histories(sequences), allowed).to_host()
    return Sampled(sequences, host.tokens, host.logprobs, host.top)


class Backend(Protocol):
    max_num_seqs: int  # sequences running at once at most (the engine's capacity)
    context_size: int  # tokens a sequence may hold (prompt + generated)
    model: Any  # what the forward runs (our ``PagedLlama`` or the transformers model)
    # Whether it computes logits at prompt positions (prompt_logprobs, echo with logprobs).
    computes_prompt_logprobs: bool

    def add(self, sequence: Sequence) -> None: ...

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running sequence; False if unknown."""

    def has_work(self) -> bool: ...

    def step(self) -> list[Sampled]:
        """One forward (or two) over the sequences it schedules; the tokens sampled."""

    def finish(self, sequences: list[Sequence]) -> None:
        """Forget sequences that finished (their blocks or cache rows are freed)."""

    def release(self) -> None:
        """Free the model's and the cache's memory; running sequences wait again and are
        recomputed (prompt + generated) after ``reload``."""

    def reload(self, model: Any) -> None: ...

    def describe(self) -> dict[str, Any]:
        """Static facts for the start-up log and ``stats()`` (backend, pool sizes)."""

    def stats(self) -> dict[str, Any]: ...
