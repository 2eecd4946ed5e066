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
from pathlib import Path

from dpserve import flags, security
from dpserve.coordinator.config import CoordinatorConfig, flag_fields
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.engine.fake import DEFAULT_CONTEXT_SIZE as DEFAULT_FAKE_CONTEXT_SIZE
from dpserve.limits import MESSAGE_HEADROOM_BYTES

log = logging.getLogger("dpserve")

DEFAULT_ZMQ_PORT = 5555
DEFAULT_HTTP_PORT = 8000


def _setup_logging(verbose: bool) -> None:
    from dpserve.supervise import configure_logging

    configure_logging(logging.DEBUG if verbose else logging.INFO)


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

    front_keys = None
    try:
        security.check_bind(args.host, secured=bool(args.credentials), insecure=args.insecure)
        if args.credentials:
            security.load_server_keys(args.credentials)  # refuse now, not in a child process
            if args.http_port is not None:
                front_keys = security.load_peer_keys(args.credentials, None)
        api_keys = _api_keys(args)
    except (security.InsecureBind, security.CredentialsError) as exc:
        print(f"dpserve coordinator: {exc}", file=sys.stderr)
        return 2
    tokenizer = _tokenizer_spec(args.tokenizer)
    options = _coordinator_config(args).options()
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
        api_keys=api_keys,
        limits=flags.request_limits(args),
        http_limits=flags.http_limits(args),
    )
    return run_http_with_coordinator(args.port, args.deterministic, options, front)


def _tokenizer_spec(tokenizer: str | None) -> str | None:
    if tokenizer is None or tokenizer == "bytes":
        return None
    from dpserve.models import resolve_model

    return resolve_model(tokenizer)


def _api_keys(args: argparse.Namespace) -> tuple[bytes, ...] | None:
    return security.load_api_keys(args.api_key_file) if args.api_key_file else None


def _client_keys(args: argparse.Namespace, address: str) -> security.PeerKeys | None:
    """Keys from --credentials (or $DPSERVE_CREDENTIALS); for a coordinator on this machine
    without them, the throw-away keys of the ``dpserve serve`` on that port, if one runs."""
    directory = args.credentials or None
    if directory is None:
        host, _, port = address.split("://", 1)[-1].rpartition(":")
        if port.isdigit() and security.is_loopback(host):
            directory = security.find_local_credentials(int(port))
    return None if directory is None else security.load_peer_keys(directory, args.role)


# -------------------------------------------------------------------------- engine


def engine_device(requested: str, rank: int) -> str:
    """One GPU per engine: on CUDA, engine rank r uses GPU r modulo the GPUs it can see (on
    Kubernetes every engine pod sees exactly its own one)."""
    if requested == "cpu":
        return requested
    import torch

    if not torch.cuda.is_available():
        return requested
    return f"cuda:{rank % torch.cuda.device_count()}"


def _add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
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
        "--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA"
    )


def _kv_cache_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``serve``'s KV-cache flags as the engine command line takes them (only those given)."""
    out = ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    out += ["--block-size", str(args.block_size)]
    if args.kv_cache_bytes is not None:
        out += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.max_num_batched_tokens is not None:
        out += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_cuda_graphs:
        out.append("--no-cuda-graphs")
    return tuple(out)


