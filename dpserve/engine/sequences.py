"""One request's state in a runner, and the rules that finish it.

Finishing: ``num_tokens_to_generate`` (resume tokens included) or the context size -> "length";
EOS / ``termination_id`` / a ``stop_token_ids`` token -> "stop", and like OpenAI the stop token
is **not** returned; a stop string -> "stop", with the returned tokens cut before the token in
which the stop string starts (the coordinator detokenizes tokens, so text can only be cut at
token boundaries; with ``include_stop_str_in_output`` they are kept through the token it ends
in). While the decoded tail could still become a stop string, those tokens are
held back rather than streamed, so nothing ever has to be taken back. ``ignore_eos`` turns EOS
and ``termination_id`` into ordinary tokens (not ``stop_token_ids``, as in vLLM); before
``min_tokens`` tokens neither stop tokens nor stop strings end a request (a stop token is then
returned like any other).

Stop strings are looked for in the request's text as its ``IncrementalDetokenizer`` produces
it (``StopText``), one token at a time: that text is also what the engine sends with the
tokens (``TokenUpdate.text``), so it is decoded once. ``decode_new_tokens`` decodes the new
token of every such sequence of a step in one pass (``tokenizer.push_each``: with a byte-level
tokenizer, each token's bytes through an incremental UTF-8 decoder; otherwise one
``decode_batch`` call for the tokens that need one).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dpserve.block_hash import extra_keys
from dpserve.engine.runner import RunnerRequest, TokenUpdate
from dpserve.engine.stop_matcher import automaton
from dpserve.sampling import SamplingParams
from dpserve.tokenizer import BatchTokenizer, IncrementalDetokenizer, push_each, released_texts

if TYPE_CHECKING:
    from llguidance import LLMatcher as GrammarMatcher

    from dpserve.engine.sample.penalties import PenaltyTokens

TopEntry = tuple[int, float]


class StopText:
    """The text of a request with stop strings, from the detokenizer whose deltas are sent, and
    where it stands in its stop strings' automaton (``stop_matcher``)."""

    __slots__ = (
        "_automaton",
        "_ends",
        "_match_back",
        "_next_delta",
        "_state",
        "_unsent",
        "detokenizer",
    )

    def __init__(self, detokenizer: IncrementalDetokenizer, stops: Iterable[str]) -> None:
        self.detokenizer = detokenizer
        self._automaton = automaton(tuple(stops))
        self._state = 0  # the automaton's, after all the text so far
        # Where the earliest stop string that ends in the newest token's text starts, counted
        # back from the end of ``_unsent`` (None: none ends there).
        self._match_back: int | None = None
        self._unsent = ""  # the text of the tokens not returned yet
        self._ends: list[int] = []  # where each of those tokens' text ends in ``_unsent``
        self._next_delta: str | None = None  # decoded ahead by ``decode_new_tokens``

    @classmethod
    def start(
        cls, tokenizer: BatchTokenizer, resume_tokens: list[int], stops: Iterable[str]
    ) -> StopText:
        """The text of a request that continues after ``resume_tokens`` (generated elsewhere,
        returned already): a stop string may begin in theirs."""
        text = cls(IncrementalDetokenizer(tokenizer, resume_tokens), stops)
        if resume_tokens:
            tail = released_texts(tokenizer, [resume_tokens])[0][-text._automaton.longest :]
            text._state = text._automaton.advance(0, tail)[0]
        return text

    def add(self, token: int) -> str:
        """Take in the next token; the text it adds."""
        delta = self._next_delta
        if delta is None:
            delta = self.detokenizer.push([token])
        else:
            self._next_delta = None
        self._unsent = unsent = self._unsent + delta
        self._ends.append(len(unsent))
        self._state, self._match_back = self._automaton.advance(self._state, delta)
        return delta

    def scan(self) -> tuple[int, bool]:
        """How many of the tokens not returned yet may be returned, and whether a stop string
        (one that ends in the newest token's text) ends the request before them."""
        if self._match_back is not None:
            return bisect_right(self._ends, len(self._unsent) - self._match_back), True
        return self.releasable(), False

    def releasable(self) -> int:
        """How many of the tokens not returned yet may be returned: all but a tail that is the
        beginning of a stop string (it may complete next step). Also before ``min_tokens``,
        when no stop string may end the request yet: one that begins before that point and
        ends after it still cuts the text where it begins."""
        held = self._automaton.hold(self._state)
        if not held:  # nothing may complete a stop string: every token may go
            return len(self._ends)
        return bisect_right(self._ends, len(self._unsent) - held)

    def release(self, count: int, final: bool) -> str:
        """The text of the next ``count`` tokens, now returned; with ``final`` (the request
        ends without a stop string) whatever the detokenizer still held back too."""
        cut = self._ends[count - 1] if count else 0
        text = self._unsent[:cut]
        self._unsent = self._unsent[cut:]
        self._ends = [end - cut for end in self._ends[count:]]
        if final:
            text += self._unsent + self.detokenizer.push([], final=True)
        return text


