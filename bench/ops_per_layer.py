"""Torch operations per decoder layer in a decode step, counted with the torch profiler on CPU.

    python bench/ops_per_layer.py [--batch 8] [--context 40]

Issue 16: a GPU step replays one node per operation, so a decode step should cost few
operations per layer (goal <= 12; 36 before the fused forward). Counted on the tiny random
Llama of the tests (``tests/tiny_model.py``), a pure decode step of ``--batch`` sequences with
``--context`` tokens each, CPU:

* an operation is a top-level dispatcher call the profiler records (an ``aten::``,
  ``mkldnn::`` or ``dpserve_cpu::`` event with no operator above it): what Python asked torch
  to run. Calls that only make a view (``view``, ``slice``, ``transpose``, ...) move no data
  and are counted apart.
* per layer = (ops of the full model - ops of the same model cut to its first layer) /
  (layers - 1), so the per-step work (embedding, RoPE table lookup, masks, final norm, vocabulary
  projection) is not counted against the layers.

``count_decode_ops_per_layer`` is what ``tests/unit/test_ops_per_layer.py`` asserts;
``forward_ops_per_layer`` is what ``bench/layer_ops.py`` (for ``bench/engine_host.py``'s
``ops/layer decode: N``) counts a real engine's decode step with.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.engine.layers.kv_cache import PagedKVCache
from dpserve.engine.models.base import ForwardBatch
from dpserve.engine.models.llama import PagedLlama

# Calls that return a view of their input: no data moves, no kernel runs.
VIEW_OPS: Final = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::reshape",  # counted as a view only when no copy happened below it
        "aten::slice",
        "aten::select",
        "aten::transpose",
        "aten::t",
        "aten::permute",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::expand",
        "aten::as_strided",
        "aten::view_as_complex",
        "aten::view_as_real",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::narrow",
        "aten::detach",
        "aten::alias",
        "aten::lift_fresh",
    }
)
_COPIES_UNDER_RESHAPE: Final = frozenset({"aten::clone", "aten::copy_", "aten::contiguous"})


@dataclass(frozen=True)
class OpCount:
    total: float  # every top-level call per layer
    compute: float  # the calls that are not views
    names: dict[str, float]  # compute calls per layer, by name

    def __str__(self) -> str:
        listing = ", ".join(f"{name} x{count:g}" for name, count in sorted(self.names.items()))
        return f"{self.compute:g} ops/layer ({self.total:g} with views): {listing}"


def _is_view(event: Any) -> bool:
    name = getattr(event, "name", "")
    if name not in VIEW_OPS:
        return False
    if name == "aten::reshape":  # a reshape that had to copy is a real operation
        return not any(child.name in _COPIES_UNDER_RESHAPE for child in _descendants(event))
    return True


def _descendants(event: Any) -> list[Any]:
    found: list[Any] = []
    for child in getattr(event, "cpu_children", []):
        found.append(child)
        found += _descendants(child)
    return found


def _top_level_calls(model: PagedLlama, batch: ForwardBatch, cache: PagedKVCache) -> list[Any]:
    model.forward(batch, cache)  # warm-up: first-call allocations and lazy inits
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        model.forward(batch, cache)
    return [
        event
        for event in recorded.events()
        if event.cpu_parent is None
        and event.name.startswith(("aten::", "mkldnn::", "dpserve_cpu::"))
    ]


def _decode_batch(batch: int, context: int, block_size: int, vocab: int) -> ForwardBatch:
    per_sequence = -(-context // block_size)
    tables = torch.arange(1, 1 + batch * per_sequence, dtype=torch.int32).view(batch, per_sequence)
    last = context - 1
    slots = tables[:, last // block_size].long() * block_size + last % block_size
    return ForwardBatch(
        input_ids=torch.arange(batch, dtype=torch.long) % vocab,
        positions=torch.full((batch,), last, dtype=torch.long),
        slot_mapping=slots,
        num_decodes=batch,
        block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        prefills=[],
        logits_indices=None,
    )


def forward_ops_per_layer(model: PagedLlama, batch: ForwardBatch, cache: PagedKVCache) -> OpCount:
    """Operations per decoder layer of ``model.forward(batch, cache)`` (CPU tensors): the full
    model against the same model cut to its first layer."""
    layers = len(model.layers)
    if layers < 2:
        raise ValueError("counting per layer needs a model with at least 2 layers")
    with torch.inference_mode():
        full = _top_level_calls(model, batch, cache)
        everything = model.layers
        model.layers = everything[:1]
        try:
            single = _top_level_calls(model, batch, cache)
        finally:
            model.layers = everything
    per_layer = 1 / (layers - 1)
    names = Counter(e.name for e in full if not _is_view(e))
    names.subtract(Counter(e.name for e in single if not _is_view(e)))
    return OpCount(
        total=(len(full) - len(single)) * per_layer,
        compute=sum(names.values()) * per_layer,
        names={name: count * per_layer for name, count in names.items() if count},
    )


def count_decode_ops_per_layer(
    model_dir: str | Path, batch: int = 8, context: int = 40, block_size: int = 16
) -> OpCount:
    """Operations per decoder layer of a decode step of the model in ``model_dir`` (CPU)."""
    from dpserve.model_loading import load_model_and_tokenizer

    loaded, _ = load_model_and_tokenizer(str(model_dir), device="cpu")
    with torch.inference_mode():
        model = PagedLlama(loaded)
        shape = model.kv_cache_shape(block_size)
        cache = PagedKVCache(shape, 1 + batch * shape.blocks_for(context), torch.device("cpu"))
    step = _decode_batch(batch, context, block_size, model.vocab_size)
    return forward_ops_per_layer(model, step, cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Llama-family model directory (default: tiny)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=40)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model
        if model_dir is None:
            from tests.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(scratch) / "tiny")
        count = count_decode_ops_per_layer(model_dir, args.batch, args.context)
    print(count)
    print(f"ops/layer decode: {count.compute:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
