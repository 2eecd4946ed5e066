"""Issue 16: a decode step costs at most 12 torch operations per decoder layer (36 before the
fused forward), counted with the torch profiler on CPU by ``bench/ops_per_layer.py``."""

from __future__ import annotations

from pathlib import Path

from bench.ops_per_layer import count_decode_ops_per_layer

MAX_OPS_PER_LAYER = 12


def test_a_decode_step_costs_at_most_12_operations_per_layer(tiny_model_path: Path) -> None:
    count = count_decode_ops_per_layer(tiny_model_path, batch=4, context=21)
    assert 0 < count.compute <= MAX_OPS_PER_LAYER, str(count)
    # The counter sees the real work: projections, attention and the cache write are there.
    assert count.names.get("aten::scaled_dot_product_attention", 0) == 1, str(count)
    assert count.names.get("aten::index_put_", 0) == 1, str(count)
    assert count.total >= count.compute
