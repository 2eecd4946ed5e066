"""``dpserve serve``: a coordinator, engines and the HTTP front on this machine."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from dpserve import cpu_settings, flags
from dpserve.cli.common import (
    DEFAULT_HTTP_PORT,
    DEFAULT_ZMQ_PORT,
    VLLM_INSTALL_HINT,
    Subcommands,
    add_api_key_file,
    add_chat_template_flag,
    add_kv_cache_flags,
    add_reply_parser_flags,
    api_keys,
    chat_template,
    reply_parsers,
)
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.engine.layers import weight_format
from dpserve.security import key_files
from dpserve.tokenizer import ChatTemplateError, as_batch_tokenizer, with_chat_template

# Where `make vllm` put the Python of vLLM's own install (the Makefile sets it for the tests).
VLLM_PYTHON_ENV = "DPSERVE_VLLM_PYTHON"
# What the engines' Python must import for --backend vllm, asked before any engine starts: an
# engine that cannot import them dies at start, and serve restarts it until it counts a crash
# loop (~30 s of tracebacks). vLLM is found, not imported: importing it takes seconds.
_VLLM_PYTHON_PROBE = """
import importlib.util, sys
missing = [] if importlib.util.find_spec("vllm") else ["vllm"]
try:
    import dpserve  # imported, not found: an editable install's checkout may be gone
except ImportError as exc:
    missing.insert(0, f"dpserve ({exc})")