def decode_new_tokens(sequences: list[Sequence], tokens: list[int]) -> None:
    """Decode the text each sequence with stop strings gets from its new token, for all of them
    in one pass (``accept`` then finds it decoded)."""
    texts: list[StopText] = []
    kept: list[int] = []
    for sequence, token in zip(sequences, tokens, strict=True):
        text = sequence.stop_text
        if text is not None and (
            token not in sequence.stop_ids or len(sequence.tokens) < sequence.params.min_tokens
        ):  # ``keeps``, inlined
            texts.append(text)
            kept.append(token)
    if not texts:
        return
    deltas = push_each(texts[0].detokenizer.tokenizer, [t.detokenizer for t in texts], kept)
    for text, delta in zip(texts, deltas, strict=True):
        text._next_delta = delta


def stop_ids_of(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end a request: its ``stop_token_ids``, and unless ``ignore_eos`` its
    ``termination_id`` or else the model's EOS (vLLM's rule: ``ignore_eos`` leaves the
    ``stop_token_ids``)."""
    if params.ignore_eos:
        eos: frozenset[int] = frozenset()
    elif params.termination_id is not None:
        eos = frozenset({params.termination_id})
    else:
        eos = eos_token_ids
    return eos | frozenset(params.stop_token_ids) if params.stop_token_ids else eos


@dataclass(eq=False, slots=True)
class Sequence:
    request: RunnerRequest
    params: SamplingParams
    max_generated: int  # num_tokens_to_generate clamped to the context size
    stop_ids: frozenset[int]  # empty with ignore_eos
    tokens: list[int] = field(default_factory=list)  # generated so far, resume tokens included
    logprobs: list[float] = field(default_factory=list)  # parallel to tokens[len(resume):]
    emitted: int = 0  # how many of ``tokens`` the caller has (resume tokens count as had)
    ready: int = 0  # how many of ``tokens`` may be reported (a stop string's tail held back)
    # The paged cache's view of it (see ``scheduler``): its blocks and cached context tokens.
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    # Tokens sampled on the device but not accepted yet (the overlapped step in flight): part
    # of the context, not of ``tokens``.
    pending: int = 0
    stop_text: StopText | None = None  # with stop strings: the text they are looked for in
    # The slot of its LoRA adapter (``lora.slots``) while it holds one; -1: the base model.
    lora_slot: int = -1
    # Prefix caching (see ``scheduler``): hashes of the context's full blocks, the request's
    # extra keys they mix in (``block_hash.extra_keys`` of its cache_salt and adapter), and
    # the context tokens found cached at its first admission (reported as usage's cached
    # tokens).
    block_hashes: list[int] = field(default_factory=list)
    cache_extra: bytes = b""
    cached_prompt_tokens: int | None = None
    top_logprobs: list[list[TopEntry]] = field(default_factory=list)  # parallel to logprobs
    # prompt_logprobs: the prompt's tokens after the first, filled as prefill chunks run;
    # reported with the first update.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[TopEntry]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Structured output: the grammar matcher (``dpserve.engine.sample.grammar``), None without one.
    matcher: GrammarMatcher | None = None
    # With penalties: its tokens as the sampler counts them, kept between steps
    # (``backend.token_histories``).
    penalty_tokens: PenaltyTokens | None = None
    stop_token: int | None = None  # the EOS / termination_id that ended it, reported once
    # Its log-prob and alternatives (with return_log_probs), reported with it.
    stop_logprob: tuple[float, list[TopEntry] | None] | None = None
    # len(request.prompt_tokens) and len(request.resume_tokens): read for every running
    # sequence on every step.
    prompt_len: int = field(init=False)
    resumed: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.request.prompt_tokens)
        self.resumed = len(self.request.resume_tokens)

    @classmethod
    def arriving(
        cls,
        request: RunnerRequest,
        eos_token_ids: frozenset[int],
        context_size: int,
        text_tokenizer: BatchTokenizer,
    ) -> Sequence:
        """A request's sequence as a runner (ours or vLLM's) takes it in: its stop ids, its
        tokens clamped to the context, the resume tokens already had, its prefix-cache keys,
        and its stop strings' text."""
        params = request.params
        stop_ids = stop_ids_of(params, eos_token_ids)
        room = context_size - len(request.prompt_tokens)
        sequence = cls(
            request=request,
            params=params,
            max_generated=min(params.num_tokens_to_generate, room),
            stop_ids=stop_ids,
            tokens=list(request.resume_tokens),
            emitted=len(request.resume_tokens),
            cache_extra=extra_keys(params.cache_salt, params.lora_name),
        )
        if params.stop_strings:
            sequence.stop_text = StopText.start(
                text_tokenizer, request.resume_tokens, params.stop_strings
            )
        return sequence

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def context(self) -> list[int]:
        """Everything the model must have seen before sampling the next token."""
        return self.request.prompt_tokens + self.tokens

    def prompt_length(self) -> int:
        return self.prompt_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Logits are needed at every prompt position, not only the last. A sequence like this
        must compute its whole prompt: it must not take cached prefix blocks (the prefix cache
        checks this flag before sharing blocks with it)."""
        return self.params.prompt_logprobs and not self.prompt_logprobs_sent

    @property
    def reported(self) -> bool:
        """Some of the tokens it generated here were reported (resume tokens count as had)."""
        return self.emitted > self.resumed

    @property
    def bare_argmax(self) -> bool:
        """Its next token is the logits' argmax and nothing else is read from them: no
        temperature, penalties, logit bias, grammar or log-probs."""
        params = self.params
        return params.plain_greedy and not params.return_log_probs and self.matcher is None

    @property
    def needs_host_state(self) -> bool:
        """Sampling it reads its accepted tokens on the host (penalty counts, grammar state):
        its step's result must be taken in before its next step is built."""
        return self.matcher is not None or self.params.has_penalties

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
        return self.prompt_len + len(self.tokens) + self.pending

    def token_at(self, position: int) -> int:
        prompt = self.request.prompt_tokens
        return prompt[position] if position < len(prompt) else self.tokens[position - len(prompt)]

    def last_token(self) -> int:
        return self.tokens[-1] if self.tokens else self.request.prompt_tokens[-1]

    def tokens_between(self, start: int, end: int) -> list[int]:
        prompt = self.request.prompt_tokens
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.tokens[start - len(prompt) : end - len(prompt)]
        return self.context()[start:end]

    def keeps(self, token: int) -> bool:
        """False when ``token`` ends the sequence as a stop token (and is not returned)."""
        return token not in self.stop_ids or len(self.tokens) < self.params.min_tokens

    def accept(
        self, token: int, logprob: float | None, top: list[TopEntry] | None = None
    ) -> TokenUpdate | None:
        """Apply the finishing rules to a sampled token; the update to report, if any (one
        with a ``finish_reason`` when the sequence is done)."""
        tokens = self.tokens
        params = self.params
        if token in self.stop_ids and len(tokens) >= params.min_tokens:  # not ``keeps``
            self.stop_token = token  # the stop token itself is not returned (as in OpenAI's API)
            if logprob is not None and params.return_log_probs:
                self.stop_logprob = (logprob, top if params.top_logprobs else None)
            return self.emit(len(tokens), "stop")
        tokens.append(token)
        if logprob is not None and params.return_log_probs:
            self.logprobs.append(logprob)
            if params.top_logprobs:
                self.top_logprobs.append(top or [])
        ready = len(tokens)
        if ready >= self.max_generated:
            finish: str | None = "length"
        else:
            finish = None
        text = self.stop_text
        if text is not None:
            text.add(token)
            if ready > params.min_tokens:
                releasable, matched = text.scan()
                if matched and params.include_stop_str_in_output:
                    return self.emit(ready, "stop")  # every token, the last one's text ends it
                if matched:
                    ready = self.emitted + releasable
                    del tokens[ready:]
                    return self.emit(ready, "stop", cut=True)
                if finish is None:
                    ready = self.emitted + releasable
            elif finish is None:  # no stop string may end it yet, but one may begin here
                ready = self.emitted + text.releasable()
        if finish is not None:
            return self.emit(ready, finish)
        self.ready = ready
        # A request reports its first tokens (the end of its prefill) at once, and then
        # nothing until it ends: its tokens wait here, not in an update per token, until the
        # engine takes them (``unreported``: once per stream interval, or at a hand-off).
        emitted = self.emitted
        if ready > emitted and emitted <= self.resumed:
            return self.emit(ready, None)  # nothing ``reported`` yet
        return None

    def unreported(self) -> TokenUpdate | None:
        """The tokens that may be reported and were not yet (a stop string's possible
        beginning held back)."""
        if self.ready > self.emitted:
            return self.emit(self.ready, None)
        return None

    def emit(self, ready: int, finish: str | None, cut: bool = False) -> TokenUpdate:
        """Report tokens up to ``ready``; ``cut``: the rest was dropped at a stop string."""
        start = self.emitted
        self.emitted = ready
        logprobs = top = None
        if self.params.return_log_probs:
            # logprobs has no entries for resume tokens: shift indices by their count.
            offset = self.resumed
            logprobs = self.logprobs[start - offset : ready - offset]
            if self.params.top_logprobs:
                top = self.top_logprobs[start - offset : ready - offset]
        text = None
        if self.stop_text is not None:
            text = self.stop_text.release(ready - start, final=finish is not None and not cut)
        update = TokenUpdate(
            self.request_id,
            self.tokens[start:ready],
            logprobs,
            finish,
            text,
            top_logprobs=top,
            cached_tokens=self.cached_prompt_tokens,
        )
        if finish is not None:
            update.stop_token = self.stop_token
            if self.stop_logprob is not None:
                update.stop_logprob, update.stop_top_logprobs = self.stop_logprob
        if self.params.prompt_logprobs and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            update.prompt_logprobs = self.prompt_logprobs
            update.prompt_top_logprobs = (
                self.prompt_top_logprobs if self.params.top_logprobs else None
            )
        return update
