"""Every limit a request can hit, in one place.

The HTTP front checks a request against ``RequestLimits`` before it sends anything on (a 400 or
413 that names the limit), the coordinator checks the same values again for clients that speak
ZMQ directly, and the CLI, the docs (docs/security.md) and the operator's CRD take their
defaults from here. Nothing else defines a limit's number.

The sizes are chosen so that everything that fits the HTTP body limit also fits a ZMQ message:
a request travels as MessagePack, which is never larger than its JSON for the same text, and
``MESSAGE_HEADROOM_BYTES`` covers the fields the front adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MIB: Final = 1024 * 1024
# What the front adds around a request's own text (ids, sampling parameters, resume tokens'
# framing) stays far below this.
MESSAGE_HEADROOM_BYTES: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits: sizes (the edge enforces all of them) and the bounds of a
    structured-output constraint (the edge checks its size and its schema within the compile
    budget; the engine checks them again and compiles it within the same budget, off its step
    loop)."""

    max_body_bytes: int = 8 * MIB  # HTTP request body
    max_prompt_chars: int = 1_000_000  # prompt text, or all chat messages' text together
    max_prompt_tokens: int = 32_768  # after tokenization (or token ids given directly)
    max_new_tokens: int = 1_000_000  # max_tokens; a runner also clamps to its context size
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1_000
    max_stop_token_ids: int = 64  # stop_token_ids: each one is looked up per generated token
    max_logit_bias_tokens: int = 300  # logit_bias entries (OpenAI's bound)
    max_json_depth: int = 64  # nesting of the HTTP JSON body
    max_top_logprobs: int = 20  # alternatives per token (logprobs / top_logprobs), as vLLM
    max_choices: int = 16  # n (and best_of): completions generated for one prompt
    max_prompts: int = 256  # prompts in one completions request (a list of prompts)
    # n (or best_of) x prompts: the requests one HTTP request may start
    max_request_sequences: int = 512
    # A structured-output constraint (a JSON schema as compact JSON, a regex, or the choices
    # together): llguidance's compile time and mask cost grow with it (a 150 KB schema of 2000
    # properties compiles in ~0.5 s on one core, a 345 KB one in ~5 s, BENCHMARKS.md).
    max_constraint_bytes: int = 64 * 1024
    # Seconds a constraint may take to be checked (the edge's schema checks) and compiled (the
    # engine's grammar and first token mask), each off its event or step loop; past it: 400.
    constraint_compile_timeout: float = 5.0
    # Seconds one token mask of a constraint may take, measured on its first mask: a mask is
    # computed on every step the request takes part in, so a costlier one is refused (400)
    # rather than slowing every request on its engine.
    constraint_mask_timeout: float = 0.05

    @property
    def max_message_bytes(self) -> int:
        """The ZMQ message limit that every request passing the edge fits into."""
        return self.max_body_bytes + MESSAGE_HEADROOM_BYTES


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """How much the coordinator holds at once before it refuses new work."""

    max_inflight_per_client: int = 10_000
    max_inflight_requests: int = 1_000_000
    max_queued_requests: int = 100_000
    queue_timeout: float = 30.0  # seconds a request may wait for an engine
    # A request in flight on this many engines that each died is failed, not sent again.
    max_dispatch_attempts: int = 3


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """How long and how many: the HTTP server's timeouts and its cap on connections."""

    request_timeout: float = 600.0  # seconds one generation request may take, end to end
    header_timeout: float = 10.0  # seconds from a request's first byte to its last header
    body_timeout: float = 60.0  # seconds to receive a request's body once its headers arrived
    keepalive_timeout: float = 15.0  # seconds an idle keep-alive connection is kept open
    max_connections: int = 1_000  # open connections; one more is answered 503 and closed
    shutdown_timeout: float = 10.0  # seconds in-flight requests get when the front stops
    # After refusing a body it did not read (408, 413), the front still reads and drops what
    # the client sends for this long, so the client can read the refusal before the close.
    linger_timeout: float = 1.0


