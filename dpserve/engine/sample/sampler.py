"""Next-token selection for a whole batch on the device, each row with its own ``SamplingParams``.

``sample(logits, params, positions)`` does every row with tensor ops and returns tensors; the
caller copies them to the host once (``SampleOutput.tolist``).

* Greedy rows (``SamplingParams.greedy``: temperature below 1e-5, or top_k 1) take the argmax.
* Sampling rows use the Gumbel-max trick: ``argmax(scores / T + g)`` with ``g`` Gumbel noise
  draws from ``softmax(scores / T)`` restricted to the min-p, top-k and top-p set (that order,
  as vLLM's), without multinomial.
* A seeded row's noise is a counter-based hash of (seed, position, vocabulary index), computed
  with integer tensor ops: the same seed at the same position picks the same token whatever
  else is in the batch, on any device, and a request resumed on another engine continues the
  same draw. Unseeded rows use fresh noise from torch's global generator.
* Numerics are guarded rather than trusted: NaN logits count as -inf, +inf as the largest
  float; scores are shifted so the row maximum is 0 before dividing by the temperature (no
  overflow for any valid temperature); the noise is finite; a row with no finite logit at all
  falls back to token 0 through the greedy path. Nothing non-finite reaches an argmax as NaN.
* A row's ``logit_bias`` is added to its tokens' scores first (greedy rows too), then
  penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``) are applied to
  the rows that ask for them, at the tokens each has seen only (``penalties``); a
  structured-output row's disallowed tokens (``allowed``) are -inf. Both change the
  scores tokens are chosen from, not the reported log-probs, which stay the model's own
  distribution (vLLM's default, "raw" log-probs).
* Top log-probs: one ``topk`` over the whole batch's log-softmax with the largest k any row
  asked for; each row keeps its own k when copied to the host.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dpserve.engine.kernels import triton_greedy
from dpserve.engine.sample.penalties import RowTokens, apply_penalties
from dpserve.sampling import SamplingParams

_MASK_32 = 0xFFFFFFFF
_MASK_64 = (1 << 64) - 1
# lowbias32's multipliers (Wellons' hash prospector): a strong 32-bit integer mix.
_MIX_1 = 0x7FEB352D
_MIX_2 = 0x846CA68B
_GOLDEN_64 = 0x9E3779B97F4A7C15
# Logprob reported for a token the model gives no probability at all (JSON has no -inf).
_LOWEST_LOGPROB = torch.finfo(torch.float32).min


# A token and its log-probability: one of a position's most likely alternatives.
TopEntry = tuple[int, float]


@dataclass(frozen=True, slots=True)
class HostSample:
    tokens: list[int]
    logprobs: list[float] | None  # None when no row asked for log-probs
    # Per row its top_logprobs most likely (token, log-prob), most likely first; None when no
    # row asked for alternatives ([] for a row that did not).
    top: list[list[TopEntry]] | None


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: torch.Tensor  # [batch] int64, on the logits' device
    # [batch] fp32: each chosen token's log-probability under the model's own distribution
    # (before temperature, penalties and filtering); None when no row asked for logprobs.
    logprobs: torch.Tensor | None = None
    # [batch, k] the k most likely tokens and their log-probs (k the largest any row asked for)
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_counts: tuple[int, ...] = ()  # each row's own k

    def tolist(self) -> tuple[list[int], list[float] | None]:
        """Tokens and logprobs as Python lists, with one device-to-host copy."""
        host = self.to_host()
        return host.tokens, host.logprobs

    def to_host(self) -> HostSample:
        """Everything as Python lists with one device-to-host copy: float64 holds every token
        id exactly, so all of it travels as one tensor."""
        if self.logprobs is None and self.top_ids is None:
            return HostSample(self.tokens.tolist(), None, None)
        columns = [self.tokens.double().unsqueeze(1)]
        if self.logprobs is not None:
            columns.append(self.logprobs.double().unsqueeze(1))
        if self.top_ids is not None and self.top_logprobs is not None:
            columns += [self.top_ids.double(), self.top_logprobs.double()]
        rows = torch.cat(columns, dim=1).tolist()
        tokens = [int(row[0]) for row in rows]
        if self.logprobs is None:
            return HostSample(tokens, None, None)
        logprobs = [row[1] for row in rows]
        if self.top_ids is None:
            return HostSample(tokens, logprobs, None)
        k = self.top_ids.shape[1]
        top = [
            [(int(row[2 + i]), row[2 + k + i]) for i in range(count)]
            for row, count in zip(rows, self.top_counts, strict=True)
        ]
        return HostSample(tokens, logprobs, top)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    histories: Sequence[RowTokens] | None = None,
    allowed: torch.Tensor | None = None,
) -> SampleOutput:
    """One token per row of ``logits`` (``[batch, vocab]``, any float dtype). ``positions[i]``
    is the index in its sequence of the token row ``i`` samples (prompt plus tokens so far): with
    a seed it selects the noise, so the same (seed, position, logits) give the same token.
    ``histories`` (one per row) are needed when a row has penalties; ``allowed`` (bool
    ``[batch, vocab]``, on the logits' device) restricts the rows of structured requests."""
    if len(positions) != len(params):
        raise ValueError(f"{len(positions)} positions for {len(params)} params")
    keys = [
        None if p.seed is None else _row_key(p.seed, position)
        for p, position in zip(params, positions, strict=True)
    ]
    want_logprobs = any(p.return_log_probs for p in params)
    return _sample(logits, params, keys, want_logprobs, histories, allowed)


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int | None],
    want_logprobs: bool,
    histories: Sequence[RowTokens] | None = None,
    allowed: torch.Tensor | None = None,
) -> SampleOutput:
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(keys) != len(params):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match {len(params)} params / {len(keys)} keys"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not want_logprobs and allowed is None and all(p.plain_greedy for p in params):
        # The common batch: argmax in the model's dtype. The fp32 copy and its clean-up would
        # be three passes over [batch, vocab] (0.2 ms a step at batch 256 of a 128k vocabulary
        # on an H100) for the same tokens: the fp32 values are the same numbers.
        return SampleOutput(greedy(logits))
    clean = _finite_above(logits)
    scores = clean
    if any(p.logit_bias for p in params):
        scores = _apply_logit_bias(scores, params)
    penalized = [row for row, p in enumerate(params) if p.has_penalties]
    if penalized:
        if histories is None or len(histories) != len(params):
            raise ValueError("penalties need one token history per row")
        scores = apply_penalties(scores, penalized, params, histories)
    if allowed is not None:
        if allowed.shape != scores.shape:
            raise ValueError(f"allowed {tuple(allowed.shape)} does not match the logits")
        scores = scores.masked_fill(~allowed, float("-inf"))
    tokens = scores.argmax(dim=-1)  # a row of all -inf gives 0
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=logits.device)
        chosen = _sample_rows(
            scores.index_select(0, index),
            [params[row] for row in sampled_rows],
            [keys[row] for row in sampled_rows],
        )
        tokens = tokens.index_copy(0, index, chosen)
    if not want_logprobs:
        return SampleOutput(tokens)
    log_probs = _log_softmax(clean)
    chosen_logprobs = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    counts = tuple(p.top_logprobs if p.return_log_probs else 0 for p in params)
    k = min(max(counts), log_probs.shape[1])
    if k == 0:
        return SampleOutput(tokens, chosen_logprobs)
    top_logprobs, top_ids = log_probs.topk(k, dim=-1)
    return SampleOutput(
        tokens, chosen_logprobs, top_ids, top_logprobs, tuple(min(c, k) for c in counts)
    )


