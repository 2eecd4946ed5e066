"""Next-token selection for a whole batch on the device, each row with its own ``SamplingParams``.

``sample(logits, params, positions)`` does every row with tensor ops and returns tensors; the
caller copies them to the host once (``SampleOutput.tolist``).

* Greedy rows (``SamplingParams.greedy``: temperature below 1e-5, or top_k 1) take the argmax.
* Sampling rows use the Gumbel-max trick: ``argmax(scores / T + g)`` with ``g`` Gumbel noise
  draws from ``softmax(scores / T)`` restricted to the top-k / top-p set, without multinomial.
* A seeded row's noise is a counter-based hash of (seed, position, vocabulary index), computed
  with integer tensor ops: the same seed at the same position picks the same token whatever
  else is in the batch, on any device, and a request resumed on another engine continues the
  same draw. Unseeded rows use fresh noise from torch's global generator.
* Numerics are guarded rather than trusted: NaN logits count as -inf, +inf as the largest
  float; scores are shifted so the row maximum is 0 before dividing by the temperature (no
  overflow for any valid temperature); the noise is finite; a row with no finite logit at all
  falls back to token 0 through the greedy path. Nothing non-finite reaches an argmax as NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dpserve.sampling import SamplingParams

_MASK_32 = 0xFFFFFFFF
_MASK_64 = (1 << 64) - 1
# lowbias32's multipliers (Wellons' hash prospector): a strong 32-bit integer mix.
_MIX_1 = 0x7FEB352D
_MIX_2 = 0x846CA68B
_GOLDEN_64 = 0x9E3779B97F4A7C15
# Logprob reported for a token the model gives no probability at all (JSON has no -inf).
_LOWEST_LOGPROB = torch.finfo(torch.float32).min


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: torch.Tensor  # [batch] int64, on the logits' device
    # [batch] fp32: each chosen token's log-probability under the model's own distribution
    # (before temperature and filtering); None when no row asked for logprobs.
    logprobs: torch.Tensor | None = None

    def tolist(self) -> tuple[list[int], list[float] | None]:
        """Tokens and logprobs as Python lists, with one device-to-host copy."""
        if self.logprobs is None:
            return self.tokens.tolist(), None
        # float64 holds every token id exactly: one tensor, one copy.
        both = torch.stack((self.tokens.double(), self.logprobs.double())).tolist()
        return [int(token) for token in both[0]], both[1]


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> SampleOutput:
    """One token per row of ``logits`` (``[batch, vocab]``, any float dtype). ``positions[i]``
    is the index in its sequence of the token row ``i`` samples (prompt plus tokens so far): with
    a seed it selects the noise, so the same (seed, position, logits) give the same token."""
    if len(positions) != len(params):
        raise ValueError(f"{len(positions)} positions for {len(params)} params")
    keys = [
        None if p.seed is None else _row_key(p.seed, position)
        for p, position in zip(params, positions, strict=True)
    ]
    want_logprobs = any(p.return_log_probs for p in params)
    return _sample(logits, params, keys, want_logprobs)


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int | None],
    want_logprobs: bool,
) -> SampleOutput:
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(keys) != len(params):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match {len(params)} params / {len(keys)} keys"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    clean = _finite_above(logits)
    tokens = clean.argmax(dim=-1)  # a row of all -inf gives 0
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=logits.device)
        chosen = _sample_rows(
            clean.index_select(0, index),
            [params[row] for row in sampled_rows],
            [keys[row] for row in sampled_rows],
        )
        tokens = tokens.index_copy(0, index, chosen)
    logprobs = _chosen_logprobs(clean, tokens) if want_logprobs else None
    return SampleOutput(tokens, logprobs)


def _sample_rows(
    scores: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[int | None]
) -> torch.Tensor:
    """Gumbel-max over fp32 ``scores`` (no NaN, no +inf) for rows that all sample."""
    device = scores.device
    vocab = scores.shape[1]
    # top_k 0 ("off") and any top_k beyond the vocabulary both keep the whole vocabulary.
    settings = torch.tensor(
        [[p.temperature, min(p.top_k or vocab, vocab), p.top_p] for p in params],
        dtype=torch.float64,
    ).to(device)
    temperature = settings[:, 0:1].float()
    row_max = scores.amax(dim=-1, keepdim=True)
    # Shifted scores are <= 0 with a maximum of exactly 0, so dividing by any temperature the
    # params accept (>= 1e-5) cannot overflow to +inf; a row with no finite logit gives NaN
    # here, which becomes -inf and leaves the greedy fallback's token 0 as its argmax.
    scaled = torch.nan_to_num((scores - row_max) / temperature, nan=float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scaled = _filter_top_k_top_p(scaled, settings[:, 1].long(), settings[:, 2].float())
    noise = _gumbel_noise(scaled.shape[1], keys, device)
    return (scaled + noise).argmax(dim=-1)


def _filter_top_k_top_p(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set the scores outside each row's top-k / top-p set to -inf (rows in vocabulary order);
    ``top_k`` is in [1, vocab], ``top_p`` 1 keeps everything."""
    vocab = scores.shape[-1]
    # One descending sort serves both filters: top-k keeps a rank prefix, top-p keeps the
    # shortest prefix whose probability mass reaches top_p. Stable, so tied tokens at the top-k
    # boundary are kept by index, the same way on every device and in every batch.
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=scores.device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_scores.masked_fill(remove, float("-inf")), dim=-1)
    # A token goes when the tokens ranked before it already hold top_p of the mass: the
    # smallest set reaching top_p survives, and the first token always does (mass 0 before it).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    remove[:, 0] = False
    # Back to vocabulary order, so sampling does not depend on how ties were sorted.
    remove_by_token = torch.empty_like(remove).scatter_(1, order, remove)
    return scores.masked_fill(remove_by_token, float("-inf"))


