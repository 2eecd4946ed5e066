"""dpserve's engine flags as vLLM engine arguments, plus vLLM's own flags passed through.

The command line handed to vLLM's own argument parser is built from dpserve's flags first and
the pass-through arguments (``--vllm-arg``) after them, so vLLM validates every one of them
with its own messages, and a pass-through flag overrides what dpserve's flag set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Final

from dpserve.engine.cpus import VLLM_THREADS_BIND_ENV, cpu_thread_binding
from dpserve.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_CPU_KV_CACHE_BYTES
from dpserve.engine.vllm.resumed_penalties import QUALIFIED_NAME as RESUMED_PENALTIES_PROCESSOR
from dpserve.limits import SAMPLING_CEILINGS

# vLLM's CPU attention takes blocks of a multiple of 32 tokens, so dpserve's default block size
# (16) is not passed on: vLLM picks its platform's default instead.
VLLM_BLOCK_SIZE_UNSET: Final = DEFAULT_BLOCK_SIZE
# The structured-output backend dpserve's own engine uses (llguidance), so both engines mask
# the same tokens.
STRUCTURED_OUTPUT_BACKEND: Final = "guidance"


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What ``dpserve engine --backend vllm`` asks of vLLM.

    ``model``: a transformers directory or hub id. ``dtype``: "auto" is float32 on CPU (as
    dpserve's engine and transformers compute there) and the model's own dtype elsewhere.
    ``block_size``: tokens per KV block, None for vLLM's default. ``kv_cache_bytes``: the KV
    pool (default on CPU: dpserve's, 1 GiB; on GPUs: from ``gpu_memory_utilization``).
    ``enable_lora``, ``max_loras``, ``max_lora_rank``: vLLM's LoRA support, as dpserve's engine
    spells them. ``eager``: no CUDA graphs and no torch.compile (vLLM's ``--enforce-eager``).
    ``threads``: compute threads per tensor-parallel rank on CPU (None: vLLM binds its own).
    ``extra``: vLLM's own engine flags, passed through last.
    """

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    eager: bool = False
    threads: int | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)


def vllm_command_line(options: VllmOptions, *, on_cpu: bool) -> list[str]:
    """The arguments for vLLM's engine-argument parser (``EngineArgs.add_cli_args``)."""
    line = ["--model", options.model, "--tensor-parallel-size", str(options.tensor_parallel_size)]
    line += ["--dtype", "float32" if on_cpu and options.dtype == "auto" else options.dtype]
    if options.max_num_seqs is not None:
        line += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.max_num_batched_tokens is not None:
        line += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    if options.block_size is not None:
        line += ["--block-size", str(options.block_size)]
    if on_cpu:
        # On CPU vLLM reserves --gpu-memory-utilization of the machine's memory unless it is
        # told the KV cache's size.
        line += [
            "--kv-cache-memory-bytes",
            str(options.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES),
        ]
    elif options.kv_cache_bytes is not None:
        line += ["--kv-cache-memory-bytes", str(options.kv_cache_bytes)]
    else:
        line += ["--gpu-memory-utilization", str(options.gpu_memory_utilization)]
    if options.prefix_caching:
        # Events on, published nowhere: the runner takes them from the scheduler itself
        # (``kv_events.CollectedEvents``).
        events = {"enable_kv_cache_events": True, "publisher": "null"}
        line += ["--enable-prefix-caching", "--kv-events-config", json.dumps(events)]
    else:
        line.append("--no-enable-prefix-caching")
    if options.enable_lora:
        line.append("--enable-lora")
        if options.max_loras is not None:
            line += ["--max-loras", str(options.max_loras)]
        if options.max_lora_rank is not None:
            line += ["--max-lora-rank", str(options.max_lora_rank)]
    if options.eager:
        line.append("--enforce-eager")
    line += ["--structured-outputs-config", json.dumps({"backend": STRUCTURED_OUTPUT_BACKEND})]
    # Requests may ask for as many alternatives as dpserve's limit allows.
    line += ["--max-logprobs", str(SAMPLING_CEILINGS.max_top_logprobs)]
    return [*line, *options.extra]


def engine_args(options: VllmOptions) -> Any:
    """vLLM's ``EngineArgs`` for these options (vLLM imported here). Bad pass-through flags
    raise ``SystemExit`` with vLLM's parser's message, as on vLLM's own command line."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    on_cpu = current_platform.is_cpu()
    if on_cpu and options.threads is not None:
        binding = cpu_thread_binding(
            options.threads, options.tensor_parallel_size, sorted(os.sched_getaffinity(0))
        )
        os.environ[VLLM_THREADS_BIND_ENV] = binding
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="dpserve engine --vllm-arg"))
    parsed = parser.parse_args(vllm_command_line(options, on_cpu=on_cpu))
    args = EngineArgs.from_cli_args(parsed)
    if args.speculative_config is None:  # vLLM refuses custom logits processors with drafts
        # A resumed request's presence and frequency penalties count its resumed tokens.
        args.logits_processors = [*(args.logits_processors or ()), RESUMED_PENALTIES_PROCESSOR]
    return args