def _apply_logit_bias(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``scores`` (a new tensor) with each row's ``logit_bias`` added to its tokens (vLLM's
    order: before the penalties). A row's tokens and biases are tensors built once per distinct
    bias (``_bias_tensors``), so a step's cost does not grow with the Python objects."""
    rows, tokens, biases = [], [], []
    for row, p in enumerate(params):
        if p.logit_bias:
            ids, values = _bias_tensors(p.logit_bias)
            rows.append(torch.full((len(ids),), row, dtype=torch.long))
            tokens.append(ids)
            biases.append(values)
    index = (torch.cat(rows).to(scores.device), torch.cat(tokens).to(scores.device))
    return scores.index_put(index, torch.cat(biases).to(scores.device), accumulate=True)


@functools.lru_cache(maxsize=1024)
def _bias_tensors(pairs: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``logit_bias``'s token ids and biases as host tensors (shared: never written)."""
    ids = torch.tensor([token for token, _ in pairs], dtype=torch.long)
    return ids, torch.tensor([bias for _, bias in pairs], dtype=torch.float32)


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
    if any(p.min_p > 0.0 for p in params):
        scaled = _filter_min_p(scaled, [p.min_p for p in params])
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scaled = _filter_top_k_top_p(scaled, settings[:, 1].long(), settings[:, 2].float())
    noise = _gumbel_noise(scaled.shape[1], keys, device)
    return (scaled + noise).argmax(dim=-1)


def _filter_min_p(scaled: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Set to -inf the ``scaled`` scores (temperature applied, each row's maximum exactly 0)
    of tokens less likely than ``min_p`` x their row's most likely token: ``p / p_max`` is
    ``exp(score)``, so the threshold is ``log(min_p)`` (-inf for 0: nothing goes; the most
    likely token always stays)."""
    floor = torch.tensor(min_p, dtype=torch.float32).log().to(scaled.device).unsqueeze(1)
    return scaled.masked_fill(scaled < floor, float("-inf"))


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


def _log_softmax(clean: torch.Tensor) -> torch.Tensor:
    """Log-probs with -inf and NaN (a row without a finite logit has no distribution) reported
    as the lowest finite float: JSON has no -inf."""
    return torch.nan_to_num(
        torch.log_softmax(clean, dim=-1), nan=_LOWEST_LOGPROB, neginf=_LOWEST_LOGPROB
    )


def log_probs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SampleOutput:
    """The log-probs of given ``tokens`` (``[rows]``) under ``logits`` and each row's ``k`` most
    likely alternatives: what prompt log-probs report for the prompt's own tokens."""
    log_probs = _log_softmax(_finite_above(logits))
    chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = min(k, log_probs.shape[1])
    if k == 0:
        return SampleOutput(tokens, chosen)
    top_logprobs, top_ids = log_probs.topk(k, dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs, (k,) * tokens.shape[0])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row, NaN counted as -inf (``_finite_above``'s rule; a row of all
    -inf or NaN gives 0)."""
    inf = float("inf")
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX_DTYPES:
        # torch's CPU argmax over the last dimension is not vectorized: numpy's is, ~8x
        # faster (batch 256 of a 384-token vocabulary: 93 -> 11 us). Both return the first
        # maximal index of a row, so the tokens are the same. numpy's picks a NaN where a row
        # has one: only then are NaNs made -inf (a pass over the logits) and picked again.
        values = logits.detach().numpy()
        picked = values.argmax(axis=-1)
        if np.isnan(values[np.arange(len(picked)), picked]).any():
            picked = np.nan_to_num(values, nan=-inf, posinf=inf, neginf=-inf).argmax(axis=-1)
        return torch.from_numpy(picked)
    if logits.device.type == "cuda" and triton_greedy.verified(logits.device):
        return triton_greedy.greedy(logits)  # one pass over the logits, not two kernels
    return torch.nan_to_num(logits, nan=-inf, posinf=inf, neginf=-inf).argmax(dim=-1)


_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64, torch.float16)


def _finite_above(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits where NaN is "impossible" (-inf) and +inf "certain" (the largest float, so
    shifting by the row maximum stays finite); -inf stays -inf."""
    return torch.nan_to_num(
        logits.float(),
        nan=float("-inf"),
        posinf=torch.finfo(torch.float32).max,
        neginf=float("-inf"),
    )
