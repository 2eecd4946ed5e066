"""``dpserve engine``: one data-parallel engine, fake or with a model."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dpserve import cpu_settings, flags
from dpserve.cli.common import (
    VLLM_INSTALL_HINT,
    Subcommands,
    add_credentials,
    add_kv_cache_flags,
    log,
    zmq_address,
)
from dpserve.engine.defaults import DEFAULT_MAX_NUM_SEQS
from dpserve.engine.fake import DEFAULT_CONTEXT_SIZE as DEFAULT_FAKE_CONTEXT_SIZE
from dpserve.engine.layers import weight_format
from dpserve.security import key_files

if TYPE_CHECKING:
    from dpserve.engine.runner import Runner


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


def engine_device(requested: str, rank: int) -> str:
    """One GPU per engine: on CUDA, engine rank r uses GPU r modulo the GPUs it can see (on
    Kubernetes every engine pod sees exactly its own one)."""
    if requested == "cpu":
        return requested
    import torch

    if not torch.cuda.is_available():
        return requested
    return f"cuda:{rank % torch.cuda.device_count()}"


def add_parser(subparsers: Subcommands) -> None:
    engine = subparsers.add_parser("engine", help="run one data-parallel engine")
    engine.add_argument("--coordinator", required=True, help="tcp://HOST:PORT, HOST:PORT or PORT")
    engine.add_argument("--rank", default="0", help="integer, or 'auto' (pod ordinal)")
    engine.add_argument("--model", default=None, help="model dir or hub id (default: SmolLM2)")
    engine.add_argument("--fake", action="store_true", help="deterministic tokens, no model")
    flags.add_backend_flags(engine)
    engine.add_argument("--step-delay", type=float, default=0.0, help="seconds per fake step")
    engine.add_argument(
        "--fake-prefill-cost",
        type=float,
        default=0.0,
        help="seconds a fake step takes per prompt token its simulated prefix cache lacks",
    )
    engine.add_argument(
        "--fake-cache-blocks",
        type=int,
        default=4096,
        help="blocks the fake engine's simulated prefix cache holds (default: %(default)s)",
    )
    engine.add_argument(
        "--context-size",
        type=int,
        default=DEFAULT_FAKE_CONTEXT_SIZE,
        help="the fake engine's context in tokens (a model's comes from its config)",
    )
    engine.add_argument(
        "--max-num-seqs",
        "--max-batch-size",  # its older name: manifests and scripts still pass it
        dest="max_num_seqs",
        type=int,
        default=None,
        help="sequences running at once, the engine's capacity (default: derived from the KV "
        f"cache pool; {DEFAULT_MAX_NUM_SEQS} for --fake)",
    )
    engine.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_kv_cache_flags(engine)
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
    flags.add_constraint_limits(engine)
    flags.add_lora_flags(engine)
    weight_format.add_flag(engine)
    add_credentials(engine)
    engine.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dpserve.engine.connection import EngineConnection, EngineRefused
    from dpserve.engine.server import EngineServer

    rank = resolve_rank(args.rank)
    why = (
        flags.backend_flags_error(args)
        or flags.lora_flags_error(args)
        or cpu_settings.error()
        or weight_format.flag_error(args)
    )
    if why is None and args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        why = (
            f"--backend vllm needs vLLM, which {sys.executable} cannot import: {VLLM_INSTALL_HINT}"
        )
    if why is not None:
        print(f"dpserve engine: {why}", file=sys.stderr)
        return 2
    if not args.fake and args.backend == "dpserve":
        # Before the model loads: a bad setting should not cost a load to find.
        from dpserve.model_loading import pick_device_and_dtype

        try:
            device, dtype = pick_device_and_dtype(engine_device(args.device, rank), args.dtype)
        except ValueError as exc:
            print(f"dpserve engine: {exc}", file=sys.stderr)
            return 2
        why = weight_format.refusal(args.cpu_weights, device_type=device.type, dtype=dtype)
        if why is not None:
            print(f"dpserve engine: {why}", file=sys.stderr)
            return 2
    try:
        runner = _runner(args, rank)
    except ValueError as exc:
        # A format the model's backend cannot honour (the transformers fallback), found once
        # the model is loaded: one line, as the checks above.
        if not isinstance(exc, weight_format.WeightFormatRefused):
            raise
        print(f"dpserve engine: {exc}", file=sys.stderr)
        return 2
    runner.warm_up()
    address = zmq_address(args.coordinator)
    try:
        keys = key_files.load_peer_keys(args.credentials, "engine") if args.credentials else None
    except key_files.CredentialsError as exc:
        print(f"dpserve engine: {exc}", file=sys.stderr)
        return 2
    server = EngineServer(
        EngineConnection(address, rank, runner.max_num_seqs, credentials=keys),
        runner,
        stream_interval=args.stream_interval,
        coordinator_timeout=args.coordinator_timeout,
        ready_file=args.ready_file,
    )
    server.install_signal_handlers()
    log.info("engine rank %d serving %s via %s", rank, "fake" if args.fake else args.model, address)
    try:
        code = server.run()
    except EngineRefused as exc:
        log.error("%s", exc)
        code = 1
    # A runner with processes of its own (vLLM's model workers) stops them first.
    shutdown = getattr(runner, "shutdown", None)
    if callable(shutdown):
        shutdown()
    # Leave now: the socket is closed and the coordinator told. The interpreter's own
    # teardown of a model process (torch's thread pools, a GiB of tensors) took 4-9 s, and on
    # Kubernetes sometimes the whole grace period, holding up the pod's replacement.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _runner(args: argparse.Namespace, rank: int) -> Runner:
    """The fake runner, or the model with its KV cache (torch imported only here)."""
    if args.fake:
        from dpserve.engine.fake import FakeRunner
        from dpserve.engine.fake_cache import SimulatedPrefixCache

        cache = None
        if not args.no_prefix_caching:
            cache = SimulatedPrefixCache(args.fake_cache_blocks, args.block_size)
        return FakeRunner(
            max_num_seqs=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            step_delay=args.step_delay,
            max_context=args.context_size,
            prefix_cache=cache,
            prefill_cost=args.fake_prefill_cost,
        )
    if args.backend == "vllm":
        return _vllm_runner(args)
    import torch
    from transformers.utils import logging as transformers_logging

    from dpserve.engine.cpus import torch_threads
    from dpserve.engine.model_runner import ModelRunner
    from dpserve.model_loading import resolve_model

    # An engine's log is read line by line (`kubectl logs`, a supervisor's file): the weight
    # loader's progress bar, redrawn with carriage returns, is one unreadable line there.
    transformers_logging.disable_progress_bar()
    threads, source = torch_threads(args.torch_threads)
    torch.set_num_threads(threads)
    log.info("engine rank %d: %d torch thread(s), from %s", rank, threads, source)
    return ModelRunner(
        resolve_model(args.model),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        device=engine_device(args.device, rank),
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_graphs=not args.no_cuda_graphs,
        prefix_caching=not args.no_prefix_caching,
        limits=flags.constraint_limits(args),
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_modules=flags.lora_modules(args),
        cpu_weights=args.cpu_weights,
    )


def _vllm_runner(args: argparse.Namespace) -> Runner:
    """vLLM's engine core over the model (vLLM imported only here, from its own install)."""
    from dpserve.engine.defaults import DEFAULT_BLOCK_SIZE
    from dpserve.engine.vllm.engine_args import VllmOptions
    from dpserve.engine.vllm.runner import VllmRunner
    from dpserve.model_loading import resolve_model

    options = VllmOptions(
        model=resolve_model(args.model),
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # dpserve's default block size (16) is not one vLLM's CPU attention takes: vLLM then
        # picks its own; a size given on purpose is passed on.
        block_size=None if args.block_size == DEFAULT_BLOCK_SIZE else args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_caching=not args.no_prefix_caching,
        enable_lora=bool(args.enable_lora or args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        eager=args.no_cuda_graphs,
        threads=args.torch_threads,
        extra=tuple(args.vllm_args),
    )
    return VllmRunner(options, flags.constraint_limits(args), flags.lora_modules(args))