def cmd_engine(args: argparse.Namespace) -> int:
    from dpserve.engine.connection import CoordinatorConnection, CoordinatorRefused
    from dpserve.engine.runner import Runner
    from dpserve.engine.server import EngineServer

    rank = resolve_rank(args.rank)
    runner: Runner
    if args.fake:
        from dpserve.engine.fake import FakeRunner

        runner = FakeRunner(
            capacity=args.max_batch_size or 256,
            step_delay=args.step_delay,
            max_context=args.context_size,
        )
    else:
        import torch

        from dpserve.engine.cpus import torch_threads
        from dpserve.engine.model_runner import ModelRunner
        from dpserve.models import resolve_model

        threads, source = torch_threads(args.torch_threads)
        torch.set_num_threads(threads)
        log.info("engine rank %d: %d torch thread(s), from %s", rank, threads, source)
        runner = ModelRunner(
            resolve_model(args.model),
            max_batch_size=args.max_batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=args.dtype,
            device=engine_device(args.device, rank),
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_graphs=not args.no_cuda_graphs,
        )
    address = _zmq_address(args.coordinator)
    try:
        keys = security.load_peer_keys(args.credentials, "engine") if args.credentials else None
    except security.CredentialsError as exc:
        print(f"dpserve engine: {exc}", file=sys.stderr)
        return 2
    server = EngineServer(
        CoordinatorConnection(address, rank, runner.capacity, credentials=keys),
        runner,
        stream_interval=args.stream_interval,
        coordinator_timeout=args.coordinator_timeout,
        ready_file=args.ready_file,
    )
    server.install_signal_handlers()
    log.info("engine rank %d serving %s via %s", rank, "fake" if args.fake else args.model, address)
    try:
        return server.run()
    except CoordinatorRefused as exc:
        log.error("%s", exc)
        return 1


def _zmq_address(address: str) -> str:
    from dpserve.client import coordinator_address

    return coordinator_address(address)


# -------------------------------------------------------------------- local mode


def cmd_serve(args: argparse.Namespace) -> int:
    from dpserve.local import LocalDeployment, serve

    try:
        if args.credentials and args.insecure:
            raise security.CredentialsError("--insecure and --credentials contradict each other")
        if args.credentials:  # every process of the deployment reads its part of this one
            security.load_server_keys(args.credentials)
            security.load_peer_keys(args.credentials, "engine")
            security.load_peer_keys(args.credentials, None)
        api_keys = _api_keys(args)
    except security.CredentialsError as exc:
        print(f"dpserve serve: {exc}", file=sys.stderr)
        return 2
    if args.fake:
        model_path, model_name = "fake", "fake"
    else:
        from dpserve.models import DEFAULT_MODEL, resolve_model

        model_name = args.model or DEFAULT_MODEL
        model_path = resolve_model(args.model)
    deployment = LocalDeployment(
        model_path=model_path,
        data_parallel_size=args.data_parallel_size,
        port=args.port,
        http_port=None if args.http_port == 0 else args.http_port,
        max_batch_size=args.max_batch_size,
        torch_threads=args.torch_threads,
        kv_cache_args=_kv_cache_args(args),
        fake=args.fake,
        credentials=args.credentials or None,
        api_keys=api_keys,
        limits=flags.request_limits(args),
        http_limits=flags.http_limits(args),
    )
    return serve(deployment, model_name, throwaway_keys=not (args.credentials or args.insecure))


def cmd_http(args: argparse.Namespace) -> int:
    import asyncio

    from dpserve.openai.server import FrontConfig, run_http_front

    address = _zmq_address(args.coordinator)
    try:
        keys = _client_keys(args, address)
        api_keys = _api_keys(args)
    except security.CredentialsError as exc:
        print(f"dpserve http: {exc}", file=sys.stderr)
        return 2
    if api_keys is None and not security.is_loopback(args.host):
        log.warning(
            "HTTP on %s without --api-key-file: anyone who can reach it can use it", args.host
        )
    front = FrontConfig(
        address,
        _tokenizer_spec(args.tokenizer),
        args.host,
        args.port,
        args.model_name or args.tokenizer or "dpserve",
        credentials=keys,
        api_keys=api_keys,
        limits=flags.request_limits(args),
        http_limits=flags.http_limits(args),
    )
    asyncio.run(run_http_front(front))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import asyncio

    from dpserve.client import ClientError, InferenceClient
    from dpserve.sampling import InvalidSamplingParams, SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            num_tokens_to_generate=args.max_tokens,
            seed=args.seed,
        )
    except InvalidSamplingParams as exc:
        print(f"dpserve generate: {exc}", file=sys.stderr)
        return 2
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        keys = _client_keys(args, _zmq_address(args.address))
    except security.CredentialsError as exc:
        print(f"dpserve generate: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        async with InferenceClient(
            args.address,
            handshake_timeout=min(args.timeout, 10.0),
            startup_timeout=args.timeout,
            credentials=keys,
        ) as client:
            if args.stream:
                async for chunk in client.stream(prompt, params):
                    print(chunk.text, end="", flush=True)
                print()
            else:
                record = await asyncio.wait_for(client.add_request(prompt, params), args.timeout)
                print(record.generated_text)

    try:
        asyncio.run(run())
    except (ClientError, TimeoutError) as exc:
        print(f"dpserve generate: {exc or 'timed out'}", file=sys.stderr)
        return 1
    return 0


