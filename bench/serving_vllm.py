"""``dpserve serve --backend vllm`` against ``vllm serve`` itself, and against ``dpserve serve``
with its own engine: the same model, the same vLLM settings, the same guidellm load as
``serving_cpu.py`` (its levels, counting and table).

    python bench/serving_vllm.py                         # c = 1, 4, 8, 16, medians of 3
    python bench/serving_vllm.py --levels 1,4 --repeat 1 --burst 0 --vllm-flags ""  # compiled

What dpserve's coordinator and HTTP front cost around vLLM's engine is the gap between the
first two (issue 32's goal: <= 5 % output tokens/s, <= 5 ms TTFT p50); what they add (exact
failover, prefix-aware routing) is tested in ``tests/integration/test_vllm_*.py``. Both vLLM
servers run vLLM's own install (``make vllm``; ``--vllm-python``) with the same engine flags
(``--vllm-flags``, default eager: no minutes of torch.compile at each start) and the same KV
cache (2 GiB) and float32 weights; each binds its compute threads the way vLLM does by default
(one core here, the other left to its front end). guidellm comes from ``--peers`` as for
``serving_cpu.py``. At c = 8 guidellm itself takes about half a core, on a 2-core machine
taken from the servers; ``plain_load_vllm.py`` runs the first two under a client that costs
almost nothing. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import glob
import shlex
import sys
from pathlib import Path

from serving_cpu import _VLLM_SHIM, Server, _free_port, dpserve_server
from serving_cpu import main as serving_main

KV_CACHE_BYTES = 2 * 1024**3


def _default_vllm_python() -> str:
    found = sorted(glob.glob(str(Path.home() / ".cache/dpserve/vllm/*/venv/bin/python")))
    return found[-1] if found else ""


def build(
    args: argparse.Namespace, vllm_python: str, vllm_flags: list[str]
) -> tuple[list[Server], list[str]]:
    model = str(args.model)
    own = dpserve_server("dpserve serve (own engine)", model, [])
    backend = vllm_backend(model, vllm_python, vllm_flags)
    return [backend, vllm_serve(model, vllm_python, vllm_flags), own], []


def vllm_backend(model: str, vllm_python: str, vllm_flags: list[str]) -> Server:
    """``dpserve serve --backend vllm`` of ``model``: one engine, the bench's KV cache, vLLM's
    ``vllm_flags`` passed through."""
    return dpserve_server(
        "dpserve serve --backend vllm",
        model,
        [
            "--backend", "vllm", "--data-parallel-size", "1",
            "--kv-cache-bytes", str(KV_CACHE_BYTES), "--engine-python", vllm_python,
            *(f"--vllm-arg={flag}" for flag in vllm_flags),
        ],
    )  # fmt: skip


def vllm_serve(model: str, vllm_python: str, vllm_flags: list[str]) -> Server:
    """``vllm serve`` of ``model`` on a free loopback port: float32, the bench's KV cache."""
    port = _free_port()
    return Server(
        name="vllm serve",
        argv=[
            vllm_python, "-c", _VLLM_SHIM, "serve", model, "--dtype", "float32",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--port", str(port),
            "--host", "127.0.0.1", *vllm_flags,
        ],
        port=port,
    )  # fmt: skip


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--vllm-python`` for the benches that start only their own servers."""
    parser.add_argument(
        "--model",
        type=Path,
        default=Path.home() / ".cache/dpserve/models/smollm2-135m-instruct",
        help="a model directory every server reads (default: the embedded SmolLM2)",
    )
    parser.add_argument("--vllm-python", default=_default_vllm_python())


def missing_install(args: argparse.Namespace) -> str | None:
    """Why the bench cannot run (no vLLM install, no model), or None."""
    if not args.vllm_python or not Path(args.vllm_python).exists():
        return "no vLLM install: run `make vllm` (or pass --vllm-python)"
    if not args.model.is_dir():
        return f"no model at {args.model}: run `dpserve serve` once"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--vllm-python", default=_default_vllm_python())
    parser.add_argument(
        "--vllm-flags",
        default="--enforce-eager",
        help="vLLM engine flags for both vLLM servers (default: %(default)s)",
    )
    ours, rest = parser.parse_known_args(argv)
    if not ours.vllm_python or not Path(ours.vllm_python).exists():
        print("no vLLM install: run `make vllm` (or pass --vllm-python)", file=sys.stderr)
        return 2
    flags = shlex.split(ours.vllm_flags)
    return serving_main(rest, build=lambda args: build(args, ours.vllm_python, flags))


if __name__ == "__main__":
    sys.exit(main())
