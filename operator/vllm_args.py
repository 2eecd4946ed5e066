"""``spec.engine.vllm.args``: the vLLM engine flags an InferenceDeployment may pass through.

An allow-list, each flag with a check of its value, rather than free text: the flags go onto
the engine's command line, and a flag that fought what dpserve sets itself (the port it serves
on, the model, the data-parallel rank, the batch size the coordinator counts on, the prefix
cache the router predicts) would break the deployment in ways that show far from their cause.
Those are refused with the spec field that sets them; any other flag outside the list is
refused too, naming the list. What is taken is written back in one form (``--flag`` and
``--flag value``), in the order given.

Items are written as on vLLM's command line: ``--max-model-len=8192`` or ``--max-model-len``,
``8192`` as two items.
``tests/unit/test_operator_vllm_args.py`` parses every allowed flag with vLLM's own argument
parser where vLLM is installed (``DPSERVE_VLLM_PYTHON``), so the list cannot name a flag or a
choice vLLM does not have.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

# A check returns what is wrong with a value, or None when it is fine.
Check = Callable[[str], str | None]


def _integer(minimum: int) -> Check:
    def check(value: str) -> str | None:
        if not re.fullmatch(r"[0-9]+", value) or int(value) < minimum:
            return f"must be an integer >= {minimum}, got {value!r}"
        return None

    return check


def _fraction(value: str) -> str | None:
    """A number in (0, 1], such as --gpu-memory-utilization's share of a GPU's memory."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 < number <= 1:  # also refuses nan and inf
        return f"must be a number in (0, 1], got {value!r}"
    return None


def _non_negative_number(value: str) -> str | None:
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 <= number < float("inf"):
        return f"must be a number >= 0, got {value!r}"
    return None


def _choice(*choices: str) -> Check:
    def check(value: str) -> str | None:
        if value not in choices:
            return f"must be one of {', '.join(choices)}; got {value!r}"
        return None

    return check


_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


def _revision(value: str) -> str | None:
    if not _REVISION.fullmatch(value):
        return f"{value!r} is not a branch, tag or commit name"
    return None


@dataclass(frozen=True)
class Flag:
    """An allowed flag: ``check`` validates its value; None means it takes no value."""

    check: Check | None


# Names vLLM 0.32 knows (QUANTIZATION_METHODS, --kv-cache-dtype's and --load-format's
# choices), the ones people deploy: the weights' formats, the KV cache's, how weights are read.
QUANTIZATIONS: Final = (
    "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "experts_int8",
    "fbgemm_fp8", "fp8", "inc", "modelopt", "modelopt_fp4", "moe_wna16", "mxfp4", "quark",
    "torchao",
)  # fmt: skip
KV_CACHE_DTYPES: Final = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS: Final = (
    "auto", "pt", "safetensors", "npcache", "dummy", "fastsafetensors", "runai_streamer",
    "sharded_state", "mistral",
)  # fmt: skip

ALLOWED: Final[dict[str, Flag]] = {
    "--quantization": Flag(_choice(*QUANTIZATIONS)),
    "--kv-cache-dtype": Flag(_choice(*KV_CACHE_DTYPES)),
    "--max-model-len": Flag(_integer(1)),
    "--max-num-batched-tokens": Flag(_integer(1)),
    "--gpu-memory-utilization": Flag(_fraction),
    "--cpu-offload-gb": Flag(_non_negative_number),
    "--enable-lora": Flag(None),
    "--max-loras": Flag(_integer(1)),
    "--max-lora-rank": Flag(_choice("1", "8", "16", "32", "64", "128", "256", "320", "512")),
    "--enforce-eager": Flag(None),
    "--enable-chunked-prefill": Flag(None),
    "--no-enable-chunked-prefill": Flag(None),
    "--enable-expert-parallel": Flag(None),
    "--trust-remote-code": Flag(None),
    "--revision": Flag(_revision),
    "--load-format": Flag(_choice(*LOAD_FORMATS)),
    "--seed": Flag(_integer(0)),
}

