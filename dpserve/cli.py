"""``dpserve`` command line: one subcommand per process kind."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Sequence

from dpserve.coordinator.routing import RoutingPolicy

log = logging.getLogger("dpserve")

DEFAULT_ZMQ_PORT = 5555
DEFAULT_HTTP_PORT = 8000


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )


def resolve_rank(rank: str) -> int:
    """An integer, or ``auto``: the trailing ordinal of ``$POD_NAME`` or the hostname, which is
    how a StatefulSet numbers its pods (``demo-engine-3`` -> 3)."""
    if rank != "auto":
        return int(rank)
    name = os.environ.get("POD_NAME") or socket.gethostname()
    match = re.search(r"-(\d+)$", name)
    if match is None:
        raise SystemExit(f"--rank auto: cannot find an ordinal at the end of {name!r}")
    return int(match.group(1))


# --------------------------------------------------------------------- coordinator


def cmd_coordinator(args: argparse.Namespace) -> int:
    from dpserve.coordinator import DataParallelInferenceCoordinator

    tokenizer = _tokenizer_spec(args.tokenizer)
    options = {
        "host": args.host,
        "routing": args.routing,
        "heartbeat_timeout": args.heartbeat_timeout,
        "queue_timeout": args.queue_timeout,
    }
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
    from dpserve.http import run_http_with_coordinator

    return run_http_with_coordinator(args, tokenizer, options)


def _tokenizer_spec(tokenizer: str | None) -> str | None:
    if tokenizer is None or tokenizer == "bytes":
        return None
    from dpserve.models import resolve_model

    return resolve_model(tokenizer)


# -------------------------------------------------------------------------- engine


def cmd_engine(args: argparse.Namespace) -> int:
    from dpserve.engine.connection import CoordinatorConnection
    from dpserve.engine.server import EngineServer

    rank = resolve_rank(args.rank)
    if args.fake:
        from dpserve.engine.fake import FakeRunner

        runner = FakeRunner(capacity=args.max_batch_size or 256, step_delay=args.step_delay)
    else:
        from dpserve.engine.model_runner import ModelRunner
        from dpserve.models import resolve_model

        runner = ModelRunner(
            resolve_model(args.model),
            max_batch_size=args.max_batch_size or 8,
            dtype=args.dtype,
            device=args.device,
        )
    address = _zmq_address(args.coordinator)
    server = EngineServer(
        CoordinatorConnection(address, rank, runner.capacity),
        runner,
        stream_interval=args.stream_interval,
    )
    server.install_signal_handlers()
    log.info("engine rank %d serving %s via %s", rank, "fake" if args.fake else args.model, address)
    return server.run()


def _zmq_address(address: str) -> str:
    from dpserve.client import coordinator_address

    return coordinator_address(address)


# ------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpserve", description="Data-parallel LLM inference: coordinator, engines, HTTP."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    coordinator = commands.add_parser(
        "coordinator", help="run the coordinator (and optionally the HTTP front) in the foreground"
    )
    coordinator.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
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
        help="default: least-outstanding (round-robin with --deterministic)",
    )
    coordinator.add_argument("--deterministic", action="store_true", help="reproducible routing")
    coordinator.add_argument("--heartbeat-timeout", type=float, default=5.0)
    coordinator.add_argument("--queue-timeout", type=float, default=30.0)
    coordinator.add_argument("--http-port", type=int, default=None, help="also serve HTTP here")
    coordinator.set_defaults(func=cmd_coordinator)

    engine = commands.add_parser("engine", help="run one data-parallel engine")
    engine.add_argument("--coordinator", required=True, help="tcp://HOST:PORT, HOST:PORT or PORT")
    engine.add_argument("--rank", default="0", help="integer, or 'auto' (pod ordinal)")
    engine.add_argument("--model", default=None, help="model dir or hub id (default: SmolLM2)")
    engine.add_argument("--fake", action="store_true", help="deterministic tokens, no model")
    engine.add_argument("--step-delay", type=float, default=0.0, help="seconds per fake step")
    engine.add_argument("--max-batch-size", type=int, default=None)
    engine.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--stream-interval", type=float, default=0.05)
    engine.set_defaults(func=cmd_engine)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
