"""Next-token selection for a batch of sequences, each with its own ``SamplingParams``.

Greedy rows (temperature 0 or top_k 1) take the argmax over the whole batch in one call. Rows
that sample are filtered together (temperature, then top-k and top-p from one sort), and each
draws with its own ``torch.Generator`` when it has a seed: a seeded request consumes exactly
one draw from its own generator per token, so its tokens do not depend on which other
requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpserve.sampling import SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for a seeded request; ``None`` (the global RNG) for an unseeded one."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (``[batch, vocab]``); returns ``[batch]`` int64."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match {len(params)} params / "
            f"{len(generators)} generators"
        )
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return tokens

    device = logits.device
    index = torch.tensor(sampled_rows, device=device)
    # Filtering in fp32: bf16 cumulative sums are too coarse for top-p boundaries.
    scores = logits.index_select(0, index).float()
    temperatures = torch.tensor(
        [params[row].temperature for row in sampled_rows], device=device, dtype=scores.dtype
    )
    scores = scores / temperatures.unsqueeze(1)

    filtered = [
        i for i, row in enumerate(sampled_rows) if params[row].top_k > 0 or params[row].top_p < 1.0
    ]
    if filtered:
        filtered_index = torch.tensor(filtered, device=device)
        kept = _filter_top_k_top_p(
            scores.index_select(0, filtered_index),
            [params[sampled_rows[i]] for i in filtered],
        )
        scores.index_copy_(0, filtered_index, kept)

    probs = torch.softmax(scores, dim=-1)
    choices = torch.empty(len(sampled_rows), dtype=torch.long, device=device)
    for i, row in enumerate(sampled_rows):
        # Per-row draws over the vocabulary in its own order: a seeded request's token then
        # depends only on its logits and its generator, not on its batch mates.
        choices[i] = torch.multinomial(probs[i], 1, generator=generators[row])[0]
    tokens[index] = choices
    return tokens


def _filter_top_k_top_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set the scores outside each row's top-k / top-p set to -inf (rows in vocabulary order)."""
    device = scores.device
    # One descending sort serves both filters: top-k keeps a rank prefix, top-p keeps the
    # shortest prefix whose probability mass reaches top_p.
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    vocab = scores.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device).clamp(max=vocab)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=scores.dtype)
    probs = torch.softmax(sorted_scores.masked_fill(remove, float("-inf")), dim=-1)
    # A token goes when the tokens ranked before it already hold top_p of the mass: the
    # smallest set reaching top_p survives, and the first token always does.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    # Back to vocabulary order, so sampling does not depend on how ties were sorted.
    remove_by_token = torch.empty_like(remove).scatter_(1, order, remove)
    return scores.masked_fill(remove_by_token, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each chosen token under the raw model distribution (no temperature
    or filtering), as OpenAI-style APIs report it; ``[batch]`` fp32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