sys.exit(" or ".join(missing) or None)
"""


def add_parser(subparsers: Subcommands) -> None:
    serve = subparsers.add_parser(
        "serve", help="run a coordinator, engines and the HTTP front on this machine"
    )
    serve.add_argument(
        "--data-parallel-size",
        type=int,
        default=None,
        help="engines (default: one per NUMA node of the cores this process may use, each "
        "pinned to its node: one on most machines)",
    )
    serve.add_argument("--model", default=None, help="model dir or hub id (default: SmolLM2)")
    serve.add_argument("--port", type=int, default=DEFAULT_ZMQ_PORT, help="ZMQ port")
    serve.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port (0: no HTTP)"
    )
    serve.add_argument(
        "--max-num-seqs",
        "--max-batch-size",  # its older name
        dest="max_num_seqs",
        type=int,
        default=None,
        help="each engine's sequences running at once (default: derived from its KV pool)",
    )
    add_kv_cache_flags(serve)
    serve.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads per engine (default: this process's cores divided among the engines)",
    )
    serve.add_argument("--fake", action="store_true", help="fake engines, no model")
    flags.add_backend_flags(serve)
    serve.add_argument(
        "--engine-python",
        default=None,
        metavar="PATH",
        help="the Python that runs the engines (default for --backend vllm: $"
        f"{VLLM_PYTHON_ENV} if set, else this one; vLLM has an install of its own: `make "
        "vllm`; for --backend dpserve: this one)",
    )
    serve.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="seconds per fake engine step, to watch streams (with --fake; default: 0)",
    )
    serve.add_argument(
        "--routing",
        choices=[p.value for p in RoutingPolicy],
        default=None,
        help="the coordinator's routing policy (default: prefix-aware)",
    )
    serve.add_argument(
        "--credentials",
        metavar="DIR",
        default=os.environ.get(key_files.ENV_CREDENTIALS),
        help="CURVE keys for every process (default: throw-away keys, removed on exit)",
    )
    serve.add_argument(
        "--insecure", action="store_true", help="plain ZMQ on loopback: no keys at all"
    )
    add_api_key_file(serve)
    add_reply_parser_flags(serve)
    add_chat_template_flag(serve)
    flags.add_request_limits(serve)
    flags.add_http_limits(serve)
    flags.add_lora_flags(serve)
    weight_format.add_flag(serve)
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dpserve.engine.cpus import numa_core_sets
    from dpserve.local import LocalDeployment, child_environment, serve

    if args.data_parallel_size is not None and args.data_parallel_size < 1:
        print("dpserve serve: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    if args.http_port and args.http_port == args.port:
        print(
            f"dpserve serve: the HTTP port and the coordinator's ZMQ port are both {args.port}: "
            "give --http-port and --port different ports",
            file=sys.stderr,
        )
        return 2
    if args.step_delay and not args.fake:
        print("dpserve serve: --step-delay is for fake engines (--fake)", file=sys.stderr)
        return 2
    if args.step_delay < 0:
        print("dpserve serve: --step-delay must not be negative", file=sys.stderr)
        return 2
    why = (
        flags.backend_flags_error(args)
        or flags.lora_flags_error(args)
        or cpu_settings.error()
        or weight_format.flag_error(args)
    )
    if why is not None:
        print(f"dpserve serve: {why}", file=sys.stderr)
        return 2
    try:
        if args.credentials and args.insecure:
            raise key_files.CredentialsError("--insecure and --credentials contradict each other")
        if args.credentials:  # every process of the deployment reads its part of this one
            key_files.load_server_keys(args.credentials)
            key_files.load_peer_keys(args.credentials, "engine")
            key_files.load_peer_keys(args.credentials, None)
        http_api_keys = api_keys(args)
    except key_files.CredentialsError as exc:
        print(f"dpserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        template = chat_template(args)
        if template is not None and args.fake:
            raise ChatTemplateError("--chat-template needs a model (fake engines have none)")
    except ChatTemplateError as exc:
        print(f"dpserve serve: {exc}", file=sys.stderr)
        return 2
    engine_python = _engine_python(args)
    if (
        args.backend == "vllm"
        and (why := _vllm_python_error(engine_python, child_environment())) is not None
    ):
        print(f"dpserve serve: {why}", file=sys.stderr)
        return 2
    if args.fake:
        model_path, model_name = "fake", "fake"
    else:
        from dpserve.model_loading import DEFAULT_MODEL, resolve_model

        model_name = args.model or DEFAULT_MODEL
        model_path = resolve_model(args.model)
        if template is not None:  # refused now, not by the processes it starts
            try:
                with_chat_template(as_batch_tokenizer(model_path), template)
            except ChatTemplateError as exc:
                print(f"dpserve serve: {exc}", file=sys.stderr)
                return 2
    deployment = LocalDeployment(
        model_path=model_path,
        data_parallel_size=args.data_parallel_size or len(numa_core_sets()),
        port=args.port,
        http_port=None if args.http_port == 0 else args.http_port,
        max_num_seqs=args.max_num_seqs,
        torch_threads=args.torch_threads,
        kv_cache_args=_kv_cache_args(args),
        lora_args=flags.lora_args(args),
        cpu_weights_args=weight_format.flag_args(args),
        fake=args.fake,
        step_delay=args.step_delay,
        backend=args.backend,
        tensor_parallel_size=args.tensor_parallel_size,
        vllm_args=tuple(args.vllm_args),
        engine_python=engine_python,
        routing=args.routing,
        credentials=args.credentials or None,
        api_keys=http_api_keys,
        limits=flags.request_limits(args),
        http_limits=flags.http_limits(args),
        reply_parsers=reply_parsers(args),
        chat_template=template,
    )
    return serve(deployment, model_name, throwaway_keys=not (args.credentials or args.insecure))


def _engine_python(args: argparse.Namespace) -> str:
    """The interpreter of the engine processes: vLLM's install for --backend vllm."""
    if args.engine_python:
        return str(args.engine_python)
    if args.backend == "vllm":
        return os.environ.get(VLLM_PYTHON_ENV) or sys.executable
    return sys.executable


def _vllm_python_error(python: str, environment: dict[str, str]) -> str | None:
    """Why ``python`` cannot run vLLM engines (it lacks vLLM or dpserve, in the engines'
    ``environment``); None when it can."""
    try:
        probe = subprocess.run(
            [python, "-c", _VLLM_PYTHON_PROBE],
            capture_output=True,
            text=True,
            timeout=60,
            env=environment,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        cause = f"it cannot be run ({exc})"
    else:
        if probe.returncode == 0:
            return None
        lines = probe.stderr.strip().splitlines()
        cause = f"it cannot import {lines[-1] if lines else f'them (exit {probe.returncode})'}"
    return (
        f"--backend vllm runs its engines with {python}, and {cause}. {VLLM_INSTALL_HINT}; "
        f"name its Python with --engine-python or ${VLLM_PYTHON_ENV}"
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
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    return tuple(out)
