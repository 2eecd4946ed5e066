"""Command-line flags for every limit in ``dpserve.limits``, their defaults read from there.

``--max-<name>`` for each ``RequestLimits`` field (``--max-body-bytes``, ...), and for each
``HttpLimits`` field ``--request-timeout`` / ``--http-<name>`` (``--http-header-timeout``,
...). docs/security.md lists them; ``tests/unit/test_flags.py`` checks that every field has
its flag and help. Also the engine backend's flags (``--backend``, ``--tensor-parallel-size``,
``--vllm-arg``) and LoRA adapters' (``--enable-lora``, ``--max-loras``, ``--max-lora-rank``,
``--lora-modules``, vLLM's names), which ``dpserve engine`` takes and ``dpserve serve`` passes
on.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final

from dpserve.limits import (
    DEFAULT_HTTP_LIMITS,
    DEFAULT_LORA_LIMITS,
    DEFAULT_REQUEST_LIMITS,
    SAMPLING_CEILINGS,
    HttpLimits,
    RequestLimits,
)

REQUEST_LIMIT_HELP: Final = {
    "max_body_bytes": "largest HTTP request body; the coordinator's message limit follows it",
    "max_prompt_chars": "characters of a prompt, or of all chat messages together",
    "max_prompt_tokens": "prompt tokens (token ids at the HTTP edge, after tokenizing at the "
    "coordinator)",
    "max_new_tokens": "largest max_tokens a request may ask for",
    "max_stop_strings": "stop strings per request",
    "max_stop_string_chars": "characters of one stop string",
    "max_stop_token_ids": "stop token ids per request (stop_token_ids)",
    "max_logit_bias_tokens": "tokens a request's logit_bias may name",
    "max_json_depth": "nesting depth of an HTTP JSON body",
    "max_top_logprobs": "alternatives per token a request may ask for (logprobs / top_logprobs)",
    "max_choices": "n (and best_of): completions generated for one prompt",
    "max_prompts": "prompts in one completions request (a list of prompts)",
    "max_request_sequences": "sequences one HTTP request may start (n or best_of x prompts)",
    "max_constraint_bytes": "bytes of a structured-output constraint (JSON schema, regex, choices)",
    "constraint_compile_timeout": "seconds a structured-output constraint may take to be "
    "checked and compiled (else 400)",
    "constraint_mask_timeout": "seconds a constraint's token mask may take per step (else 400)",
}
HTTP_LIMIT_HELP: Final = {
    "request_timeout": "seconds one generation request may take before it is cancelled (504)",
    "header_timeout": "seconds from a request's first byte to its last header (else 408, closed)",
    "body_timeout": "seconds to receive a request body once its headers arrived (else 408)",
    "keepalive_timeout": "seconds an idle keep-alive connection stays open",
    "max_connections": "open HTTP connections; one more is answered 503 and closed",
    "shutdown_timeout": "seconds in-flight requests get to finish when the front stops",
    "linger_timeout": "seconds the rest of a refused (408/413) body is still read and dropped",
}


def request_limit_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def http_limit_flag(name: str) -> str:
    return "--request-timeout" if name == "request_timeout" else "--http-" + name.replace("_", "-")


def add_request_limits(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (docs/security.md)")
    for field in dataclasses.fields(RequestLimits):
        _add(
            group,
            request_limit_flag(field.name),
            field.name,
            DEFAULT_REQUEST_LIMITS,
            REQUEST_LIMIT_HELP,
        )


# The RequestLimits an engine enforces itself: it compiles the constraints.
CONSTRAINT_LIMITS: Final = (
    "max_constraint_bytes",
    "constraint_compile_timeout",
    "constraint_mask_timeout",
)


def add_constraint_limits(parser: argparse.ArgumentParser) -> None:
    """The structured-output limits, for ``dpserve engine`` (same flags as the front's)."""
    group = parser.add_argument_group("structured-output limits (docs/security.md)")
    for name in CONSTRAINT_LIMITS:
        _add(group, request_limit_flag(name), name, DEFAULT_REQUEST_LIMITS, REQUEST_LIMIT_HELP)


def constraint_limits(args: argparse.Namespace) -> RequestLimits:
    """The engine's RequestLimits: its constraint flags, the defaults for the rest."""
    return dataclasses.replace(
        DEFAULT_REQUEST_LIMITS,
        **{name: getattr(args, "limit_" + name) for name in CONSTRAINT_LIMITS},
    )


def add_http_limits(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP timeouts and connections (docs/security.md)")
    for field in dataclasses.fields(HttpLimits):
        _add(group, http_limit_flag(field.name), field.name, DEFAULT_HTTP_LIMITS, HTTP_LIMIT_HELP)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**_values(args, RequestLimits, "limit_"))


def http_limits(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(**_values(args, HttpLimits, "http_"))


# Which engine computes: dpserve's own, or vLLM's engine core (dpserve.engine.vllm).
ENGINE_BACKENDS: Final = ("dpserve", "vllm")


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    """Which engine computes (``engine`` and ``serve``: it passes them on to each engine)."""
    parser.add_argument(
        "--backend",
        choices=ENGINE_BACKENDS,
        default="dpserve",
        help="dpserve's own engine, or vLLM's v1 engine core in the engine process (needs "
        "vLLM installed: `make vllm`; docs/architecture.md) (default: %(default)s)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs (or CPU ranks) one engine spans, vLLM's tensor parallelism (--backend vllm "
        "only; default: %(default)s)",
    )
    parser.add_argument(
        "--vllm-arg",
        dest="vllm_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one command-line token for vLLM's engine arguments, passed through after "
        "dpserve's own (--backend vllm only; repeat it: --vllm-arg=--max-model-len=4096 "
        "--vllm-arg=--enforce-eager)",
    )


def backend_flags_error(args: argparse.Namespace) -> str | None:
    """Why the backend flags cannot hold together; None when they can."""
    if args.tensor_parallel_size < 1:
        return "--tensor-parallel-size must be at least 1"
    if args.backend != "vllm":
        if args.tensor_parallel_size != 1:
            return (
                f"--tensor-parallel-size {args.tensor_parallel_size} needs --backend vllm: "
                "dpserve's own engine runs one device per engine"
            )
        if args.vllm_args:
            return "--vllm-arg needs --backend vllm"
    elif args.fake:
        return "--fake and --backend vllm contradict each other (the fake engine has no model)"
    return None


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters (dpserve's engine: ``engine.lora``; vLLM's: its own LoRA support), as
    vLLM spells them."""
    group = parser.add_argument_group("LoRA adapters (either backend; docs/lora.md)")
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: loaded at start (--lora-modules) or at run time "
        "(POST /v1/load_lora_adapter)",
    )
    group.add_argument(
        "--max-loras",
        type=_positive(int),
        default=DEFAULT_LORA_LIMITS.max_loras,
        help="adapters an engine holds loaded at once; the least recently used idle one is "
        "evicted for another (default: %(default)s)",
    )
    group.add_argument(
        "--max-lora-rank",
        type=_positive(int),
        default=DEFAULT_LORA_LIMITS.max_lora_rank,
        help="the largest rank r an engine loads (default: %(default)s)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters loaded at start, each a name (the requests' model) and a PEFT LoRA "
        "directory; implies --enable-lora",
    )


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """``--lora-modules`` as name -> path; ``ValueError`` naming a bad entry."""
    from dpserve.sampling import InvalidSamplingParams, check_lora_name

    modules: dict[str, str] = {}
    for entry in args.lora_modules:
        name, equals, path = entry.partition("=")
        if not equals or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH entries, got {entry!r}")
        try:
            check_lora_name(name)
        except InvalidSamplingParams as exc:
            raise ValueError(f"--lora-modules: {exc}") from None
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def lora_flags_error(args: argparse.Namespace) -> str | None:
    """Why the LoRA flags cannot hold together (or with the backend); None when they can."""
    try:
        lora_modules(args)
    except ValueError as exc:
        return str(exc)
    wanted = args.enable_lora or args.lora_modules
    if wanted and args.fake:
        return "--enable-lora / --lora-modules need a model (not --fake)"
    return None


def lora_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The LoRA flags to pass on to each engine (``dpserve serve``)."""
    if not (args.enable_lora or args.lora_modules):
        return ()
    passed = ["--enable-lora", "--max-loras", str(args.max_loras)]
    passed += ["--max-lora-rank", str(args.max_lora_rank)]
    if args.lora_modules:
        passed += ["--lora-modules", *args.lora_modules]
    return tuple(passed)


def _add(
    group: argparse._ArgumentGroup,
    flag: str,
    name: str,
    defaults: RequestLimits | HttpLimits,
    helps: Mapping[str, str],
) -> None:
    prefix = "http_" if isinstance(defaults, HttpLimits) else "limit_"
    default: int | float = getattr(defaults, name)
    kind = float if isinstance(default, float) else int
    group.add_argument(
        flag,
        dest=prefix + name,
        type=_positive(kind, sampling_ceiling(name) if prefix == "limit_" else None),
        default=default,
        metavar="N" if kind is int else "SECONDS",
        help=f"{helps[name]} (default: %(default)s)",
    )


def _values(
    args: argparse.Namespace, cls: type[RequestLimits] | type[HttpLimits], prefix: str
) -> dict[str, Any]:
    # Any: Namespace attributes are untyped; each one here is the number _positive parsed.
    return {f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(cls)}


def sampling_ceiling(name: str) -> int | None:
    """The most a request limit may be set to: what every engine accepts
    (``limits.SamplingCeilings``), for the limits an engine checks again; None for the others."""
    ceiling: int | None = getattr(SAMPLING_CEILINGS, name, None)
    return ceiling


def _positive(
    kind: type[int] | type[float], ceiling: int | None = None
) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        if ceiling is not None and value > ceiling:
            raise argparse.ArgumentTypeError(
                f"must be at most {ceiling} (what an engine accepts), got {text}"
            )
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse
