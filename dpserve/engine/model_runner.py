"""``ModelRunner``: continuous batching on a transformers causal LM.

Why this design: on CPU, transformers' own continuous batching (``generate_batch``, paged
cache) ran at 0.2-1.2x sequential ``generate`` in ``bench/engine.py``, while a plain batched
forward loop over a KV cache reaches 8-12x sequential and 1.3-1.4x one static ``generate``
batch (32 requests, 2-core CPU), and is exact. So:

* All running sequences share one batched ``DynamicCache``, **left padded**: every row ends at
  the same column, so one decode step appends one column for everybody. Each row carries its
  own length; the attention mask (``column >= width - length``) hides the padding and explicit
  ``position_ids`` give every row its true positions, so a row computes exactly what it would
  alone (greedy output matches ``model.generate`` for that prompt, token for token).
* Every ``step()``: (1) one decode forward for the running rows, (2) retire the rows that
  finished (index-select the batch dimension, then drop leading columns that are padding for
  every remaining row), (3) admit waiting requests up to ``capacity`` and the token budget,
  prefill them as their own left-padded batch and merge that cache into the running one
  (left-pad the narrower of the two along the sequence dimension, concatenate rows). A long
  request therefore never holds short ones back, and the cache is only re-concatenated when
  rows join or leave: its layers (``_SlackLayer``) keep spare columns, so a decode step writes
  one column in place where ``DynamicLayer`` would copy the whole cache.
* No chunked prefill: a step that admits requests runs their whole prefill before returning.
  The tokens one prefill forward may process (rows x longest context, padding included) are
  bounded, so a burst of arrivals is spread over several steps and running requests keep
  decoding in between; a single prompt over the budget is still admitted, alone.
* Finishing: ``num_tokens_to_generate`` (resume tokens included) or the context size ->
  "length"; EOS / ``termination_id`` -> "stop", and like OpenAI the stop token is **not**
  returned; a stop string -> "stop", with the returned tokens cut before the token in which the
  stop string starts (the coordinator detokenizes tokens, so text can only be cut at token
  boundaries). While the decoded tail could still become a stop string, those tokens are held
  back rather than streamed, so nothing ever has to be taken back.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from dpserve.engine.runner import EngineRequest, RequestRejected, TokenUpdate
from dpserve.engine.sampler import make_generator, sample_next_tokens, token_logprobs
from dpserve.models import load_model_and_tokenizer, pick_device_and_dtype, resolve_model
from dpserve.protocol import ErrorCode
from dpserve.sampling import SamplingParams

# Tokens before the first undecided one that are decoded with it when checking stop strings:
# detokenizers need a little left context (leading spaces, multi-byte characters).
_STOP_STRING_CONTEXT_TOKENS = 4
# Prefill tokens per step when max_tokens_in_batch is not given. On CPU a prefill is compute
# bound well below 512 tokens, so a larger batch only stalls the running requests (and the
# engine's heartbeats) for longer: 4k tokens of a 135M model take ~10 s on 2 cores.
_DEFAULT_PREFILL_BUDGET = {"cpu": 512, "cuda": 8192}
# Spare cache columns allocated beyond the current width: a buffer copy every this many steps
# instead of a full-cache concatenation on every step.
_SLACK_COLUMNS = 64


@dataclass(eq=False, slots=True)
class _Sequence:
    request: EngineRequest
    params: SamplingParams
    max_generated: int  # num_tokens_to_generate clamped to the context size
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # generated so far, resume tokens included
    logprobs: list[float] = field(default_factory=list)  # parallel to tokens[len(resume):]
    emitted: int = 0  # how many of ``tokens`` the caller has (resume tokens count as had)

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def context(self) -> list[int]:
        """Everything the model must have seen before sampling the next token."""
        return self.request.prompt_tokens + self.tokens


class ModelRunner:
    """Continuous batching over one transformers model; implements ``Runner``.

    ``model_path_or_id``: a local transformers directory, a hub id, or ``DEFAULT_MODEL``
    (resolved by ``dpserve.models.resolve_model``). ``max_batch_size`` rows decode together
    (reported as ``capacity``). ``max_tokens_in_batch`` bounds one prefill forward (rows x
    longest context, padding included) and the longest prompt accepted; by default prompts up
    to the context size are accepted and a step prefills ~512 tokens on CPU, ~8k on CUDA.
    ``dtype`` / ``device``: "auto" is bf16 on CUDA, fp32 on CPU. ``gguf_file`` loads a GGUF
    file inside ``model_path_or_id`` directly.
    """

    def __init__(
        self,
        model_path_or_id: str,
        *,
        max_batch_size: int = 8,
        max_tokens_in_batch: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        gguf_file: str | None = None,
        attn_implementation: str = "sdpa",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.capacity = max_batch_size
        self.model_path = resolve_model(model_path_or_id)
        self._dtype_name = dtype
        self._device_name = device
        self._gguf_file = gguf_file
        self._attn_implementation = attn_implementation
        self.device, self.dtype = pick_device_and_dtype(device, dtype)

        self.model: Any = None
        self.tokenizer: Any = None
        self._load()
        config = self.model.config.get_text_config(decoder=True)
        self.context_size: int = int(config.max_position_embeddings)
        self.vocab_size: int = int(self.model.get_input_embeddings().num_embeddings)
        # A prefill forward processes rows x longest context (padding included): bound that.
        self.max_tokens_in_batch = max_tokens_in_batch
        self._prefill_budget: int = (
            max_tokens_in_batch
            if max_tokens_in_batch is not None
            else _DEFAULT_PREFILL_BUDGET.get(self.device.type, 4096)
        )
        # Ends a request whose params name no termination_id (read when a request is added).
        self.eos_token_ids: frozenset[int] = self._find_eos_ids()
        self.eos_token_id: int | None = (
            self.tokenizer.eos_token_id
            if self.tokenizer.eos_token_id is not None
            else min(self.eos_token_ids, default=None)
        )
        # Fills the left padding of a prefill batch; masked, so any valid id works.
        pad_candidates = (self.tokenizer.pad_token_id, self.eos_token_id, 0)
        self._pad_id: int = next(i for i in pad_candidates if i is not None)

        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        # The running batch: one cache row per running sequence, in the same order.
        self._cache: Any = None
        self._width = 0  # columns of the cache (the longest row's length)
        self._padded = False  # some row is shorter than the width (changes on join/leave only)
        self._lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        self._released = False
        self._tokens_generated = 0
        self._prefill_tokens = 0
        self._steps = 0

    # ----------------------------------------------------------------------------- loading

    def _load(self) -> None:
        self.model, tokenizer = load_model_and_tokenizer(
            self.model_path,
            self._dtype_name,
            self._device_name,
            gguf_file=self._gguf_file,
            attn_implementation=self._attn_implementation,
        )
        if self.tokenizer is None:  # keep the first tokenizer: callers may hold it
            self.tokenizer = tokenizer

    def _find_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif isinstance(configured, Iterable):
            ids.update(int(i) for i in configured)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def release(self) -> None:
        """Free the model and the KV cache; running requests go back to the front of the queue
        with their generated tokens, and are re-prefilled (prompt + generated) after reload."""
        if self._released:
            return
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self._clear_batch()
        self.model = None
        self._released = True
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if not self._released:
            return
        self._load()
        self._released = False

    # ---------------------------------------------------------------------------- requests

    def add(self, request: EngineRequest) -> None:
        prompt_length = len(request.prompt_tokens)
        context_length = prompt_length + len(request.resume_tokens)
        if prompt_length == 0:
            raise RequestRejected(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
        if context_length >= self.context_size:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {prompt_length} tokens"
                + (
                    f" + {len(request.resume_tokens)} resumed tokens"
                    if request.resume_tokens
                    else ""
                )
                + f" leaves no room for a new token in the model's context of "
                f"{self.context_size} tokens (at most {self.context_size - 1} prompt tokens)",
            )
        if self.max_tokens_in_batch is not None and context_length > self.max_tokens_in_batch:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {context_length} tokens exceeds this engine's max_tokens_in_batch "
                f"of {self.max_tokens_in_batch}",
            )
        all_tokens = request.prompt_tokens + request.resume_tokens
        if min(all_tokens) < 0 or max(all_tokens) >= self.vocab_size:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"token ids must be in [0, {self.vocab_size}) for this model",
            )
        params = request.params
        termination = params.termination_id
        self._waiting.append(
            _Sequence(
                request=request,
                params=params,
                max_generated=min(params.num_tokens_to_generate, self.context_size - prompt_length),
                stop_ids=frozenset({termination})
                if termination is not None
                else self.eos_token_ids,
                generator=make_generator(params.seed, self.device),
                tokens=list(request.resume_tokens),
                emitted=len(request.resume_tokens),
            )
        )

    def cancel(self, request_id: int) -> None:
        for sequence in self._waiting:
            if sequence.request_id == request_id:
                self._waiting.remove(sequence)
                return
        for row, sequence in enumerate(self._running):
            if sequence.request_id == request_id:
                with torch.inference_mode():  # the batch tensors are inference tensors
                    self._retire({row})
                return

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> dict[str, Any]:
        return {
            "waiting": len(self._waiting),
            "running": len(self._running),
            "tokens_generated": self._tokens_generated,
            "prefill_tokens": self._prefill_tokens,
            "steps": self._steps,
            "cache_width": self._width,
            "released": self._released,
            "capacity": self.capacity,
        }

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[TokenUpdate]:
        """Decode the running rows, retire the finished, admit and prefill waiting requests.

        Does nothing while released (requests stay queued until ``reload``).
        """
        if self._released:
            return []
        self._steps += 1
        updates: list[TokenUpdate] = []
        with torch.inference_mode():
            if self._running:
                logits = self._decode_forward()
                self._last_tokens, finished = self._consume(self._running, logits, updates)
                if finished:
                    self._retire(finished)
            admitted = self._admit(updates)
            if admitted:
                cache, logits, width = self._prefill_forward(admitted)
                _, finished = self._consume(admitted, logits, updates)
                self._merge(admitted, cache, width, finished)
        return updates

    def _decode_forward(self) -> torch.Tensor:
        batch = len(self._running)
        width = self._width + 1
        mask = None  # no padding: transformers then skips building a mask
        if self._padded:
            # Row r's real columns are its last lengths[r] + 1 (the new token included).
            columns = torch.arange(width, device=self.device)
            mask = (columns.unsqueeze(0) >= (self._width - self._lengths).unsqueeze(1)).long()
        output = self.model(
            input_ids=self._last_tokens.view(batch, 1),
            attention_mask=mask,
            position_ids=self._lengths.view(batch, 1),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._width = width
        self._lengths += 1
        return output.logits[:, -1, :]

    def _admit(self, updates: list[TokenUpdate]) -> list[_Sequence]:
        admitted: list[_Sequence] = []
        longest = 0
        while self._waiting and len(self._running) + len(admitted) < self.capacity:
            candidate = self._waiting[0]
            if len(candidate.tokens) >= candidate.max_generated:
                # Resumed with everything already generated elsewhere: nothing to compute.
                self._waiting.popleft()
                updates.append(TokenUpdate(candidate.request_id, [], None, "length"))
                continue
            length = len(candidate.request.prompt_tokens) + len(candidate.tokens)
            new_longest = max(longest, length)
            if admitted and new_longest * (len(admitted) + 1) > self._prefill_budget:
                break
            longest = new_longest
            admitted.append(self._waiting.popleft())
        return admitted

    def _prefill_forward(self, sequences: list[_Sequence]) -> tuple[Any, torch.Tensor, int]:
        contexts = [sequence.context() for sequence in sequences]
        width = max(len(context) for context in contexts)
        input_ids = torch.full((len(contexts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[row, width - len(context) :] = 1
        # Padding columns get position 0; they are masked out and never attended to.
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        output = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=position_ids.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._prefill_tokens += sum(len(context) for context in contexts)
        return cache, output.logits[:, -1, :], width

    def _consume(
        self, sequences: list[_Sequence], logits: torch.Tensor, updates: list[TokenUpdate]
    ) -> tuple[torch.Tensor, set[int]]:
        """Sample a token for each row, apply the finishing rules, queue updates; returns the
        sampled tokens and the rows that finished."""
        params = [sequence.params for sequence in sequences]
        chosen = sample_next_tokens(logits, params, [s.generator for s in sequences])
        want_logprobs = any(p.return_log_probs for p in params)
        chosen_logprobs = token_logprobs(logits, chosen).tolist() if want_logprobs else None
        tokens = chosen.tolist()
        finished: set[int] = set()
        for row, sequence in enumerate(sequences):
            token = tokens[row]
            finish: str | None = None
            if token in sequence.stop_ids:
                finish = "stop"  # the stop token itself is not returned (as in OpenAI's API)
                ready = len(sequence.tokens)
            else:
                sequence.tokens.append(token)
                if chosen_logprobs is not None and sequence.params.return_log_probs:
                    sequence.logprobs.append(chosen_logprobs[row])
                self._tokens_generated += 1
                ready = len(sequence.tokens)
                if sequence.params.stop_strings:
                    ready, matched = self._scan_stop_strings(sequence)
                    if matched:
                        finish = "stop"
                        del sequence.tokens[ready:]
                if finish is None and len(sequence.tokens) >= sequence.max_generated:
                    finish = "length"
                    ready = len(sequence.tokens)
            if finish is not None:
                finished.add(row)
            if ready > sequence.emitted or finish is not None:
                updates.append(self._emit(sequence, ready, finish))
        return chosen, finished

    def _emit(self, sequence: _Sequence, ready: int, finish: str | None) -> TokenUpdate:
        start = sequence.emitted
        sequence.emitted = ready
        logprobs = None
        if sequence.params.return_log_probs:
            # logprobs has no entries for resume tokens: shift indices by their count.
            offset = len(sequence.request.resume_tokens)
            logprobs = sequence.logprobs[start - offset : ready - offset]
        return TokenUpdate(sequence.request_id, sequence.tokens[start:ready], logprobs, finish)

    def _decode_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _scan_stop_strings(self, sequence: _Sequence) -> tuple[int, bool]:
        """How many of the sequence's tokens may be returned now, and whether a stop string
        appeared. Only the tail after the returned tokens (plus a little context) is decoded."""
        stops = sequence.params.stop_strings
        tokens = sequence.tokens
        anchor = max(0, sequence.emitted - _STOP_STRING_CONTEXT_TOKENS)
        head = self._decode_text(tokens[anchor : sequence.emitted])
        text = self._decode_text(tokens[anchor:])
        base = _common_prefix_length(head, text)
        # Start a little inside the returned text in case a stop string straddles it.
        search_from = max(0, base - max(len(stop) for stop in stops) + 1)
        match_at = min(
            (i for i in (text.find(stop, search_from) for stop in stops) if i >= 0), default=-1
        )
        if match_at >= 0:
            return self._tokens_within(sequence, anchor, match_at), True
        # Hold back a tail that is the beginning of a stop string: it may complete next step.
        held = max(
            (n for stop in stops for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])),
            default=0,
        )
        if held == 0:
            return len(tokens), False
        return self._tokens_within(sequence, anchor, len(text) - held), False

    def _tokens_within(self, sequence: _Sequence, anchor: int, text_limit: int) -> int:
        """The most tokens (at least those already returned) whose decoded text from ``anchor``
        fits in the first ``text_limit`` characters."""
        ready = sequence.emitted
        while ready < len(sequence.tokens):
            text = self._decode_text(sequence.tokens[anchor : ready + 1]).rstrip("\ufffd")
            if len(text) > text_limit:
                break
            ready += 1
        return ready

    # ------------------------------------------------------------------------ batch state

    def _clear_batch(self) -> None:
        self._cache = None
        self._width = 0
        self._padded = False
        self._lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)

    def _retire(self, rows: set[int]) -> None:
        """Drop rows from the running batch, then the leading columns nobody needs any more."""
        keep = [row for row in range(len(self._running)) if row not in rows]
        self._running = [self._running[row] for row in keep]
        if not keep:
            self._clear_batch()
            return
        index = torch.tensor(keep, device=self.device)
        self._lengths = self._lengths.index_select(0, index)
        self._last_tokens = self._last_tokens.index_select(0, index)
        new_width = int(self._lengths.max())
        for layer in self._cache.layers:
            layer.select_rows(index)
            layer.drop_leading(self._width - new_width)
        self._width = new_width
        self._padded = int(self._lengths.min()) < new_width

    def _merge(
        self, sequences: list[_Sequence], cache: Any, width: int, finished: set[int]
    ) -> None:
        """Add freshly prefilled rows (except those that already finished) to the batch."""
        keep = [row for row in range(len(sequences)) if row not in finished]
        if not keep:
            return
        index = torch.tensor(keep, device=self.device)
        # The cache holds the context up to, not including, the token just sampled: that one
        # is fed by the next decode step.
        new_lengths = torch.tensor(
            [len(sequences[row].context()) - 1 for row in keep], dtype=torch.long
        ).to(self.device)
        new_last = torch.tensor([sequences[row].tokens[-1] for row in keep], dtype=torch.long).to(
            self.device
        )
        layers = cache.layers
        if len(keep) < len(sequences):
            for layer in layers:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
        # Trim the new rows' own leading padding if the longest of them finished.
        new_width = int(new_lengths.max())
        if new_width < width:
            for layer in layers:
                layer.keys = layer.keys[:, :, width - new_width :, :]
                layer.values = layer.values[:, :, width - new_width :, :]
            width = new_width
        self._running.extend(sequences[row] for row in keep)
        if self._cache is None:
            self._cache = DynamicCache()
            self._cache.layers = [_SlackLayer(layer.keys, layer.values) for layer in layers]
            self._cache.layer_class_to_replicate = None
            self._width = width
            self._lengths, self._last_tokens = new_lengths, new_last
            self._padded = int(new_lengths.min()) < width
            return
        merged_width = max(self._width, width)
        for old, new in zip(self._cache.layers, layers, strict=True):
            old._reset(
                torch.cat([_pad_left(old.keys, merged_width), _pad_left(new.keys, merged_width)]),
                torch.cat(
                    [_pad_left(old.values, merged_width), _pad_left(new.values, merged_width)]
                ),
            )
        self._width = merged_width
        self._lengths = torch.cat([self._lengths, new_lengths])
        self._last_tokens = torch.cat([self._last_tokens, new_last])
        self._padded = int(self._lengths.min()) < merged_width


class _SlackLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values sit in buffers with spare columns on the right.

    ``DynamicLayer.update`` concatenates, copying the whole cache for every generated token;
    here a decode step writes one column in place and the buffers grow by a chunk only when
    full. ``keys`` / ``values`` stay views of the filled part, so everything in transformers
    that reads them (sequence length, mask sizes) works unchanged.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._key_buffer = self._value_buffer = keys  # replaced by _reset
        self._length = 0
        self._reset(keys, values)

    def _reset(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, length, _ = keys.shape
        capacity = length + _SLACK_COLUMNS
        self._key_buffer = keys.new_empty((batch, heads, capacity, keys.shape[3]))
        self._value_buffer = values.new_empty((batch, heads, capacity, values.shape[3]))
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._length, self._length + key_states.shape[2]
        if end > self._key_buffer.shape[2]:
            self._reset(self.keys, self.values)  # copies into buffers with fresh spare columns
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def select_rows(self, index: torch.Tensor) -> None:
        self._key_buffer = self._key_buffer.index_select(0, index)
        self._value_buffer = self._value_buffer.index_select(0, index)
        self._set_length(self._length)

    def drop_leading(self, columns: int) -> None:
        """Forget the first ``columns`` positions (padding for every remaining row)."""
        if columns:
            self._key_buffer = self._key_buffer[:, :, columns:]
            self._value_buffer = self._value_buffer[:, :, columns:]
            self._set_length(self._length - columns)


def _common_prefix_length(first: str, second: str) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


def _pad_left(states: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad ``[batch, heads, length, dim]`` on the left of the sequence dimension."""
    missing = width - states.shape[2]
    if missing == 0:
        return states
    return torch.nn.functional.pad(states, (0, 0, missing, 0))
