"""Structured output: a grammar per request, applied as a token mask in the batched sampler.

Built on llguidance (chosen over xgrammar on this CPU, ``bench/grammar_mask.py`` and
BENCHMARKS.md "Structured output": on random walks over the tiny model's byte-level vocabulary
xgrammar let through byte sequences that are not UTF-8, so 8 of 10 outputs failed to decode or
validate, while every llguidance output validated; llguidance also compiles a schema in ~10 ms
instead of ~1.2 s for SmolLM2's vocabulary and fills its masks about 2x faster there). A
request's ``guided_json`` / ``guided_json_object`` / ``guided_regex`` / ``guided_choice``
becomes a grammar, each sequence gets its own matcher, and every step the matchers of the
sampled rows fill one packed bitmask for the batch in parallel (llguidance's executor runs them
on its own threads, outside the GIL), which becomes the sampler's ``allowed`` tensor. JSON is
generated compact (no free whitespace), so a random model cannot pad an answer with whitespace
until it runs out of tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from dpserve.engine.sample.finite_schema import finite_document_problem
from dpserve.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.sampling import SamplingParams

Matcher = llguidance.LLMatcher

# llguidance's default of 2000 Earley items in one row refuses an object of ~500 properties
# mid-generation ("Current row has 7207 items; max is 2000") after its first token. What a
# step costs is bounded by step_max_items (50,000 items, ~2.5 ms) whatever a row holds, so a
# row may hold as many: every object within max_constraint_bytes fits (64 KiB is ~2,000
# properties, ~8,000 items). The other limits keep llguidance's defaults.
PARSER_LIMITS = llguidance.LLParserLimits(max_items_in_row=50_000)
# Tokens a new matcher's copy is walked into its grammar at compile time (``Grammars._probe``).
PROBE_TOKENS = 8


class GrammarError(ValueError):
    """A request's constraint cannot be followed (it does not compile, admits no document, or
    is over a limit); the message names the problem. The request is refused (400)."""


class GrammarUnavailable(ValueError):
    """This model's tokenizer cannot drive the grammar library: no structured output here."""


def constraint_size(params: SamplingParams) -> int:
    """Bytes of a request's constraint as the limit ``max_constraint_bytes`` counts them."""
    texts = [params.guided_json or "", params.guided_regex or "", *params.guided_choice]
    return sum(len(text.encode()) for text in texts)


def first_line(message: str) -> str:
    """llguidance's error messages go on with a dump of the parser's state: the reason only."""
    return message.strip().split("\n", 1)[0][:500]


def grammar_of(params: SamplingParams) -> str:
    """The llguidance grammar of a request's structured-output constraint."""
    if params.guided_json is not None:
        return str(
            Matcher.grammar_from_json_schema(
                params.guided_json, defaults={"whitespace_flexible": False}
            )
        )
    if params.guided_json_object:
        return str(
            Matcher.grammar_from_json_schema(
                '{"type": "object"}', defaults={"whitespace_flexible": False}
            )
        )
    if params.guided_regex is not None:
        return str(Matcher.grammar_from_regex(params.guided_regex))
    if params.guided_choice:
        # Lark string literals take JSON's escapes.
        alternatives = " | ".join(json.dumps(choice) for choice in params.guided_choice)
        return str(Matcher.grammar_from_lark(f"start: {alternatives}"))
    raise ValueError("the request has no structured-output constraint")


