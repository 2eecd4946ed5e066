"""What several subcommands share: ports, logging, credentials and key flags, KV-cache flags."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TypeAlias

from dpserve.reply_formats import REASONING_PARSERS, TOOL_CALL_PARSERS, ReplyParsers
from dpserve.security import api_tokens, bind, key_files, throwaway

log = logging.getLogger("dpserve")

DEFAULT_ZMQ_PORT = 5555
DEFAULT_HTTP_PORT = 8000
# Where a command that needs vLLM sends a user whose Python lacks it (serve, engine).
VLLM_INSTALL_HINT = (
    "vLLM has an install of its own: `make vllm` in dpserve's checkout builds it (and mends one "
    "whose dpserve points at a checkout that is gone)"
)

# argparse's subparsers action is private and not subscriptable at run time.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def setup_logging(verbose: bool) -> None:
    from dpserve.supervise import configure_logging

    configure_logging(logging.DEBUG if verbose else logging.INFO)


def tokenizer_spec(tokenizer: str | None) -> str | None:
    if tokenizer is None or tokenizer == "bytes":
        return None
    from dpserve.model_loading import resolve_tokenizer  # never the weights: only the tokenizer

    return resolve_tokenizer(tokenizer)


def api_keys(args: argparse.Namespace) -> api_tokens.ApiKeys | None:
    """The HTTP front's tokens from --api-key-file and --admin-api-key-file; None: neither."""
    api = api_tokens.load_api_keys(args.api_key_file) if args.api_key_file else ()
    admin = api_tokens.load_api_keys(args.admin_api_key_file) if args.admin_api_key_file else ()
    return api_tokens.ApiKeys(api, admin) if api or admin else None


def client_keys(args: argparse.Namespace, address: str) -> key_files.PeerKeys | None:
    """Keys from --credentials (or $DPSERVE_CREDENTIALS); for a coordinator on this machine
    without them, the throw-away keys of the ``dpserve serve`` on that port, if one runs."""
    directory = args.credentials or None
    if directory is None:
        host, _, port = address.split("://", 1)[-1].rpartition(":")
        if port.isdigit() and bind.is_loopback(host):
            directory = throwaway.find_local_credentials(int(port))
    return None if directory is None else key_files.load_peer_keys(directory, args.role)


def zmq_address(address: str) -> str:
    from dpserve.client import coordinator_address

    return coordinator_address(address)


def add_credentials(parser: argparse.ArgumentParser, roles: bool = False) -> None:
    parser.add_argument(
        "--credentials",
        metavar="DIR",
        default=os.environ.get(key_files.ENV_CREDENTIALS),
        help=f"CURVE keys (`dpserve keys generate DIR`; env {key_files.ENV_CREDENTIALS})",
    )
    if roles:
        parser.add_argument(
            "--role",
            choices=[key_files.ADMIN, key_files.CLIENT],
            default=None,
            help="which key of --credentials to use (default: admin if present, else client)",
        )


def add_api_key_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        default=os.environ.get(api_tokens.ENV_API_KEY_FILE),
        help="HTTP /v1/* require `Authorization: Bearer <a line of this file>` "
        f"(env {api_tokens.ENV_API_KEY_FILE})",
    )
    parser.add_argument(
        "--admin-api-key-file",
        metavar="PATH",
        default=os.environ.get(api_tokens.ENV_ADMIN_API_KEY_FILE),
        help="tokens (one a line) that may also call /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter; once any API key is configured, those need one of them "
        f"(env {api_tokens.ENV_ADMIN_API_KEY_FILE})",
    )


def add_reply_parser_flags(parser: argparse.ArgumentParser) -> None:
    """The HTTP front's readers of chat replies (``reply_formats``)."""
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model's format of a tool call, read out of replies to tool_choice 'auto' "
        "(OpenAI's default when a chat request sends tools); without it such requests are "
        "refused, and tool_choice 'required', 'none' or a named function still work. hermes: "
        "<tool_call>{...}</tool_call> (Hermes, Qwen2.5, Qwen3); llama3_json: "
        '{"name": ..., "parameters": {...}} (Llama 3.1-3.3)',
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="the model's thought (<think>...</think>) comes back apart from its answer, as "
        "message.reasoning (and reasoning_content); without it the thought stays in the "
        "content. deepseek_r1: DeepSeek-R1 and its distills, QwQ; qwen3: Qwen3 (also with "
        "chat_template_kwargs.enable_thinking false)",
    )


def add_chat_template_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        default=None,
        help="render chat requests with this Jinja template (a file, or the template itself) "
        "instead of the model's own: e.g. one that shows the model its tools",
    )


def chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text (raises ``ChatTemplateError`` saying why it cannot be read)."""
    from dpserve.tokenizer import read_chat_template

    return None if args.chat_template is None else read_chat_template(args.chat_template)


def reply_parsers(args: argparse.Namespace) -> ReplyParsers:
    return ReplyParsers(args.tool_call_parser, args.reasoning_parser)


def add_ready_without_engines(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ready-without-engines",
        action="store_true",
        help="/ready answers 200 (status holding) while no engine can take requests: they are "
        "held until one registers (engines autoscaled from zero)",
    )


def add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The KV-cache flags of ``engine``, which ``serve`` passes on to each engine."""
    from dpserve.engine.defaults import (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_CPU_KV_CACHE_BYTES,
        DEFAULT_GPU_MEMORY_UTILIZATION,
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
    )

    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="share of the GPU's memory for weights, activations and the KV cache "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"size of the KV cache pool in bytes (default on CPU: {DEFAULT_CPU_KV_CACHE_BYTES}; "
        "on CUDA: from --gpu-memory-utilization)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV cache block (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one engine step computes, prefill chunks and decodes together "
        f"(default: {DEFAULT_MAX_NUM_BATCHED_TOKENS['cpu']} on CPU, "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS['cuda']} on CUDA)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run every step eagerly on CUDA (no graphs of decode steps or of prompt steps)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share KV blocks of equal prompt prefixes between requests",
    )