def cmd_keys_generate(args: argparse.Namespace) -> int:
    try:
        root = security.generate_credentials(args.directory, force=args.force)
    except (security.CredentialsError, OSError) as exc:
        print(f"dpserve keys generate: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {root}/: coordinator, engine, client and admin key pairs (*.key public, "
        "*.key_secret secret, mode 0600) and allowed/{engine,client,admin}/.\n"
        "Give each process only its part: the coordinator coordinator.key_secret + allowed/, "
        "an engine engine.key_secret + coordinator.key, a client client.key_secret (or "
        "admin.key_secret) + coordinator.key. See docs/security.md."
    )
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    from dpserve_operator.main import run

    run(
        namespace=args.namespace,
        all_namespaces=args.all_namespaces,
        liveness_port=args.liveness_port,
    )
    return 0


# ------------------------------------------------------------------------- parser


def _add_coordinator_config(parser: argparse.ArgumentParser) -> None:
    """One flag per ``CoordinatorConfig`` setting that has a ``help``, with its default."""
    for setting in flag_fields():
        parser.add_argument(
            "--" + setting.name.replace("_", "-"),
            type=type(setting.default),
            default=setting.default,
            help=setting.metadata["help"],
        )


def _coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
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
    )


def _add_credentials(parser: argparse.ArgumentParser, roles: bool = False) -> None:
    parser.add_argument(
        "--credentials",
        metavar="DIR",
        default=os.environ.get(security.ENV_CREDENTIALS),
        help=f"CURVE keys (`dpserve keys generate DIR`; env {security.ENV_CREDENTIALS})",
    )
    if roles:
        parser.add_argument(
            "--role",
            choices=[security.ADMIN, security.CLIENT],
            default=None,
            help="which key of --credentials to use (default: admin if present, else client)",
        )