def _gumbel_noise(vocab: int, keys: Sequence[int | None], device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` finite fp32 Gumbel noise: hashed for keyed rows, fresh for the others."""
    uniform = torch.rand(len(keys), vocab, device=device)
    # rand is in [0, 1): keep log(0) out. The top end, 1 - 2**-24, is already < 1.
    uniform.clamp_(min=torch.finfo(torch.float32).tiny)
    noise = -torch.log(-torch.log(uniform))
    keyed = [(row, key) for row, key in enumerate(keys) if key is not None]
    if keyed:
        row_keys = torch.tensor(
            [[key & _MASK_32, key >> 32] for _, key in keyed], dtype=torch.int64
        ).to(device)
        index = torch.tensor([row for row, _ in keyed], device=device)
        noise.index_copy_(0, index, _hashed_gumbel(row_keys, vocab))
    return noise


def _hashed_gumbel(row_keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise for ``[rows, 2]`` 32-bit key halves, a pure function of (key, vocab index).

    Integer ops in int64 that never overflow (every product is below 2**63), so CPU and CUDA
    compute the same bits; the uniform is built in float64 from the 32-bit hash, then the noise
    is rounded to fp32."""
    columns = torch.arange(vocab, device=row_keys.device, dtype=torch.int64).unsqueeze(0)
    state = _mix32((columns + row_keys[:, 0:1]) & _MASK_32)
    state = _mix32(state ^ row_keys[:, 1:2])
    uniform = (state.double() + 0.5) * 2.0**-32  # in (0, 1): both logs finite
    return (-torch.log(-torch.log(uniform))).float()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 over int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_2)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for 32-bit ``x`` in int64 without overflow: the product is
    split at 16 bits so each partial product stays below 2**48."""
    low = (x & 0xFFFF) * constant
    high = (((x >> 16) * constant) & 0xFFFF) << 16
    return (low + high) & _MASK_32


def _row_key(seed: int, position: int) -> int:
    """A 64-bit key for (seed, position): splitmix64 of the pair, in Python integers."""
    z = (seed * _GOLDEN_64 + position + 1) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def _chosen_logprobs(clean: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    chosen = torch.log_softmax(clean, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    # A row without a finite logit has no distribution: report the lowest finite logprob.
    return torch.nan_to_num(chosen, nan=_LOWEST_LOGPROB, neginf=_LOWEST_LOGPROB)


def _finite_above(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits where NaN is "impossible" (-inf) and +inf "certain" (the largest float, so
    shifting by the row maximum stays finite); -inf stays -inf."""
    return torch.nan_to_num(
        logits.float(),
        nan=float("-inf"),
        posinf=torch.finfo(torch.float32).max,
        neginf=float("-inf"),
    )
