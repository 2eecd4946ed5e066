"""Torch ops per decoder layer in one decode step, counted with the torch profiler on CPU.

    python bench/layer_ops.py

A real engine's decode step (a ``ModelRunner`` serving one request), counted by
``bench/ops_per_layer.py``'s ``forward_ops_per_layer``: top-level dispatcher calls (``aten::``
and ``mkldnn::``, the oneDNN linears), views left out (they launch nothing), the full model
against the model cut to its first layer, so the embedding, the final norm and the LM head
cancel out. On a GPU each of these ops is at least one kernel, so this is the number of nodes a
decode graph replays per layer.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ops_per_layer import forward_ops_per_layer
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams


def decode_ops_per_layer(runner: ModelRunner) -> float:
    """Ops per decoder layer of a decode step of ``runner``'s paged model (CPU)."""
    backend: Any = runner.backend
    captured: list[Any] = []
    forward = backend._forward

    def capturing(batch: Any, *args: Any, **kwargs: Any) -> Any:
        captured.append(batch)
        return forward(batch, *args, **kwargs)

    backend._forward = capturing
    try:
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)
        runner.add(RunnerRequest(10**9, list(range(16, 48)), params))
        while runner.has_work():
            runner.step()
    finally:
        backend._forward = forward
    decode = next(b for b in reversed(captured) if not b.prefills)
    return forward_ops_per_layer(backend.model, decode, backend.cache).compute


def main() -> None:
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        path = build_tiny_model(Path(scratch) / "tiny")
        runner = ModelRunner(str(path), device="cpu", kv_cache_bytes=1 << 24)
        print(f"ops/layer decode: {decode_ops_per_layer(runner)}")


if __name__ == "__main__":
    main()
