"""OpenAI-compatible HTTP front: aiohttp over one ``InferenceClient``.

Modules: ``body`` (bytes -> JSON: depth, Unicode), ``requests`` (the table of known fields;
bodies -> prompt + ``SamplingParams``; every request limit), ``prompts``, ``values``,
``responses`` (JSON and SSE shapes), ``logprobs``, ``errors``, ``generate`` (one request
through the client), ``metrics``, ``health``, ``connections`` (connection cap and header
deadline), ``adapters`` (LoRA adapters: which ``model`` names are served, loading and
unloading), ``app`` (routes, middlewares) and ``server`` (bind and serve; connect the client).
Nothing here starts processes (an import-linter contract): ``dpserve.supervise`` and
``dpserve.local`` do.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's bodies),
``GET /health`` and ``GET /livez`` (liveness: 200 while the process serves), ``GET /ready``
(readiness: 200 when the coordinator answers, engines are running and one is registered and
not draining; else 503 with the reason) and ``GET /metrics`` (Prometheus text, from a registry
owned by the app so several apps can live in one process).

API choices, where OpenAI leaves room or where this server differs:

* ``prompt`` is one string or one list of token ids; a one-element list of either is unwrapped.
  Several prompts in one request are rejected with 400: send one request per prompt.
* ``model`` may be omitted or name the base model or a LoRA adapter an engine holds
  (``adapters``); while no engine serves adapters it may name anything (the base model
  answers), once one does an unknown name is a 404 naming it, as vLLM answers.
* Every field a client sends is honoured or refused: ``requests.COMPLETION_FIELDS`` and
  ``requests.CHAT_FIELDS`` list each known field and what is done with it; tools and the
  like are accepted only at their no-op values, and an unknown field is a 400
  naming it. A null value counts as absent.
* ``max_tokens`` defaults to 16 for completions (OpenAI's default) and to
  ``DEFAULT_CHAT_MAX_TOKENS`` for chat (OpenAI's is "until the context is full"; a bound keeps
  a forgotten ``max_tokens`` from holding an engine for minutes).
* Extensions (vLLM's spelling): ``top_k`` (0 or -1 disables it), ``min_p``, ``ignore_eos``,
  ``min_tokens``, ``stop_token_ids``, ``repetition_penalty``, ``cache_salt``, guided decoding,
  ``stream_options.continuous_usage_stats`` (usage in every chunk).
* ``logprobs`` returns the sampled tokens' log-probabilities and their alternatives
  (docs/openai-api.md). The token strings concatenate to the returned text.
* A streamed request that fails before its first token gets an ordinary JSON error with the
  mapped status; after the first token, an SSE ``data: {"error": ...}`` event and ``[DONE]``.
* ``stream_options.include_usage`` adds OpenAI's final usage chunk.
"""

from dpserve.openai.app import FRONT_KEY, HttpFront, create_app
from dpserve.openai.server import default_model_name, run_http_front, serve_http

__all__ = [
    "FRONT_KEY",
    "HttpFront",
    "create_app",
    "default_model_name",
    "run_http_front",
    "serve_http",
]