@dataclass(frozen=True, slots=True)
class EngineStatsLimits:
    """What the coordinator keeps of the numbers an engine reports with each HEARTBEAT (KV
    pool, capacity, preemptions): a report past these is refused whole, never stored."""

    max_entries: int = 64
    max_name_chars: int = 64


@dataclass(frozen=True, slots=True)
class PrefixCacheLimits:
    """Bounds of the prefix-cache bookkeeping between engines and the coordinator."""

    # Block hashes in one KV_EVENTS message (8 bytes each): a snapshot of a large pool is
    # sent in several messages, never one over the message size limit.
    max_hashes_per_message: int = 8192
    # Hashes the coordinator's index keeps per engine: an engine claiming more (a bug or a
    # hostile peer) gets its entries dropped and a snapshot asked for.
    max_hashes_per_engine: int = 4_000_000
    max_cache_salt_chars: int = 256  # a request's cache_salt (its prefix-cache isolation key)
    # Block hashes the coordinator remembers by their input (``block_hash.BlockHashCache``), so
    # a shared prefix is hashed once, not per request: ~110 bytes each at 16-token blocks
    # (~14 MiB at most); emptied when full. 131,072 hold 32 prefixes of 8,192 tokens (16-token
    # blocks) with room for the prompts' own tails.
    max_cached_block_hashes: int = 131_072


@dataclass(frozen=True, slots=True)
class LoraLimits:
    """LoRA adapters (``dpserve.engine.lora``): how many an engine holds at once, how large
    one may be, and what a request may call one."""

    # Adapters an engine holds loaded at once (--max-loras): each is a set of weights in
    # memory, least recently used ones evicted when no running request uses them.
    max_loras: int = 4
    # The largest rank r an engine loads (--max-lora-rank): the delta's two matmuls grow
    # with it, and vLLM's kernels stop at 64 by default too (--max-lora-rank for more).
    max_lora_rank: int = 64
    # An adapter's name: a request's ``model`` field, a metric label and a prefix-cache key.
    max_lora_name_chars: int = 128
    max_lora_path_chars: int = 4096  # the directory it is loaded from
    # Adapters known to an engine (loaded or only registered to be loaded on demand).
    max_registered_loras: int = 1024


@dataclass(frozen=True, slots=True)
class SamplingCeilings:
    """The most one request's ``SamplingParams`` may hold, which every process that builds them
    checks (the front, the coordinator, each engine): an engine knows none of the front's
    flags. The ``RequestLimits`` of the same names are what the edge allows, and may be set up
    to these, not past them (the flags and the CR refuse more); before, a flag set above an
    engine's own bound let requests past the edge that were then refused, naming no flag."""

    # A request's stop strings are matched by an automaton built in the engine's step loop
    # (``stop_matcher``): at 16 of 1,000 characters ~13 ms and ~4 MB (AMD EPYC Zen 4), growing
    # with their total length, so these are the edge's defaults too.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1_000
    max_stop_token_ids: int = 1_024  # a set lookup per token
    # logit_bias: added to the scores of each step the request is in, from tensors built once.
    max_logit_bias_tokens: int = 1_024
    # vLLM's default max_logprobs too (the vLLM backend starts its engines with it).
    max_top_logprobs: int = 20


DEFAULT_REQUEST_LIMITS: Final = RequestLimits()
SAMPLING_CEILINGS: Final = SamplingCeilings()
DEFAULT_PREFIX_CACHE_LIMITS: Final = PrefixCacheLimits()
DEFAULT_HTTP_LIMITS: Final = HttpLimits()
DEFAULT_ADMISSION_LIMITS: Final = AdmissionLimits()
DEFAULT_ENGINE_STATS_LIMITS: Final = EngineStatsLimits()
DEFAULT_LORA_LIMITS: Final = LoraLimits()
