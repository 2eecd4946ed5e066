"""dpserve's ``SamplingParams`` as vLLM's.

vLLM samples (logit bias, temperature, min-p, top-k / top-p, seed, penalties, structured output)
and computes the log-probs; dpserve's ``sequences.Sequence`` applies the finishing rules to what
it sampled (EOS, ``termination_id`` and ``stop_token_ids``, ``min_tokens``, stop strings, the
length), exactly as dpserve's own engine does, so the text and the finish reasons are the same
on both engines. vLLM is therefore told to stop only at ``max_tokens`` (``ignore_eos``, no stop
tokens, no stop strings, no ``min_tokens``: vLLM's ``min_tokens`` masks the stop tokens, where
dpserve's returns one sampled early as an ordinary token).
"""

from __future__ import annotations

from typing import Any

from dpserve.engine.vllm.resumed_penalties import resumed_penalties_args
from dpserve.sampling import SamplingParams


def structured_output(params: SamplingParams) -> dict[str, Any] | None:
    """The keyword arguments of vLLM's ``StructuredOutputsParams`` for the request's
    constraint; None without one."""
    if params.guided_json is not None:
        return {"json": params.guided_json}
    if params.guided_json_object:
        return {"json_object": True}
    if params.guided_regex is not None:
        return {"regex": params.guided_regex}
    if params.guided_choice:
        return {"choice": list(params.guided_choice)}
    return None


def vllm_sampling_kwargs(
    params: SamplingParams, max_tokens: int, resumed: int = 0
) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` for ``params``, generating at most
    ``max_tokens`` (what is left after ``resumed`` resume tokens, the end of vLLM's prompt)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    alternatives = params.top_logprobs
    kwargs: dict[str, Any] = {
        "n": 1,
        # Greedy as dpserve's engine decides it (a tiny temperature, or top_k 1).
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "logit_bias": dict(params.logit_bias) or None,
        "seed": None if params.greedy else params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        # vLLM returns the sampled token's log-prob and this many alternatives.
        "logprobs": alternatives if params.return_log_probs else None,
        "prompt_logprobs": alternatives if params.prompt_logprobs else None,
        # The engine server decodes (or ``StopText`` did): vLLM's detokenizer is not used.
        "detokenize": False,
    }
    if resumed and (params.presence_penalty or params.frequency_penalty):
        # The resumed tokens count as generated (``resumed_penalties``), which applies the
        # repetition penalty too, before the presence and frequency vLLM subtracts.
        kwargs["extra_args"] = resumed_penalties_args(resumed, params.repetition_penalty)
        kwargs["repetition_penalty"] = 1.0
    return kwargs


def vllm_sampling_params(params: SamplingParams, max_tokens: int, resumed: int = 0) -> Any:
    """vLLM's ``SamplingParams`` (vLLM imported here)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = vllm_sampling_kwargs(params, max_tokens, resumed)
    constraint = structured_output(params)
    if constraint is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(**constraint)
    return VllmSamplingParams(**kwargs)
