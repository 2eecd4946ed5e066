"""``dpserve coordinator``: the coordinator (and optionally the HTTP front) in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys

from dpserve import flags
from dpserve.cli.common import (
    DEFAULT_ZMQ_PORT,
    Subcommands,
    add_api_key_file,
    add_chat_template_flag,
    add_credentials,
    add_ready_without_engines,
    add_reply_parser_flags,
    api_keys,
    chat_template,
    reply_parsers,
    tokenizer_spec,
)
from dpserve.coordinator.config import CoordinatorConfig, flag_fields
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.limits import MESSAGE_HEADROOM_BYTES
from dpserve.security import bind, key_files
from dpserve.tokenizer import ChatTemplateError, as_batch_tokenizer, with_chat_template


def add_parser(subparsers: Subcommands) -> None:
    coordinator = subparsers.add_parser(
        "coordinator", help="run the coordinator (and optionally the HTTP front) in the foreground"
    )
    _add_coordinator_config(coordinator)
    coordinator.add_argument("--port", type=int, default=DEFAULT_ZMQ_PORT, help="ZMQ port")
    coordinator.add_argument(
        "--data-parallel-size", type=int, default=0, help="engines to wait for before serving"
    )
    coordinator.add_argument(
        "--tokenizer",
        default=None,
        help="model directory, hub id or 'smollm2-135m-instruct' (default: byte-level tokenizer)",
    )
    coordinator.add_argument(
        "--routing",
        choices=[p.value for p in RoutingPolicy],
        default=None,
        help="default: prefix-aware (round-robin with --deterministic)",
    )
    coordinator.add_argument("--deterministic", action="store_true", help="reproducible routing")
    coordinator.add_argument("--http-port", type=int, default=None, help="also serve HTTP here")
    add_credentials(coordinator)
    coordinator.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without --credentials (plain, unauthenticated ZMQ)",
    )
    coordinator.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="largest ZMQ message (default: --max-body-bytes + "
        f"{MESSAGE_HEADROOM_BYTES // 1024} KiB, so every request the HTTP edge admits fits)",
    )
    flags.add_request_limits(coordinator)
    flags.add_http_limits(coordinator)
    add_api_key_file(coordinator)
    add_ready_without_engines(coordinator)
    add_reply_parser_flags(coordinator)
    add_chat_template_flag(coordinator)
    coordinator.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dpserve.coordinator import DataParallelInferenceCoordinator

    front_keys = None
    try:
        bind.check_bind(args.host, secured=bool(args.credentials), insecure=args.insecure)
        if args.credentials:
            key_files.load_server_keys(args.credentials)  # refuse now, not in a child process
            if args.http_port is not None:
                front_keys = key_files.load_peer_keys(args.credentials, None)
        http_api_keys = api_keys(args)
    except (bind.InsecureBind, key_files.CredentialsError) as exc:
        print(f"dpserve coordinator: {exc}", file=sys.stderr)
        return 2
    tokenizer = tokenizer_spec(args.tokenizer)
    try:
        options = coordinator_config(args).options()
        if options["chat_template"] is not None:  # refused now, not in a child process
            with_chat_template(as_batch_tokenizer(tokenizer), options["chat_template"])
    except ChatTemplateError as exc:
        print(f"dpserve coordinator: {exc}", file=sys.stderr)
        return 2
    if args.http_port is None:
        coordinator = None
        try:
            coordinator = DataParallelInferenceCoordinator(
                None, args.data_parallel_size, tokenizer, args.port, args.deterministic, **options
            )
            signal.signal(signal.SIGTERM, lambda *_: coordinator.request_stop())
            coordinator.start()
        except KeyboardInterrupt:
            pass
        finally:
            if coordinator is not None:
                coordinator.stop()
        return 0
    from dpserve.openai.server import FrontConfig, default_model_name
    from dpserve.supervise import run_http_with_coordinator

    front = FrontConfig(
        "",  # filled in once the coordinator's socket is bound
        tokenizer,
        args.host,
        args.http_port,
        default_model_name(tokenizer),
        credentials=front_keys,
        api_keys=http_api_keys,
        limits=flags.request_limits(args),
        http_limits=flags.http_limits(args),
        hold_without_engines=args.ready_without_engines,
        reply_parsers=reply_parsers(args),
        chat_template=options["chat_template"],
    )
    return run_http_with_coordinator(args.port, args.deterministic, options, front)


def _add_coordinator_config(parser: argparse.ArgumentParser) -> None:
    """One flag per ``CoordinatorConfig`` setting that has a ``help``, with its default."""
    for setting in flag_fields():
        parser.add_argument(
            "--" + setting.name.replace("_", "-"),
            type=type(setting.default),
            default=setting.default,
            help=setting.metadata["help"],
        )


def coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    limits = flags.request_limits(args)
    return CoordinatorConfig(
        **{setting.name: getattr(args, setting.name) for setting in flag_fields()},
        # The request limits are the HTTP edge's flags (one set for both): the message limit
        # follows --max-body-bytes so that every request the edge admits fits a message.
        max_message_bytes=args.max_message_bytes or limits.max_message_bytes,
        max_prompt_tokens=limits.max_prompt_tokens,
        max_prompt_chars=limits.max_prompt_chars,
        routing=args.routing,
        # The directory, not the keys: nothing secret travels to the coordinator's process.
        credentials=args.credentials or None,
        chat_template=chat_template(args),
    )
