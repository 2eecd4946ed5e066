"""``dpserve http``: the OpenAI-compatible HTTP API for a coordinator."""

from __future__ import annotations

import argparse
import sys

from dpserve import flags
from dpserve.cli.common import (
    DEFAULT_HTTP_PORT,
    Subcommands,
    add_api_key_file,
    add_chat_template_flag,
    add_credentials,
    add_ready_without_engines,
    add_reply_parser_flags,
    api_keys,
    chat_template,
    client_keys,
    log,
    reply_parsers,
    tokenizer_spec,
    zmq_address,
)
from dpserve.security import bind, key_files
from dpserve.tokenizer import ChatTemplateError, as_batch_tokenizer, with_chat_template


def add_parser(subparsers: Subcommands) -> None:
    http = subparsers.add_parser(
        "http", help="serve the OpenAI-compatible HTTP API for a coordinator"
    )
    http.add_argument("--coordinator", required=True, help="tcp://HOST:PORT, HOST:PORT or PORT")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT)
    http.add_argument("--tokenizer", default=None, help="for chat templates (default: bytes)")
    http.add_argument("--model-name", default=None, help="name reported by /v1/models")
    add_credentials(http, roles=True)
    add_api_key_file(http)
    add_ready_without_engines(http)
    add_reply_parser_flags(http)
    add_chat_template_flag(http)
    flags.add_request_limits(http)
    flags.add_http_limits(http)
    http.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from dpserve.openai.server import FrontConfig, run_http_front

    address = zmq_address(args.coordinator)
    try:
        keys = client_keys(args, address)
        http_api_keys = api_keys(args)
        template = chat_template(args)
        if template is not None:  # refused now, not at the first chat request
            with_chat_template(as_batch_tokenizer(tokenizer_spec(args.tokenizer)), template)
    except (key_files.CredentialsError, ChatTemplateError) as exc:
        print(f"dpserve http: {exc}", file=sys.stderr)
        return 2
    if (http_api_keys is None or not http_api_keys.api) and not bind.is_loopback(args.host):
        log.warning(
            "HTTP on %s without --api-key-file: anyone who can reach it can use it", args.host
        )
    front = FrontConfig(
        address,
        tokenizer_spec(args.tokenizer),
        args.host,
        args.port,
        args.model_name or args.tokenizer or "dpserve",
        credentials=keys,
        api_keys=http_api_keys,
        limits=flags.request_limits(args),
        http_limits=flags.http_limits(args),
        hold_without_engines=args.ready_without_engines,
        reply_parsers=reply_parsers(args),
        chat_template=template,
    )
    asyncio.run(run_http_front(front))
    return 0
