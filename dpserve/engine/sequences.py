"""One request's state in a runner, and the rules that finish it.

Finishing: ``num_tokens_to_generate`` (resume tokens included) or the context size ->
"length"; EOS / ``termination_id`` -> "stop", and like OpenAI the stop token is **not**
returned; a stop string -> "stop", with the returned tokens cut before the token in which the
stop string starts (the coordinator detokenizes tokens, so text can only be cut at token
boundaries). While the decoded tail could still become a stop string, those tokens are held
back rather than streamed, so nothing ever has to be taken back. ``ignore_eos`` turns the stop
tokens into ordinary tokens; before ``min_tokens`` tokens neither stop tokens nor stop strings
end a request (a stop token is then returned like any other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dpserve.engine.runner import RunnerRequest, TokenUpdate
from dpserve.sampling import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher as GrammarMatcher

TopEntry = tuple[int, float]

# Tokens before the first undecided one that are decoded with it when checking stop strings:
# detokenizers need a little left context (leading spaces, multi-byte characters).
_STOP_STRING_CONTEXT_TOKENS = 4

Decode = Callable[[list[int]], str]


@dataclass(eq=False, slots=True)
class Sequence:
    request: RunnerRequest
    params: SamplingParams
    max_generated: int  # num_tokens_to_generate clamped to the context size
    stop_ids: frozenset[int]  # empty with ignore_eos
    tokens: list[int] = field(default_factory=list)  # generated so far, resume tokens included
    logprobs: list[float] = field(default_factory=list)  # parallel to tokens[len(resume):]
    top_logprobs: list[list[TopEntry]] = field(default_factory=list)  # parallel to logprobs
    # prompt_logprobs: the prompt's tokens after the first, filled as prefill chunks run;
    # reported with the first update.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[TopEntry]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Structured output: the grammar matcher (``dpserve.engine.grammar``), None without one.
    matcher: GrammarMatcher | None = None
    stop_token: int | None = None  # the EOS / termination_id that ended it, reported once
    emitted: int = 0  # how many of ``tokens`` the caller has (resume tokens count as had)
    # The paged cache's view of it (see ``scheduler``): its blocks and cached context tokens.
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def context(self) -> list[int]:
        """Everything the model must have seen before sampling the next token."""
        return self.request.prompt_tokens + self.tokens

    def prompt_length(self) -> int:
        return len(self.request.prompt_tokens)

    def record_prompt_logprobs(
        self, start: int, logprobs: list[float], top: list[list[TopEntry]] | None
    ) -> None:
        """Log-probs of prompt tokens ``start + 1 ...`` (computed at positions ``start ...``); a
        prefill computed again after a preemption overwrites what it had."""
        del self.prompt_logprobs[start:]
        self.prompt_logprobs.extend(logprobs)
        if top is not None:
            del self.prompt_top_logprobs[start:]
            self.prompt_top_logprobs.extend(top)

    def context_length(self) -> int:
        return len(self.request.prompt_tokens) + len(self.tokens)

    def token_at(self, position: int) -> int:
        prompt = self.request.prompt_tokens
        return prompt[position] if position < len(prompt) else self.tokens[position - len(prompt)]

    def tokens_between(self, start: int, end: int) -> list[int]:
        prompt = self.request.prompt_tokens
        if end <= len(prompt):
            return prompt[start:end]
        return self.context()[start:end]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Logits are needed at every prompt position, not only the last. A sequence like this
        must compute its whole prompt: it must not take cached prefix blocks (the prefix cache
        checks this flag before sharing blocks with it)."""
        return self.params.prompt_logprobs and not self.prompt_logprobs_sent

    def accept(
        self,
        token: int,
        logprob: float | None,
        decode: Decode,
        top: list[TopEntry] | None = None,
    ) -> TokenUpdate | None:
        """Apply the finishing rules to a sampled token; the update to report, if any (one
        with a ``finish_reason`` when the sequence is done)."""
        finish: str | None = None
        early = len(self.tokens) < self.params.min_tokens
        if token in self.stop_ids and not early:
            finish = "stop"  # the stop token itself is not returned (as in OpenAI's API)
            ready = len(self.tokens)
            self.stop_token = token
        else:
            self.tokens.append(token)
            if logprob is not None and self.params.return_log_probs:
                self.logprobs.append(logprob)
                if self.params.top_logprobs:
                    self.top_logprobs.append(top or [])
            ready = len(self.tokens)
            if self.params.stop_strings and len(self.tokens) > self.params.min_tokens:
                ready, matched = self._scan_stop_strings(decode)
                if matched:
                    finish = "stop"
                    del self.tokens[ready:]
            if finish is None and len(self.tokens) >= self.max_generated:
                finish = "length"
                ready = len(self.tokens)
        if ready > self.emitted or finish is not None:
            return self.emit(ready, finish)
        return None

    def emit(self, ready: int, finish: str | None) -> TokenUpdate:
        start = self.emitted
        self.emitted = ready
        logprobs = top = None
        if self.params.return_log_probs:
            # logprobs has no entries for resume tokens: shift indices by their count.
            offset = len(self.request.resume_tokens)
            logprobs = self.logprobs[start - offset : ready - offset]
            if self.params.top_logprobs:
                top = self.top_logprobs[start - offset : ready - offset]
        update = TokenUpdate(self.request_id, self.tokens[start:ready], logprobs, finish, top)
        if finish is not None:
            update.stop_token = self.stop_token
        if self.params.prompt_logprobs and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            update.prompt_logprobs = self.prompt_logprobs
            update.prompt_top_logprobs = (
                self.prompt_top_logprobs if self.params.top_logprobs else None
            )
        return update

    def _scan_stop_strings(self, decode: Decode) -> tuple[int, bool]:
        """How many tokens may be returned now, and whether a stop string appeared. Only the
        tail after the returned tokens (plus a little context) is decoded."""
        stops = self.params.stop_strings
        tokens = self.tokens
        anchor = max(0, self.emitted - _STOP_STRING_CONTEXT_TOKENS)
        head = decode(tokens[anchor : self.emitted])
        text = decode(tokens[anchor:])
        base = _common_prefix_length(head, text)
        # Only a stop string that ends in the text not returned yet counts (one that ended
        # earlier did so before min_tokens); it may start inside the returned text.
        match_at = min(
            (
                i
                for i in (text.find(stop, max(0, base - len(stop) + 1)) for stop in stops)
                if i >= 0
            ),
            default=-1,
        )
        if match_at >= 0:
            return self._tokens_within(anchor, match_at, decode), True
        # Hold back a tail that is the beginning of a stop string: it may complete next step.
        held = max(
            (n for stop in stops for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])),
            default=0,
        )
        if held == 0:
            return len(tokens), False
        return self._tokens_within(anchor, len(text) - held, decode), False

    def _tokens_within(self, anchor: int, text_limit: int, decode: Decode) -> int:
        """The most tokens (at least those already returned) whose decoded text from ``anchor``
        fits in the first ``text_limit`` characters."""
        ready = self.emitted
        while ready < len(self.tokens):
            text = decode(self.tokens[anchor : ready + 1]).rstrip("\ufffd")
            if len(text) > text_limit:
                break
            ready += 1
        return ready


def _common_prefix_length(first: str, second: str) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length
