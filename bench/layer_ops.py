"""Torch ops per decoder layer in one decode step, counted with the torch profiler on CPU.

    python bench/layer_ops.py

Counts the top-level ``aten::`` ops (those not called from inside another aten op), views
left out (they launch nothing), of one decode forward of ``PagedLlama`` over the paged cache,
once with every layer and once with the first layer only; the difference divided by the other
layers is what one decoder layer costs (the embedding, the final norm and the LM head cancel
out). On a GPU each of these ops is at
least one kernel, so this is the number of nodes a decode graph replays per layer.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import EngineRequest
from dpserve.sampling import SamplingParams

# Ops that only make a new view of the same memory: no kernel on any device.
VIEW_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "view",
        "reshape",
        "_reshape_alias",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "transpose",
        "t",
        "permute",
        "expand",
        "as_strided",
        "chunk",
        "split",
        "split_with_sizes",
        "narrow",
        "alias",
        "detach",
        "unflatten",
    )
)


def _top_level_aten_ops(run: Any) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in VIEW_OPS:
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def decode_ops_per_layer(runner: ModelRunner) -> int:
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
        runner.add(EngineRequest(10**9, list(range(16, 48)), params))
        while runner.has_work():
            runner.step()
    finally:
        backend._forward = forward
    decode = next(b for b in reversed(captured) if not b.prefills)
    model, cache = backend.model, backend.cache
    layers = model.layers
    if len(layers) < 2:
        raise ValueError("need a model with at least two layers")
    with torch.inference_mode():
        full = _top_level_aten_ops(lambda: model.forward(decode, cache))
        model.layers = layers[:1]
        try:
            one = _top_level_aten_ops(lambda: model.forward(decode, cache))
        finally:
            model.layers = layers
    return (full - one) // (len(layers) - 1)


def main() -> None:
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        path = build_tiny_model(Path(scratch) / "tiny")
        runner = ModelRunner(str(path), device="cpu", kv_cache_bytes=1 << 24)
        print(f"ops/layer decode: {decode_ops_per_layer(runner)}")


if __name__ == "__main__":
    main()