class Grammars:
    """Builds matchers for one tokenizer and fills the batch's masks."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits
        self._stop_ids = frozenset(stop_token_ids)
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=sorted(self._stop_ids)
            )
        except Exception as exc:  # whatever it cannot read: a slow or an unusual tokenizer
            raise GrammarUnavailable(
                "structured output is not available for this model: the grammar library "
                f"(llguidance) cannot use its tokenizer ({type(tokenizer).__name__}: "
                f"{first_line(str(exc))})"
            ) from None

    def check_size(self, params: SamplingParams) -> None:
        """The cheap bound, checked before a compile is queued (raises ``GrammarError``)."""
        size, limit = constraint_size(params), self.limits.max_constraint_bytes
        if size > limit:
            raise GrammarError(
                f"the structured-output constraint has {size} bytes, over the limit "
                f"max_constraint_bytes={limit}"
            )

    def matcher(self, params: SamplingParams, consumed: Sequence[int] = ()) -> Matcher:
        """A matcher for a request that has already generated ``consumed`` (a resume), its
        first token mask computed (raises ``GrammarError``). Slow for a large constraint
        (llguidance drops the GIL while it builds): engines call it off their step loop,
        through ``constraint_compiler.ConstraintCompiler``."""
        self.check_size(params)
        if params.guided_json is not None:
            try:
                problem = finite_document_problem(json.loads(params.guided_json))
            except (ValueError, RecursionError) as exc:
                problem = f"guided_json is not a JSON schema this engine can read: {exc}"
            if problem is not None:
                raise GrammarError(problem)
        try:
            grammar = grammar_of(params)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise GrammarError(
                f"the structured-output constraint does not compile: {first_line(str(exc))}"
            ) from None
        matcher = Matcher(self._tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if matcher.is_error():
            raise GrammarError(
                "the structured-output constraint does not compile: "
                f"{first_line(matcher.get_error())}"
            )
        for token in consumed:  # generated elsewhere before a resume
            advance(matcher, token)
        self._probe(matcher)
        return matcher

    def _probe(self, matcher: Matcher) -> None:
        """Walk a copy of the matcher a few tokens into its grammar, always down the lowest
        allowed token that does not stop it (with byte-level vocabularies: the single bytes,
        which open a structure — ``{``, ``"``, ``[`` — before they close it), timing each
        mask. What fails here would fail the request in its first steps: a grammar that admits
        nothing (a $ref cycle with no way out: llguidance says NoExtensionBias), resumed tokens
        that left it, one of llguidance's limits, or a mask costlier than
        ``constraint_mask_timeout`` (it is computed on every step the request takes part in)."""
        probe = matcher.deep_copy()
        slowest = 0.0
        for _ in range(PROBE_TOKENS):
            # This thread's CPU time: a compile worker runs at a low priority, and its wall
            # time on a busy engine says more about the engine's load than about the mask.
            started = time.thread_time()
            mask = probe.compute_bitmask()
            slowest = max(slowest, time.thread_time() - started)
            if probe.is_error():
                raise GrammarError(
                    "the structured-output constraint admits no document or is beyond the "
                    f"grammar library's limits: {first_line(probe.get_error())}"
                )
            token = _lowest_open_token(mask, self.vocab_size, self._stop_ids)
            if token is None or probe.is_stopped():
                break
            probe.consume_token(token)
        if slowest > self.limits.constraint_mask_timeout:
            raise GrammarError(
                f"one token mask of the structured-output constraint takes "
                f"{slowest * 1000:.0f} ms, over the limit constraint_mask_timeout="
                f"{self.limits.constraint_mask_timeout:g} s (it would slow every step)"
            )


def _lowest_open_token(mask: bytes, vocab_size: int, stop_ids: frozenset[int]) -> int | None:
    """The lowest token id the packed mask allows that is not a stop token."""
    for index, byte in enumerate(mask):
        while byte:
            bit = byte & -byte
            token = index * 8 + bit.bit_length() - 1
            if token >= vocab_size:
                return None
            if token not in stop_ids:
                return token
            byte ^= bit
    return None


_executor: llguidance.LLExecutor | None = None


def allowed(
    matchers: Sequence[Matcher | None], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """``[rows, vocab]`` bool: the tokens each row's matcher allows (every token for a row
    without one); None when no row has a matcher. The masks are filled in parallel by
    llguidance's executor (its own threads, outside the GIL)."""
    global _executor
    rows = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return None
    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    # What llguidance.torch.fill_next_token_bitmask_par does, called directly: importing
    # llguidance.torch runs a torch.compile decorator, which imports dynamo and inductor
    # (~2.4 s of every engine's start, issue 20). The mask is a contiguous int32 CPU tensor.
    _executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, len(matchers))
    # int32 words, bit i of word w = token 32 w + i.
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
    return unpacked.reshape(len(matchers), -1)[:, :vocab_size].bool().to(device)


def advance(matcher: Matcher, token: int) -> None:
    """Feed a sampled token (one the mask allowed). Once the grammar is complete only stop
    tokens are allowed, and the request ends on one. A matcher that hits one of llguidance's
    limits on the way is left in its error state (``failure`` reads it)."""
    if not matcher.is_stopped():
        matcher.consume_token(token)


def failure(matcher: Matcher) -> str | None:
    """Why a running request's constraint can no longer be followed (llguidance reported an
    error while computing its mask or taking its token), else None."""
    if matcher.is_error():
        return (
            "the structured-output constraint failed during generation: "
            f"{first_line(matcher.get_error())}"
        )
    return None