def _add_api_key_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        default=os.environ.get(security.ENV_API_KEY_FILE),
        help="HTTP /v1/* require `Authorization: Bearer <a line of this file>` "
        f"(env {security.ENV_API_KEY_FILE})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpserve", description="Data-parallel LLM inference: coordinator, engines, HTTP."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    coordinator = commands.add_parser(
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
        help="default: least-outstanding (round-robin with --deterministic)",
    )
    coordinator.add_argument("--deterministic", action="store_true", help="reproducible routing")
    coordinator.add_argument("--http-port", type=int, default=None, help="also serve HTTP here")
    _add_credentials(coordinator)
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
    _add_api_key_file(coordinator)
    coordinator.set_defaults(func=cmd_coordinator)

    engine = commands.add_parser("engine", help="run one data-parallel engine")
    engine.add_argument("--coordinator", required=True, help="tcp://HOST:PORT, HOST:PORT or PORT")
    engine.add_argument("--rank", default="0", help="integer, or 'auto' (pod ordinal)")
    engine.add_argument("--model", default=None, help="model dir or hub id (default: SmolLM2)")
    engine.add_argument("--fake", action="store_true", help="deterministic tokens, no model")
    engine.add_argument("--step-delay", type=float, default=0.0, help="seconds per fake step")
    engine.add_argument(
        "--context-size",
        type=int,
        default=DEFAULT_FAKE_CONTEXT_SIZE,
        help="the fake engine's context in tokens (a model's comes from its config)",
    )
    engine.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="sequences running at once (default: derived from the KV cache pool)",
    )
    engine.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    _add_kv_cache_flags(engine)
    engine.add_argument("--stream-interval", type=float, default=0.05)
    engine.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's thread count (default: the cores this engine may use: its CPU affinity, "
        "capped by its container's CPU limit)",
    )
    engine.add_argument(
        "--coordinator-timeout",
        type=float,
        default=5.0,
        help="seconds a heartbeat may go unanswered before registering again (default: 5)",
    )
    engine.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="a file that exists exactly while the engine is registered (readiness probes)",
    )
    _add_credentials(engine)
    engine.set_defaults(func=cmd_engine)

    serve = commands.add_parser(
        "serve", help="run a coordinator, engines and the HTTP front on this machine"
    )
    serve.add_argument("--data-parallel-size", type=int, default=2, help="engines (default: 2)")
    serve.add_argument("--model", default=None, help="model dir or hub id (default: SmolLM2)")
    serve.add_argument("--port", type=int, default=DEFAULT_ZMQ_PORT, help="ZMQ port")
    serve.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port (0: no HTTP)"
    )
    serve.add_argument("--max-batch-size", type=int, default=None)
    _add_kv_cache_flags(serve)
    serve.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads per engine (default: this process's cores divided among the engines)",
    )
    serve.add_argument("--fake", action="store_true", help="fake engines, no model")
    serve.add_argument(
        "--credentials",
        metavar="DIR",
        default=os.environ.get(security.ENV_CREDENTIALS),
        help="CURVE keys for every process (default: throw-away keys, removed on exit)",
    )
    serve.add_argument(
        "--insecure", action="store_true", help="plain ZMQ on loopback: no keys at all"
    )
    _add_api_key_file(serve)
    flags.add_request_limits(serve)
    flags.add_http_limits(serve)
    serve.set_defaults(func=cmd_serve)

    http = commands.add_parser(
        "http", help="serve the OpenAI-compatible HTTP API for a coordinator"
    )
    http.add_argument("--coordinator", required=True, help="tcp://HOST:PORT, HOST:PORT or PORT")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT)
    http.add_argument("--tokenizer", default=None, help="for chat templates (default: bytes)")
    http.add_argument("--model-name", default=None, help="name reported by /v1/models")
    _add_credentials(http, roles=True)
    _add_api_key_file(http)
    flags.add_request_limits(http)
    flags.add_http_limits(http)
    http.set_defaults(func=cmd_http)

    generate = commands.add_parser("generate", help="send one prompt and print the completion")
    generate.add_argument("prompt")
    generate.add_argument(
        "--address", default=f"tcp://127.0.0.1:{DEFAULT_ZMQ_PORT}", help="coordinator address"
    )
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stream", action="store_true", help="print tokens as they come")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    generate.add_argument("--timeout", type=float, default=120.0)
    _add_credentials(generate, roles=True)
    generate.set_defaults(func=cmd_generate)

    keys = commands.add_parser("keys", help="create CURVE keys (see docs/security.md)")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    generate_keys = key_commands.add_parser(
        "generate", help="write a coordinator key pair, role key pairs and allowed/<role>/"
    )
    generate_keys.add_argument("directory", metavar="DIR")
    generate_keys.add_argument("--force", action="store_true", help="replace existing key pairs")
    generate_keys.set_defaults(func=cmd_keys_generate)

    operator = commands.add_parser("operator", help="run the Kubernetes operator (kopf)")
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument("--namespace", default=None, help="watch one namespace")
    scope.add_argument(
        "--all-namespaces", action="store_true", help="watch the whole cluster (the default)"
    )
    operator.add_argument("--liveness-port", type=int, default=8080)
    operator.set_defaults(func=cmd_operator)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