# Flags dpserve sets itself, with the spec field that sets them instead (or why none does).
SET_BY_DPSERVE: Final[dict[str, str]] = {
    "--model": "the model is spec.model",
    "--tokenizer": "the coordinator tokenizes with spec.model's tokenizer",
    "--served-model-name": "the model is spec.model",
    "--host": "engines listen on no port: they dial the coordinator",
    "--port": "engines listen on no port: they dial the coordinator",
    "--api-key": "the coordinator's front checks the API token (the -client-credentials Secret)",
    "--dtype": "set spec.engine.dtype",
    "--max-num-seqs": "set spec.engine.maxBatchSize (the capacity the coordinator counts on)",
    "--enable-prefix-caching": "set spec.engine.prefixCaching",
    "--no-enable-prefix-caching": "set spec.engine.prefixCaching",
    "--tensor-parallel-size": "set spec.engine.tensorParallelSize",
    "-tp": "set spec.engine.tensorParallelSize",
    "--pipeline-parallel-size": "an engine is one pod: its GPUs are spec.engine.tensorParallelSize",
    "-pp": "an engine is one pod: its GPUs are spec.engine.tensorParallelSize",
    "--data-parallel-size": "set spec.dataParallelSize (one engine per data-parallel rank)",
    "-dp": "set spec.dataParallelSize (one engine per data-parallel rank)",
    "--distributed-executor-backend": "dpserve runs vLLM's own multiprocess executor",
    "--kv-events-config": "dpserve reads vLLM's KV events for prefix-aware routing",
    "--device": "set spec.engine.device",
}
# Flags of `vllm serve`'s front, not of its engine: dpserve's HTTP front stands in its place.
NOT_OFFERED: Final[dict[str, str]] = {
    "--lora-modules": "list the adapters in spec.adapters (dpserve loads them into vLLM's "
    "engine and routes by them)",
}
# Every --data-parallel-* flag (rank, address, RPC port, ...): data parallelism is dpserve's.
_DATA_PARALLEL_PREFIX = "--data-parallel-"


class VllmArgsError(ValueError):
    """``problems`` lists every item that was refused, each starting with its path."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _flag_name(item: str) -> str:
    """vLLM's parser takes --max_model_len for --max-model-len: compare in one spelling."""
    if item.startswith("--"):
        return "--" + item[2:].replace("_", "-")
    return item


def parse_vllm_args(items: Sequence[str], path: str) -> tuple[str, ...]:
    """The allowed flags of ``items`` in one form, or ``VllmArgsError`` naming each bad item
    by its index under ``path`` (``spec.engine.vllm.args[2]``)."""
    problems: list[str] = []
    result: list[str] = []
    seen: set[str] = set()
    index = 0
    while index < len(items):
        at = f"{path}[{index}]"
        item = items[index]
        index += 1
        if not item.startswith("-"):
            problems.append(f"{at}: {item!r} is not a flag (a value must follow its flag)")
            continue
        raw_name, has_inline, inline = item.partition("=")
        name = _flag_name(raw_name)
        reason = SET_BY_DPSERVE.get(name)
        if reason is None and name.startswith(_DATA_PARALLEL_PREFIX):
            reason = SET_BY_DPSERVE["--data-parallel-size"]
        if reason is not None:
            problems.append(f"{at}: {raw_name} is set by dpserve: {reason}")
            index = _skip_values(items, index, has_inline)
            continue
        if name in NOT_OFFERED:
            problems.append(f"{at}: {raw_name} is not offered: {NOT_OFFERED[name]}")
            index = _skip_values(items, index, has_inline)
            continue
        flag = ALLOWED.get(name)
        if flag is None:
            problems.append(
                f"{at}: {raw_name} is not an allowed vLLM flag; allowed: {', '.join(ALLOWED)}"
            )
            index = _skip_values(items, index, has_inline)
            continue
        if name in seen:
            problems.append(f"{at}: {name} is given twice")
        seen.add(name)
        if flag.check is None:
            if has_inline:
                problems.append(f"{at}: {name} takes no value, got {inline!r}")
            else:
                result.append(name)
            continue
        if has_inline:
            value: str | None = inline
        elif index < len(items) and not items[index].startswith("--"):
            value, index = items[index], index + 1
        else:
            value = None
        if value is None:
            problems.append(f"{at}: {name} needs a value")
            continue
        problem = flag.check(value)
        if problem is not None:
            problems.append(f"{at}: {name} {problem}")
        else:
            result.extend([name, value])
    if problems:
        raise VllmArgsError(problems)
    return tuple(result)


def _skip_values(items: Sequence[str], index: int, has_inline: str) -> int:
    """Past the values of a refused flag, so that they are not reported as stray values too."""
    if not has_inline:
        while index < len(items) and not items[index].startswith("-"):
            index += 1
    return index
