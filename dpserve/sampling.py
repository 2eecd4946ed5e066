"""Per-request sampling parameters, validated at the edge and carried on the wire as a dict.

Field names follow Megatron-Core's ``SamplingParams`` where it has one (``temperature``,
``top_k``, ``top_p``, ``return_log_probs``, ``num_tokens_to_generate``, ``termination_id``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from dpserve.limits import DEFAULT_LORA_LIMITS, DEFAULT_PREFIX_CACHE_LIMITS, SAMPLING_CEILINGS

# Temperatures below this sample greedily (as vLLM does below 1e-5).
GREEDY_TEMPERATURE: Final = 1e-5
# OpenAI's API takes temperatures in [0, 2], and vLLM refuses any above: one range for both
# engines, so that a request one engine of a mixed pool takes, the other takes too.
MAX_TEMPERATURE: Final = 2.0


class InvalidSamplingParams(ValueError):
    """Sampling parameters that cannot be honoured; the message names the field."""


# A LoRA adapter's name: it is a request's ``model``, a metric label (where names are joined
# by commas) and a prefix-cache key, so no spaces, commas or quotes; "org/name" is allowed.
LORA_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


def check_lora_name(name: object) -> str:
    """``name`` if it is a valid adapter name, else ``InvalidSamplingParams`` saying why."""
    most = DEFAULT_LORA_LIMITS.max_lora_name_chars
    if not isinstance(name, str) or not LORA_NAME_PATTERN.fullmatch(name) or len(name) > most:
        raise InvalidSamplingParams(
            f"a LoRA adapter name must be 1 to {most} letters, digits or ._:/@+- (starting with "
            f"a letter or digit), got {name!r:.200}"
        )
    return name


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy decoding
    top_k: int = 0  # 0 disables top-k filtering
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    # vLLM's extension: tokens less likely than min_p x the most likely one are not sampled
    # (after temperature, before top-k / top-p, as vLLM); 0 disables it.
    min_p: float = 0.0
    num_tokens_to_generate: int = 16
    termination_id: int | None = None  # None: the model's EOS token
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's extension: tokens that end the request as EOS does (also with ignore_eos), in
    # addition to the EOS / termination_id; like EOS, not part of the text.
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # vLLM's extension: a stop string that ends the request stays in its text (the tokens are
    # kept through the one it ends in); by default the text is cut where it begins.
    include_stop_str_in_output: bool = False
    # OpenAI's logit_bias as (token id, bias in [-100, 100]) pairs: each bias is added to its
    # token's logit before anything else chooses from them (greedy decoding included); the
    # reported log-probs stay the model's own.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    return_log_probs: bool = False
    seed: int | None = None  # same seed, prompt and model -> same tokens
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension: EOS / termination_id do not end the request
    min_tokens: int = 0  # EOS, termination_id and stop strings are ignored before this many
    # vLLM's name: requests with different salts never share prefix-cache blocks (one tenant
    # cannot learn another's prompts from timing); None or "" shares with every unsalted one.
    cache_salt: str | None = None
    # With return_log_probs: this many most likely alternatives per generated token too.
    top_logprobs: int = 0
    # The prompt's tokens' log-probs (and top_logprobs alternatives), all but the first token's:
    # the engine computes logits at every prompt position for this sequence only.
    prompt_logprobs: bool = False
    # OpenAI's penalties on the generated tokens' counts (subtracted from the logits), and
    # vLLM's multiplicative penalty on every token seen (prompt and generated); 1 disables it.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Structured output (vLLM's names): at most one; the engine masks every token that would
    # leave the language. guided_json is a JSON schema as JSON text; guided_json_object any
    # JSON object.
    guided_json: str | None = None
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] = field(default_factory=tuple)
    # The LoRA adapter the request runs with (``dpserve.engine.lora``), None: the base model.
    # Requests of different adapters never share prefix-cache blocks.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        # Accept a list for stop_strings (msgpack and JSON have no tuples) but store a tuple so
        # the object stays hashable and immutable.
        for name in ("stop_strings", "stop_token_ids", "guided_choice"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, list | tuple):  # pairs arrive as lists from the wire
            pairs = tuple(tuple(p) if isinstance(p, list) else p for p in self.logit_bias)
            object.__setattr__(self, "logit_bias", pairs)
        self.validate()

    @property
    def greedy(self) -> bool:
        # A temperature this small makes sampling greedy in every float format anyway, and
        # dividing logits by it overflows: such requests are decoded greedily.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        _require_number("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN too
            raise InvalidSamplingParams(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        _require_int("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidSamplingParams(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _require_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        _require_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        _require_int("num_tokens_to_generate", self.num_tokens_to_generate)
        if self.num_tokens_to_generate < 1:
            raise InvalidSamplingParams(
                f"num_tokens_to_generate must be >= 1, got {self.num_tokens_to_generate}"
            )
        if self.termination_id is not None:
            _require_int("termination_id", self.termination_id)
            if self.termination_id < 0:
                raise InvalidSamplingParams("termination_id must be a token id >= 0")
        if not isinstance(self.stop_strings, tuple) or not all(
            isinstance(s, str) and s for s in self.stop_strings
        ):
            raise InvalidSamplingParams("stop_strings must be a list of non-empty strings")
        limits = SAMPLING_CEILINGS  # the edge holds requests to its own RequestLimits
        if len(self.stop_strings) > limits.max_stop_strings:
            raise InvalidSamplingParams(
                f"at most {limits.max_stop_strings} stop_strings are allowed"
            )
        if any(len(s) > limits.max_stop_string_chars for s in self.stop_strings):
            raise InvalidSamplingParams(
                f"a stop string may have at most {limits.max_stop_string_chars} characters"
            )
        self._validate_stop_token_ids()
        self._validate_logit_bias()
        _require_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.num_tokens_to_generate:
            raise InvalidSamplingParams(
                f"min_tokens must be in [0, num_tokens_to_generate={self.num_tokens_to_generate}],"
                f" got {self.min_tokens}"
            )
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str):
                raise InvalidSamplingParams("cache_salt must be a string")
            most = DEFAULT_PREFIX_CACHE_LIMITS.max_cache_salt_chars
            if len(self.cache_salt) > most:
                raise InvalidSamplingParams(f"cache_salt may have at most {most} characters")
        if self.lora_name is not None:
            check_lora_name(self.lora_name)
        self._validate_logprobs()
        self._validate_penalties()
        self._validate_guided()
        for flag in ("return_log_probs", "stream", "ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidSamplingParams(f"{flag} must be true or false")
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise InvalidSamplingParams("seed must be in [0, 2**63)")

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def guided(self) -> bool:
        return (
            self.guided_json is not None
            or self.guided_json_object
            or self.guided_regex is not None
            or bool(self.guided_choice)
        )

    def _validate_stop_token_ids(self) -> None:
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(token, int) and not isinstance(token, bool) and 0 <= token < 2**31
            for token in self.stop_token_ids
        ):
            raise InvalidSamplingParams("stop_token_ids must be a list of token ids >= 0")
        most = SAMPLING_CEILINGS.max_stop_token_ids
        if len(self.stop_token_ids) > most:
            raise InvalidSamplingParams(f"at most {most} stop_token_ids are allowed")

    def _validate_logit_bias(self) -> None:
        pairs = self.logit_bias
        if not isinstance(pairs, tuple) or not all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], int)
            and not isinstance(pair[0], bool)
            and 0 <= pair[0] < 2**31
            and isinstance(pair[1], int | float)
            and not isinstance(pair[1], bool)
            and -100.0 <= pair[1] <= 100.0
            for pair in pairs
        ):
            raise InvalidSamplingParams(
                "logit_bias must map token ids >= 0 to biases in [-100, 100]"
            )
        most = SAMPLING_CEILINGS.max_logit_bias_tokens
        if len(pairs) > most:
            raise InvalidSamplingParams(f"logit_bias may name at most {most} tokens")
        if len({token for token, _ in pairs}) != len(pairs):
            raise InvalidSamplingParams("logit_bias names a token more than once")

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the model's own logits: its token is their argmax (no penalties, no
        logit bias)."""
        return self.greedy and not self.has_penalties and not self.logit_bias

    def _validate_logprobs(self) -> None:
        _require_int("top_logprobs", self.top_logprobs)
        limit = SAMPLING_CEILINGS.max_top_logprobs
        if not 0 <= self.top_logprobs <= limit:
            raise InvalidSamplingParams(
                f"top_logprobs must be in [0, {limit}], got {self.top_logprobs}"
            )
        if self.top_logprobs and not self.return_log_probs:
            raise InvalidSamplingParams("top_logprobs needs return_log_probs")
        if not isinstance(self.prompt_logprobs, bool):
            raise InvalidSamplingParams("prompt_logprobs must be true or false")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {value}")
        _require_number("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0):
            raise InvalidSamplingParams(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}"
            )

    def _validate_guided(self) -> None:
        chosen = [
            name
            for name, on in (
                ("guided_json", self.guided_json is not None),
                ("guided_json_object", self.guided_json_object),
                ("guided_regex", self.guided_regex is not None),
                ("guided_choice", bool(self.guided_choice)),
            )
            if on
        ]
        if len(chosen) > 1:
            raise InvalidSamplingParams(f"at most one of {', '.join(chosen)} may be given")
        for name in ("guided_json", "guided_regex"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidSamplingParams(f"{name} must be a non-empty string")
        if not isinstance(self.guided_json_object, bool):
            raise InvalidSamplingParams("guided_json_object must be true or false")
        if not isinstance(self.guided_choice, tuple) or not all(
            isinstance(choice, str) and choice for choice in self.guided_choice
        ):
            raise InvalidSamplingParams("guided_choice must be a list of non-empty strings")

    def serialize(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly dict with only the fields that differ from the defaults."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != _DEFAULTS[f.name]:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def deserialize(cls, data: object) -> SamplingParams:
        """Build from a dict; unknown keys and invalid values raise ``InvalidSamplingParams``."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidSamplingParams(
                f"sampling parameters must be a mapping, got {type(data).__name__}"
            )
        unknown = sorted(set(data) - _FIELD_NAMES, key=str)
        if unknown:
            raise InvalidSamplingParams(
                f"unknown sampling parameter(s) {', '.join(map(str, unknown))}; "
                f"known: {', '.join(sorted(_FIELD_NAMES))}"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidSamplingParams(str(exc)) from None


def _require_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSamplingParams(f"{name} must be a number, got {type(value).__name__}")


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingParams(f"{name} must be an integer, got {type(value).__name__}")


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_DEFAULT_PARAMS: Final = SamplingParams()
_DEFAULTS: Final[dict[str, object]] = {
    name: getattr(_DEFAULT_PARAMS, name) for name in _FIELD_NAMES
}


_Built = TypeVar("_Built")
_MEMO_SIZE: Final = 1024  # distinct parameter sets remembered (clients reuse a few)


class ParamsMemo(Generic[_Built]):
    """``build(raw)`` of wire sampling parameters, memoized. Most clients send the same few
    parameter sets over and over, and validating them dominated the submit path (the
    coordinator's) and was a sixth of an instant fake engine's CPU per request (issue 36).
    A key holds each value's type beside it, so that ``1``, ``1.0`` and ``True`` (equal in
    Python) never share an entry: validation may accept one and refuse another. Sets with an
    unhashable value (lists: stop strings) are built every time; at ``_MEMO_SIZE`` entries the
    memo starts over. ``build`` must return something shared safely (immutable)."""

    def __init__(self, build: Callable[[Any], _Built]) -> None:
        self._build = build
        self._built: dict[tuple[tuple[str, type, Any], ...], _Built] = {}

    def __call__(self, raw: Any) -> _Built:
        if not isinstance(raw, dict):
            return self._build(raw)  # its error
        try:
            key = tuple((name, type(value), value) for name, value in raw.items())
            built = self._built.get(key)
        except TypeError:  # an unhashable value
            return self._build(raw)
        if built is None:
            built = self._build(raw)
            if len(self._built) >= _MEMO_SIZE:
                self._built.clear()
            self._built[key] = built
        return built
