"""OpenAI-compatible HTTP front: aiohttp over one ``InferenceClient``.

Modules: ``requests`` (bodies -> prompt + ``SamplingParams``), ``responses`` (JSON and SSE
shapes), ``errors``, ``generate`` (one request through the client), ``metrics``, ``health``,
``app`` (routes, middlewares) and ``server`` (bind and serve; connect the client). Nothing
here starts processes: ``dpserve.supervise`` and ``dpserve.local`` do.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (ready: the coordinator answers and at least one engine is registered),
``GET /livez`` (the process serves) and ``GET /metrics`` (Prometheus text, from a registry
owned by the app so several apps can live in one process).

API choices, where OpenAI leaves room or where this server differs:

* ``prompt`` is one string or one list of token ids; a one-element list of either is unwrapped.
  Several prompts in one request are rejected with 400: send one request per prompt.
* ``model`` may be omitted or name anything: one model is served and its name is reported.
* ``n`` and ``best_of`` must be 1; ``echo``, ``suffix``, penalties, ``logit_bias``, ``tools``
  and non-text ``response_format`` are rejected (400) rather than silently ignored. Other
  unknown fields are ignored, as the OpenAI SDKs send a few this server has no use for.
* ``max_tokens`` defaults to 16 for completions (OpenAI's default) and to
  ``DEFAULT_CHAT_MAX_TOKENS`` for chat (OpenAI's is "until the context is full"; a bound keeps
  a forgotten ``max_tokens`` from holding an engine for minutes).
* ``top_k`` is an extension (0 or -1 disables it). ``logprobs`` returns the sampled tokens'
  log-probabilities only (no alternatives) and is not available with ``stream``.
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
