"""Structured output: a grammar per request, applied as a token mask in the batched sampler.

Built on xgrammar (see BENCHMARKS.md, "Structured output", for the comparison with llguidance
that chose it): a request's ``guided_json`` / ``guided_json_object`` / ``guided_regex`` /
``guided_choice`` is compiled once against the model's tokenizer (compiled grammars are cached
by the compiler), each sequence gets its own matcher, and every step the matchers of the sampled
rows fill one packed bitmask for the batch, which becomes the sampler's ``allowed`` tensor.
JSON is generated compact (no free whitespace), so a random model cannot pad an answer with
whitespace until it runs out of tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import xgrammar

from dpserve.sampling import SamplingParams


class GrammarError(ValueError):
    """A request's grammar does not compile; the message names the problem."""


class Grammars:
    """Compiles requests' grammars for one tokenizer and fills the batch's masks."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self._info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(self._info)

    def matcher(self, params: SamplingParams) -> xgrammar.GrammarMatcher:
        """A fresh matcher for a request (raises ``GrammarError``)."""
        try:
            return xgrammar.GrammarMatcher(self._compile(params))
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(
                f"the structured-output constraint does not compile: {exc}"
            ) from None

    def _compile(self, params: SamplingParams) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if params.guided_json is not None:
            return compiler.compile_json_schema(
                params.guided_json, any_whitespace=False, strict_mode=True
            )
        if params.guided_json_object:
            # Any JSON object: the schema form keeps the output compact like guided_json's.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if params.guided_regex is not None:
            return compiler.compile_regex(params.guided_regex)
        if params.guided_choice:
            alternatives = " | ".join(json.dumps(choice) for choice in params.guided_choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        raise ValueError("the request has no structured-output constraint")

    def allowed(
        self, matchers: Sequence[xgrammar.GrammarMatcher | None], device: torch.device
    ) -> torch.Tensor | None:
        """``[rows, vocab]`` bool: the tokens each row's matcher allows (every token for a row
        without one); None when no row has a matcher."""
        if all(matcher is None for matcher in matchers):
            return None
        bitmask = xgrammar.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, row)
        # int32 words, bit i of word w = token 32 w + i.
        bits = torch.arange(32, dtype=torch.int32)
        unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
        # A freshly allocated bitmask allows every token: rows without a matcher keep that.
        allowed = unpacked.reshape(len(matchers), -1)[:, : self.vocab_size].bool()
        return allowed.to(device)


def advance(matcher: xgrammar.GrammarMatcher, token: int) -> None:
    """Feed a sampled token; a token the mask allowed is always accepted, and after the grammar
    completed only stop tokens are allowed (the request then ends)."""
    if not matcher.is_terminated():
        matcher.accept_token(token)
